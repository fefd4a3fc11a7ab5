"""Pure-jnp decode attention returning (out, lse): the oracle and the CPU path.

Contract in `dcpjax.kernels.common`. Scores and sums in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.common import check_decode_args, default_sm_scale, finish_softmax, value_view


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[num_blocks, block_size, H, d] pages -> [batch, max_blocks * block_size, H, d] in token order."""
    batch, max_blocks = block_tables.shape
    gathered = pages[block_tables]  # [batch, max_blocks, block_size, H, d]
    return gathered.reshape(batch, max_blocks * pages.shape[1], *pages.shape[2:])


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention of one query token per sequence over its cached KV.

    Returns out [batch, q_heads, dv] (q.dtype) and lse [batch, q_heads] float32.
    """
    shapes = check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    scale = default_sm_scale(shapes.dk, sm_scale)
    if shapes.paged:
        k = gather_pages(k, block_tables)
        v = None if v is None else gather_pages(v, block_tables)
    values = value_view(k, v, shapes.dv)  # [B, S, Hkv, dv]
    batch, seq = k.shape[0], k.shape[1]
    qg = q.reshape(batch, shapes.kv_heads, shapes.group, shapes.dk)
    scores = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(seq)[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])  # exp(-inf) = 0 for masked tokens
    row_sum = jnp.sum(probs, axis=-1)
    acc = jnp.einsum("bhgs,bshd->bhgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out, lse = finish_softmax(acc, safe_max, row_sum, q.dtype)
    return out.reshape(batch, shapes.q_heads, shapes.dv), lse.reshape(batch, shapes.q_heads)
