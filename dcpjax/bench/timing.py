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
