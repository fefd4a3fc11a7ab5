"""Compile every shape the engine can dispatch before it says it is ready (vLLM captures its CUDA
graphs at start-up, tpu-inference precompiles its paddings: a call that compiles while requests
wait stalls every one of them).

The shapes are the points of the runner's `ShapeGrid` (every call is rounded onto it, so none
is missed): the model calls (decode, packed prefill, prompt logprobs, verify), the sampler per
row count, and the logits processors' install. `precompile_engine` compiles them ahead of time
(`jit(...).lower(...).compile()`, which fills the cache that the jitted calls use) on a pool of
threads (XLA compiles outside the GIL), with a progress bar and one log line; with JAX's
persistent compilation cache a second start loads them instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

from tqdm.auto import tqdm

from dcpjax.runner.compile_watch import compile_watch

logger = logging.getLogger(__name__)


def precompile_engine(runner, draft_runner=None, kv_connector=None, workers: int | None = None) -> float:
    """Compile every model call, sampler and install shape of `runner` (and the greedy calls of a
    draft model's runner, and a KV connector's gathers and scatters) not met yet. Returns the
    seconds it took."""
    jobs = [(runner.compile_call, shape) for shape in runner.grid.call_shapes() if shape not in runner.seen]
    jobs += [(runner.compile_sampler, shape) for shape in runner.grid.sampler_shapes() if shape not in runner.seen]
    if draft_runner is not None:  # greedy drafts: no sampler, no prompt logprobs
        jobs += [(draft_runner.compile_call, shape) for shape in
                 draft_runner.grid.call_shapes(prompt_logprobs=False, catch_up=True) if shape not in draft_runner.seen]
    if kv_connector is not None:  # prefill/decode disaggregation: its moves happen while requests wait too
        jobs += kv_connector.compile_jobs()
    if not jobs:
        runner.precompiled = True
        return 0.0
    watch, start = compile_watch(), time.perf_counter()
    loaded_before = watch.loaded
    runner.compile_install()
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    with tqdm(total=len(jobs), desc="Compiling model call shapes", unit="shape") as bar:
        maps = _memory_maps()
        compile_one, shape = jobs[0]
        compile_one(shape)
        bar.update()
        if maps is not None and runner.mesh.devices.flat[0].platform == "cpu":
            _check_memory_maps(len(jobs) - 1, _memory_maps() - maps)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precompile") as pool:
            for job in concurrent.futures.as_completed([pool.submit(fn, shape) for fn, shape in jobs[1:]]):
                job.result()  # a failed compile fails the start, naming its error
                bar.update()
    runner.precompiled = True
    seconds = time.perf_counter() - start
    logger.info("compiled %d step shapes in %.1f s (%d loaded from the compilation cache)", len(jobs), seconds,
                watch.loaded - loaded_before)
    return seconds


def _memory_maps() -> int | None:
    """This process's memory maps (None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> int | None:
    """Linux's per-process memory-map limit (None where there is none to read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _check_memory_maps(remaining: int, per_shape: int) -> None:
    """XLA:CPU maps each kernel of an executable's code on its own (hundreds per step for a small
    model, about a thousand for a 30-layer one): a process that passes Linux's vm.max_map_count
    aborts inside LLVM, so a precompile that would is refused first, with what to change."""
    limit = max_map_count()
    if limit is None:
        return
    needed, free = remaining * per_shape, limit - (_memory_maps() or 0)
    if needed > 0.9 * free:
        raise ValueError(
            f"precompiling {remaining + 1} step shapes needs about {needed + per_shape:,} memory maps ({per_shape} per "
            f"XLA:CPU executable) and this process has {free:,} left under vm.max_map_count={limit:,}: lower "
            "max_num_seqs, max_model_len or max_num_batched_tokens (fewer shapes), or set enforce_eager=True "
            "(--enforce-eager) to compile shapes as they are met")
