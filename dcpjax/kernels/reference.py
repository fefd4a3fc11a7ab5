"""Pure-jnp attention over a paged `KVCache`, returning (out, lse): the oracle and the CPU path.

Contract in `dcpjax.kernels.common` (callers validate; this module does not).
Scores and sums in float32. The pages of a sequence are gathered once for all
its T queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.common import AttentionShapes, finish_softmax
from dcpjax.kernels.kv_cache import KVCache, gather_pages


def attention_reference(q: jax.Array, kv: KVCache, lengths: jax.Array, shapes: AttentionShapes,
                        sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """q [batch, T, q_heads, dk], lengths [batch, T] ->
    out [batch, T, q_heads, dv] (q.dtype), lse [batch, T, q_heads] float32."""
    gather = lambda x: gather_pages(x, kv.block_tables)
    k, v = gather(kv.k), None if kv.v is None else gather(kv.v)
    if kv.quantized:  # fp8: dequantise (MLA's V is K's latent, already scaled)
        k = k.astype(jnp.float32) * gather(kv.k_scale)[..., None]
        if v is not None:
            v = v.astype(jnp.float32) * gather(kv.v_scale)[..., None]
    values = k[..., : shapes.dv] if v is None else v  # [B, S, Hkv, dv]
    batch, seq, queries = k.shape[0], k.shape[1], q.shape[1]
    qg = q.reshape(batch, queries, shapes.kv_heads, shapes.group, shapes.dk)
    scores = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
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
