"""Fake CPU devices for running multi-device meshes on one host."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def env_without_forced_device_count(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) whose XLA_FLAGS no longer forces a CPU
    device count; every other XLA flag stays. For a child process that sets up its own devices
    (`--num-cpu-devices`): a parent's forced count (the tests' 8) would clash with it."""
    env = dict(os.environ if environ is None else environ)
    flags = " ".join(_DEVICE_COUNT_FLAG.sub("", env.pop("XLA_FLAGS", "")).split())
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def use_cpu_devices(count: int) -> None:
    """Give JAX `count` CPU devices; call before JAX creates its backends.

    Sets the CPU platform and `jax_num_cpu_devices` (and XLA_FLAGS for older
    JAX). Raises RuntimeError if JAX already started with fewer devices.
    """
    import jax

    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already up: checked below
    have = len(jax.devices("cpu"))
    if have < count:
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s); call dcpjax.use_cpu_devices({count}) "
            "before anything touches jax.devices() or runs a computation."
        )
