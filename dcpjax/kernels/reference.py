"""Pure-jnp decode attention returning (out, lse): the oracle and the CPU path.

Contract in `dcpjax.kernels.common`. Scores and sums in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.common import check_chunk_args, check_decode_args, default_sm_scale, finish_softmax, value_view


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[num_blocks, block_size, H, d] pages -> [batch, max_blocks * block_size, H, d] in token order."""
    batch, max_blocks = block_tables.shape
    gathered = pages[block_tables]  # [batch, max_blocks, block_size, H, d]
    return gathered.reshape(batch, max_blocks * pages.shape[1], *pages.shape[2:])


def chunk_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Several queries per sequence, each with its own causal bound, over cached KV.

    q [batch, T, q_heads, dk]; lengths [batch, T]: query t sees tokens 0..lengths[b, t]-1.
    k_scale, v_scale: per-token scales (k's shape without the last dim) of an fp8 cache.
    Returns out [batch, T, q_heads, dv] (q.dtype) and lse [batch, T, q_heads] float32.
    The pages of a sequence are gathered once for all its T queries.
    """
    shapes = check_chunk_args(q, k, v, lengths, block_tables, v_head_dim)
    scale = default_sm_scale(shapes.dk, sm_scale)
    gather = (lambda x: gather_pages(x, block_tables)) if shapes.paged else (lambda x: x)
    k, v = gather(k), None if v is None else gather(v)
    if k_scale is not None:  # fp8: dequantise (V of MLA is K's latent, already scaled)
        k = k.astype(jnp.float32) * gather(k_scale)[..., None]
        if v is not None:
            v = v.astype(jnp.float32) * gather(v_scale)[..., None]
    values = value_view(k, v, shapes.dv)  # [B, S, Hkv, dv]
    batch, seq, queries = k.shape[0], k.shape[1], q.shape[1]
    qg = q.reshape(batch, queries, shapes.kv_heads, shapes.group, shapes.dk)
    scores = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(seq)[None, None, :] < lengths[:, :, None]  # [B, T, S]
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])  # exp(-inf) = 0 for masked tokens
    row_sum = jnp.sum(probs, axis=-1)
    acc = jnp.einsum("bhgts,bshd->bhgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out, lse = finish_softmax(acc, safe_max, row_sum, q.dtype)  # [B, Hkv, G, T, dv], [B, Hkv, G, T]
    out = jnp.moveaxis(out, 3, 1).reshape(batch, queries, shapes.q_heads, shapes.dv)
    return out, jnp.moveaxis(lse, 3, 1).reshape(batch, queries, shapes.q_heads)


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention of one query token per sequence over its cached KV.

    Returns out [batch, q_heads, dv] (q.dtype) and lse [batch, q_heads] float32.
    """
    check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    out, lse = chunk_attention_reference(
        q[:, None], k, v, lengths[:, None], block_tables=block_tables, sm_scale=sm_scale, v_head_dim=v_head_dim,
        k_scale=k_scale, v_scale=v_scale,
    )
    return out[:, 0], lse[:, 0]
