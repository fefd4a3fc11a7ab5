"""Pallas decode attention with the common contract, for GPU and TPU.

The wrapper turns every input into the paged form both kernels share
(contiguous KV is a free reshape into pages with an identity block table),
groups query heads by KV head and pads the group to the target's tile, calls
the kernel for the target, and undoes the padding:
  target "gpu": `pallas_gpu` (Triton lowering; split-K, splits merged by LSE);
  target "tpu": `pallas_tpu` (Mosaic lowering; pages pipelined HBM -> VMEM).
On CPU either runs with `interpret=True`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import check_chunk_args, check_decode_args, default_sm_scale
from dcpjax.kernels.pallas_gpu import paged_decode_gpu
from dcpjax.kernels.pallas_tpu import SUBLANES, paged_decode_tpu, tpu_tiling_problem

TARGETS = ("gpu", "tpu")
MIN_GPU_ROWS = 16  # Triton's tensor-core dot needs M >= 16
MAX_CONTIGUOUS_PAGE = 128


def contiguous_page_size(seq: int, limit: int = MAX_CONTIGUOUS_PAGE) -> int:
    """Largest power of two <= limit that divides seq (so paging contiguous KV is a reshape)."""
    page = 1
    while page * 2 <= limit and seq % (page * 2) == 0:
        page *= 2
    return page


def as_pages(x: jax.Array, page: int) -> jax.Array:
    """Contiguous [batch, seq, ...] -> [batch * seq / page, page, ...] (a free reshape)."""
    return x.reshape(x.shape[0] * (x.shape[1] // page), page, *x.shape[2:])


def identity_tables(batch: int, pages_per_seq: int) -> jax.Array:
    return jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)


def _as_paged(k, v, k_scale, v_scale, batch: int):
    """Contiguous KV (and fp8 scales) as pages of one sequence each, with an identity table."""
    page = contiguous_page_size(k.shape[1])
    k, v, k_scale, v_scale = (None if x is None else as_pages(x, page) for x in (k, v, k_scale, v_scale))
    return k, v, k_scale, v_scale, identity_tables(batch, k.shape[0] // batch)


def default_target(platform: str | None = None) -> str:
    return "tpu" if (platform or jax.default_backend()) == "tpu" else "gpu"


def padded_rows(group: int, target: str) -> int:
    if target == "tpu":
        return -(-group // SUBLANES) * SUBLANES
    return max(MIN_GPU_ROWS, pl.next_power_of_2(group))


def decode_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    num_kv_splits: int | None = None,
    interpret: bool | None = None,
    target: str | None = None,
    platform: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas decode attention; contract in `dcpjax.kernels.common`.

    Args (beyond the contract):
      num_kv_splits: GPU split-K factor (default: enough programs to fill the GPU).
      interpret: run the kernel in the Pallas interpreter (default: on CPU).
      target: "gpu" or "tpu" kernel (default: the platform's; "gpu" on CPU).
      platform: where it runs (default `jax.default_backend()`).
      k_scale, v_scale: per-token scales of an fp8 cache (k's shape without the last dim).
    Returns out [batch, q_heads, dv] (q.dtype) and lse [batch, q_heads] float32.
    """
    shapes = check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    platform = platform or jax.default_backend()
    target = target or default_target(platform)
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    interpret = platform == "cpu" if interpret is None else bool(interpret)
    if not shapes.paged:
        k, v, k_scale, v_scale, block_tables = _as_paged(k, v, k_scale, v_scale, shapes.batch)
    if target == "tpu" and not interpret:  # the interpreter has no tiling rules
        problem = tpu_tiling_problem(shapes.kv_heads, shapes.dk, shapes.dv, k.shape[1], v is None, k_scale is not None)
        if problem:
            raise ValueError(f"the TPU Pallas kernel cannot tile these shapes: {problem}; "
                             "use attention_backend='reference' (or 'auto', which does)")

    batch, kv_heads, group, dk, dv = shapes.batch, shapes.kv_heads, shapes.group, shapes.dk, shapes.dv
    rows = padded_rows(group, target)
    qg = q.reshape(batch, kv_heads, group, dk)
    if rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    args = (qg, k, v, lengths.astype(jnp.int32), block_tables.astype(jnp.int32))
    scale = default_sm_scale(dk, sm_scale)
    if target == "tpu":
        out, lse = paged_decode_tpu(*args, k_scale, v_scale, sm_scale=scale, dv=dv, interpret=interpret)
    else:
        out, lse = paged_decode_gpu(*args, k_scale, v_scale, sm_scale=scale, dv=dv, num_splits=num_kv_splits,
                                    interpret=interpret)
    out = out[:, :, :group].reshape(batch, shapes.q_heads, dv).astype(q.dtype)
    return out, lse[:, :, :group].reshape(batch, shapes.q_heads)


def chunk_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    interpret: bool | None = None,
    target: str | None = None,
    platform: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunk form (q [batch, T, q_heads, dk], lengths [batch, T]) on the decode kernel.

    Each of the batch * T queries becomes a sequence of its own that shares its
    sequence's block table, so every query gets its own causal bound.
    """
    shapes = check_chunk_args(q, k, v, lengths, block_tables, v_head_dim)
    batch, queries = q.shape[:2]
    if not shapes.paged:
        k, v, k_scale, v_scale, block_tables = _as_paged(k, v, k_scale, v_scale, batch)
    out, lse = decode_attention_pallas(
        q.reshape(batch * queries, *q.shape[2:]), k, v, lengths.reshape(-1),
        block_tables=jnp.repeat(block_tables, queries, axis=0), sm_scale=sm_scale, v_head_dim=v_head_dim,
        interpret=interpret, target=target, platform=platform, k_scale=k_scale, v_scale=v_scale,
    )
    return out.reshape(batch, queries, *out.shape[1:]), lse.reshape(batch, queries, -1)
