"""Per-device DCP steps, for code already inside `shard_map` on the ("tp", "dcp") mesh.

The public op (`dcpjax.attention`) and the models share these, so there is one
implementation of writing owned tokens and of attention with the LSE merge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.config import ParallelConfig
from dcpjax.kernels.dispatch import chunk_attention
from dcpjax.sharding import layout
from dcpjax.sharding.merge import merge_over_dcp
from dcpjax.sharding.mesh import DCP_AXIS


def owned_slots(positions, pc: ParallelConfig, *, block_tables=None, block_size: int | None = None, valid=None):
    """Where this DCP rank stores each token, PAD_SLOT where it does not own it.

    positions: [B] or [B, T] token positions. Paged (block_tables [B, P]): a flat
    slot in this rank's pool. Contiguous: the local index in this rank's [B, S_loc] rows.
    valid: optional mask of the same shape; invalid tokens (padding) are never stored.
    """
    rank = jax.lax.axis_index(DCP_AXIS)
    if block_tables is not None:
        slots = layout.paged_slot_mapping(positions, block_tables, rank, block_size, pc.dcp, pc.interleave)
    else:
        owned = layout.owner_rank(positions, pc.dcp, pc.interleave) == rank
        slots = jnp.where(owned, layout.local_index(positions, pc.dcp, pc.interleave), layout.PAD_SLOT)
    return slots if valid is None else jnp.where(valid, slots, layout.PAD_SLOT)


def write_tokens(pool: jax.Array, new: jax.Array, slots: jax.Array, paged: bool) -> jax.Array:
    """Store `new` at `slots`; PAD_SLOT entries are dropped.

    Paged: pool [num_blocks, bs, H, d], new [N, H, d], slots [N] flat slots.
    Contiguous: pool [B, S_loc, H, d], new [B, H, d], slots [B] local indices.
    """
    if paged:
        flat = pool.reshape(-1, *pool.shape[2:])
        slots = jnp.where(slots < 0, flat.shape[0], slots)  # negative indices would wrap
        return flat.at[slots].set(new.astype(pool.dtype), mode="drop").reshape(pool.shape)
    slots = jnp.where(slots < 0, pool.shape[1], slots)
    return pool.at[jnp.arange(pool.shape[0]), slots].set(new.astype(pool.dtype), mode="drop")


FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., d] -> (e4m3 values [..., d], float32 scales [...]): one scale per token and head."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax, 1e-12) / FP8_MAX
    return (x.astype(jnp.float32) / scale[..., None]).astype(FP8), scale


def write_pool(pool: tuple[jax.Array, jax.Array | None], new: jax.Array, slots: jax.Array):
    """Store new tokens [N, H, d] into a paged pool (data, scales); an fp8 pool quantises them."""
    data, scales = pool
    if scales is None:
        return write_tokens(data, new, slots, paged=True), None
    values, token_scales = quantize_fp8(new)
    return write_tokens(data, values, slots, paged=True), write_tokens(scales, token_scales, slots, paged=True)


def dcp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    pc: ParallelConfig,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    attention_backend: str = "auto",
    platform: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of this device's query heads over the DCP-split cache, merged exactly.

    Args:
      q: [B, T, q_heads / TP, dk], this device's heads (T queries per sequence).
      k, v: this rank's cache shard (paged pool with `block_tables` [B, P], or
        contiguous [B, S_local, kv_heads_local, d]).
      lengths: [B, T] global causal bounds: query t sees positions 0..lengths[b, t]-1.
      platform: the mesh's device platform (picks the kernel; default JAX's default backend).
      k_scale, v_scale: per-token scales of an fp8 cache (the pools' shapes without the last dim).
    Returns:
      out [B, T, q_heads / TP, dv] float32 and lse [B, T, q_heads / TP] float32.
    """
    if pc.dcp > 1:  # the q heads of this device's whole KV-head group
        q = jax.lax.all_gather(q, DCP_AXIS, axis=2, tiled=True)
    rank = jax.lax.axis_index(DCP_AXIS)
    local_lengths = layout.local_length(lengths, rank, pc.dcp, pc.interleave)
    out, lse = chunk_attention(
        q, k, v, local_lengths, block_tables=block_tables, sm_scale=sm_scale,
        v_head_dim=v_head_dim, attention_backend=attention_backend, platform=platform, k_scale=k_scale, v_scale=v_scale,
    )
    batch, queries = out.shape[:2]
    out, lse = merge_over_dcp(out.reshape(batch * queries, *out.shape[2:]), lse.reshape(batch * queries, -1), pc)
    return out.reshape(batch, queries, *out.shape[1:]), lse.reshape(batch, queries, -1)
