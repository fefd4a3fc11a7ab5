"""How many bytes of KV cache each device gets when the user does not say (vLLM's
gpu_memory_utilization on accelerators; on CPU, a share of the host's available memory)."""

from __future__ import annotations

import os

import jax
import numpy as np

CPU_DEFAULT_KV_BYTES = 64 << 20  # where the host's available memory cannot be read
CPU_KV_SHARE = 0.25  # of the host's available memory, for all of this process's devices together


def host_available_bytes() -> int | None:
    """The host memory the kernel could give this process now (Linux' MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def _free_bytes(device: jax.Device, utilization: float, devices_sharing_host: int) -> int:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no device memory; all of the process's devices share the host's
        available = host_available_bytes()
        return CPU_DEFAULT_KV_BYTES if available is None else int(available * CPU_KV_SHARE / devices_sharing_host)
    return int(stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0))


def kv_bytes_per_device(requested: int | None, utilization: float, mesh, most_useful: int | None = None) -> int:
    """KV bytes per device: as requested, or what the fullest of this process's mesh devices has
    free (on CPU: a share of the host's available memory, no more than `most_useful`, what
    max_num_seqs sequences of max_model_len can fill); over several processes, the smallest any
    process has (every process must build the same cache, and a process can read only its own
    devices' memory statistics)."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {requested}")
        return int(requested)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    # CPU processes are assumed to share one host (how multi-process CPU runs here): each takes its part
    free = min(_free_bytes(d, utilization, len(mine) * jax.process_count()) for d in mine)
    if mine[0].platform == "cpu" and most_useful is not None:
        free = min(free, most_useful)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        kib = multihost_utils.process_allgather(np.asarray(max(free, 0) // 1024, np.int32))  # int32 KiB: < 2 TiB
        free = int(np.min(kib)) * 1024
    return free
