"""Per-device DCP steps, for code already inside `shard_map` on the ("tp", "dcp") mesh.

The public op (`dcpjax.sharding.attention`) and the models share these, so there is one
rule for where a rank stores a token and one attention-with-LSE-merge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels import AttentionOptions, KVCache, attention
from dcpjax.sharding import layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.merge import merge_over_dcp
from dcpjax.sharding.mesh import DCP_AXIS


def owned_slots(positions: jax.Array, block_tables: jax.Array, block_size: int, pc: ParallelConfig,
                valid: jax.Array | None = None, page_offsets: jax.Array | None = None) -> jax.Array:
    """Flat slot in this DCP rank's pool of each token, `PAD_SLOT` where the rank does not own it.

    positions: [B] or [B, T] token positions; block_tables [B, P] (shared by all ranks);
    valid: optional mask like positions; invalid tokens (padding) are never stored;
    page_offsets: optional, like positions: where each token's sequence's blocks begin in its
    row's table (packed rows), None: 0.
    Returns int32 slots shaped like positions, for `KVCache.write`.
    """
    rank = jax.lax.axis_index(DCP_AXIS)
    slots = layout.paged_slot_mapping(positions, block_tables, rank, block_size, pc.dcp, pc.interleave, page_offsets)
    return slots if valid is None else jnp.where(valid, slots, layout.PAD_SLOT)


def window_starts(bounds: jax.Array, window: int | None) -> jax.Array | None:
    """[B, T] causal bounds -> each query's first visible position under a sliding window of
    `window` tokens (the query at p sees p - window + 1 .. p, as transformers' `i - W < j <= i`);
    None without a window (it sees from position 0)."""
    return None if window is None else jnp.maximum(bounds - window, 0)


def group_queries(q: jax.Array, pc: ParallelConfig) -> jax.Array:
    """q [B, T, q_heads / TP, dk], this device's heads -> the q heads of its whole KV-head group
    [B, T, q_heads / (TP / DCP), dk]: what each DCP rank attends with over its own positions."""
    return jax.lax.all_gather(q, DCP_AXIS, axis=2, tiled=True) if pc.dcp > 1 else q


def merge_queries(out: jax.Array, lse: jax.Array, pc: ParallelConfig) -> tuple[jax.Array, jax.Array]:
    """This rank's partials of its group's heads, out [B, T, group heads, dv] and lse [B, T, group heads],
    merged over "dcp" into this device's own heads (float32)."""
    batch, queries = out.shape[:2]
    out, lse = merge_over_dcp(out.reshape(batch * queries, *out.shape[2:]), lse.reshape(batch * queries, -1), pc)
    return out.reshape(batch, queries, *out.shape[1:]), lse.reshape(batch, queries, -1)


def local_ranges(bounds: jax.Array, block_size: int, pc: ParallelConfig, page_offsets: jax.Array | None = None,
                 window: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """[B, T] global causal bounds -> each query's visible local tokens on this DCP rank, (ends, starts)
    [B, T] in its row's pages (starts None: from 0); packed rows (`page_offsets`) start at their
    sequence's blocks, a window at the first position it reaches."""
    rank = jax.lax.axis_index(DCP_AXIS)
    local = layout.local_length(bounds, rank, pc.dcp, pc.interleave)
    lowest = window_starts(bounds, window)
    starts = None if lowest is None else layout.local_length(lowest, rank, pc.dcp, pc.interleave)
    if page_offsets is not None:
        offset = page_offsets * block_size
        local, starts = offset + local, offset + (0 if starts is None else starts)
    return local, starts


def dcp_attention(q: jax.Array, kv: KVCache, bounds: jax.Array, pc: ParallelConfig,
                  options: AttentionOptions, page_offsets: jax.Array | None = None,
                  window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of this device's query heads over the DCP-split cache, merged exactly.

    Args:
      q: [B, T, q_heads / TP, dk], this device's heads (T queries per sequence).
      kv: this rank's cache shard with block_tables [B, P].
      bounds: [B, T] global causal bounds: query t sees positions 0..bounds[b, t]-1 of its sequence.
      options: scale, backend and the mesh's platform (picks the kernel).
      page_offsets: optional [B, T], packed rows: where each query's sequence's blocks begin in
        its row's table (its tokens on this rank are then [offset * block_size, + local length)).
      window: a sliding window of this many positions (None: all of 0..bound-1). Each rank attends
        to the positions it owns inside the window, so a rank that owns none of them gives the
        merge's identity (out 0, lse -inf) and the merge stays exact; the kernels skip the pages
        before a query's first visible token, so the blocks behind the window are never read.
    Returns:
      out [B, T, q_heads / TP, dv] float32 and lse [B, T, q_heads / TP] float32.
    """
    ends, starts = local_ranges(bounds, kv.block_size, pc, page_offsets, window)
    out, lse = attention(group_queries(q, pc), kv, ends, options, starts)
    return merge_queries(out, lse, pc)
