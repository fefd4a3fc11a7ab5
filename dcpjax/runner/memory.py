"""The memory a loaded engine will take at its peak, said once at start-up so nobody has to find
out from the OOM killer.

CPU: the fake devices are all this process's host memory, so the peak is every device's weights and
KV cache together plus the runtime (Python, JAX, XLA's compiled steps and its working buffers),
which `CPU_RUNTIME_BYTES` stands for: measured about 1.1 GiB of peak RSS beyond weights + KV
for a SmolLM2 server at TP 9 whose steps load from the compilation cache, 1.7 GiB for `make
demo` (two engines, compiling), so the line errs high. A draft model's weights and a P/D
server's transfer buffers are not counted. Accelerators: the fullest device's weights + KV
against its memory limit (XLA's activations come on top)."""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)

CPU_RUNTIME_BYTES = int(1.5 * 2**30)


def expected_peak_bytes(weight_bytes_by_device: dict[jax.Device, int], kv_bytes_per_device: int) -> int:
    """CPU: this process's expected peak host memory (every device's weights and KV, and the
    runtime); accelerators: the fullest device's weights + KV."""
    devices = list(weight_bytes_by_device)
    if devices and devices[0].platform == "cpu":
        return sum(weight_bytes_by_device.values()) + kv_bytes_per_device * len(devices) + CPU_RUNTIME_BYTES
    return max(weight_bytes_by_device.values(), default=0) + kv_bytes_per_device


def log_expected_peak(weight_bytes_by_device: dict[jax.Device, int], kv_bytes_per_device: int) -> None:
    """One line: the expected peak, what it is made of, and the flags that lower it."""
    devices = list(weight_bytes_by_device)
    if not devices:
        return
    peak = expected_peak_bytes(weight_bytes_by_device, kv_bytes_per_device)
    if devices[0].platform == "cpu":
        logger.info("expected peak memory: about %.1f GiB of host memory (weights %.2f GiB + KV cache %.2f GiB over "
                    "%d devices + about %.1f GiB of runtime); lower it with --kv-cache-memory-bytes, fewer devices "
                    "(-tp) or --max-model-len", peak / 2**30, sum(weight_bytes_by_device.values()) / 2**30,
                    kv_bytes_per_device * len(devices) / 2**30, len(devices), CPU_RUNTIME_BYTES / 2**30)
        return
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    of = f" of {limit / 2**30:.1f} GiB" if limit else ""
    logger.info("expected peak memory: %.2f GiB per device%s (weights %.2f GiB + KV cache %.2f GiB; activations on "
                "top); lower it with --gpu-memory-utilization or --kv-cache-memory-bytes", peak / 2**30, of,
                max(weight_bytes_by_device.values()) / 2**30, kv_bytes_per_device / 2**30)
