"""Fake CPU devices for running multi-device meshes on one host."""

from __future__ import annotations

import os


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
