"""One timing rule for the benchmark scripts: median wall time of a jitted call."""

from __future__ import annotations

import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of `fn()` (blocked until its result is ready) over `iters` calls, after two warm-ups."""
    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def read_bandwidth(threads: int | None = None, mib: int = 512, iters: int = 5) -> float:
    """Bytes/s this host reads: numpy summing a `mib` MiB float32 array split over `threads`
    threads (default: every core; numpy's reductions release the GIL), best of `iters`."""
    import concurrent.futures
    import os

    import numpy as np

    threads = threads or os.cpu_count() or 1
    data = np.ones(mib << 18, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(iters):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


