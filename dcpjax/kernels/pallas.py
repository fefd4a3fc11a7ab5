"""Pallas attention over a paged `KVCache` with the common contract, for GPU and TPU.

The wrapper lays the T queries x G heads of each KV head's group out as the rows
of one tile (`common.to_rows`, each row with its own causal bound), pads the rows
to the target's tile, calls the kernel for the target, and undoes the layout:
  target "gpu": `pallas_gpu` (Triton lowering; split-K, splits merged by LSE);
  target "tpu": `pallas_tpu` (Mosaic lowering; pages pipelined HBM -> VMEM).
A chunk of T queries therefore reads each page once per tile of rows, not T times.
On CPU either runs with `interpret=True`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import (
    AttentionOptions,
    AttentionShapes,
    check_attention_args,
    from_rows,
    row_bounds,
    to_rows,
)
from dcpjax.kernels.kv_cache import KVCache
from dcpjax.kernels.pallas_gpu import paged_attention_gpu
from dcpjax.kernels.pallas_tpu import SUBLANES, paged_attention_tpu, tpu_tiling_problem

TARGETS = ("gpu", "tpu")
MIN_GPU_ROWS = 16  # Triton's tensor-core dot needs M >= 16


def default_target(platform: str | None = None) -> str:
    """The kernel for a platform: "tpu" on TPU, else "gpu" (also what CPU interprets)."""
    return "tpu" if (platform or jax.default_backend()) == "tpu" else "gpu"


def padded_rows(rows: int, target: str) -> int:
    """The T * G rows rounded up to what the target's tile takes."""
    if target == "tpu":
        return -(-rows // SUBLANES) * SUBLANES
    return max(MIN_GPU_ROWS, pl.next_power_of_2(rows))


def query_rows(q: jax.Array, bounds: jax.Array, starts: jax.Array | None, shapes: AttentionShapes,
               rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, Hq, dk] -> qg [B, Hkv, rows, dk] (`common.to_rows`, padded to `rows`);
    bounds and starts [B, T] -> [B, rows] int32, each row its query's (padding rows see nothing;
    starts None: zeros)."""
    pad = rows - shapes.queries * shapes.group
    as_rows = lambda x: jnp.pad(row_bounds(x.astype(jnp.int32), shapes), ((0, 0), (0, pad)))
    qg = jnp.pad(to_rows(q, shapes), ((0, 0), (0, 0), (0, pad), (0, 0)))
    return qg, as_rows(bounds), as_rows(jnp.zeros_like(bounds) if starts is None else starts)


def run_pallas(q: jax.Array, kv: KVCache, bounds: jax.Array, shapes: AttentionShapes, sm_scale: float, *,
               target: str, interpret: bool, num_kv_splits: int | None = None,
               block_rows: int | None = None, starts: jax.Array | None = None,
               softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The kernel for `target` on arguments already validated (`check_attention_args`)."""
    if target == "tpu" and not interpret:  # the interpreter has no tiling rules
        problem = tpu_tiling_problem(shapes.kv_heads, shapes.dk, shapes.dv, shapes.block_size, kv.use_mla,
                                     kv.quantized)
        if problem:
            raise ValueError(f"the TPU Pallas kernel cannot tile these shapes: {problem}; "
                             "use attention_backend='reference' (or 'auto', which does)")
    qg, bounds, starts = query_rows(q, bounds, starts, shapes, padded_rows(shapes.queries * shapes.group, target))
    args = (qg, bounds, starts, kv.k, kv.v, kv.block_tables.astype(jnp.int32), kv.k_scale, kv.v_scale)
    if target == "tpu":
        out, lse = paged_attention_tpu(*args, sm_scale=sm_scale, dv=shapes.dv, interpret=interpret,
                                       block_rows=block_rows, softcap=softcap)
    else:
        out, lse = paged_attention_gpu(*args, sm_scale=sm_scale, dv=shapes.dv, num_splits=num_kv_splits,
                                       interpret=interpret, block_rows=block_rows, softcap=softcap)
    return from_rows(out, shapes).astype(q.dtype), from_rows(lse, shapes)


def attention_pallas(
    q: jax.Array,
    kv: KVCache,
    bounds: jax.Array,
    *,
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,
    interpret: bool | None = None,
    target: str | None = None,
    platform: str | None = None,
    block_rows: int | None = None,
    starts: jax.Array | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel directly (tests, benchmarks); contract in `dcpjax.kernels.common`.

    Args (beyond the contract):
      num_kv_splits: GPU split-K factor (default: enough programs to fill the GPU).
      interpret: run the kernel in the Pallas interpreter (default: on CPU).
      target: "gpu" or "tpu" kernel (default: the platform's; "gpu" on CPU).
      platform: where it runs (default `jax.default_backend()`).
      block_rows: (query, head) rows per program (default: what fits the target's memory).
    Returns out [batch, T, q_heads, dv] (q.dtype) and lse [batch, T, q_heads] float32.
    """
    shapes = check_attention_args(q, kv, bounds, starts)
    platform = platform or jax.default_backend()
    target = target or default_target(platform)
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    interpret = platform == "cpu" if interpret is None else bool(interpret)
    scale = AttentionOptions(sm_scale).scale(shapes.dk)
    return run_pallas(q, kv, bounds, shapes, scale, target=target, interpret=interpret, num_kv_splits=num_kv_splits,
                      block_rows=block_rows, starts=starts, softcap=softcap)
