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


def attention_reference(q: jax.Array, kv: KVCache, bounds: jax.Array, shapes: AttentionShapes,
                        sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """q [batch, T, q_heads, dk], bounds [batch, T] (each query's causal bound) ->
    out [batch, T, q_heads, dv] (q.dtype), lse [batch, T, q_heads] float32."""
    gather = lambda x: gather_pages(x, kv.block_tables)  # [Hkv, B, S, ...]: heads lead, no transpose
    k, v = gather(kv.k), None if kv.v is None else gather(kv.v)
    if kv.quantized:  # fp8: dequantise (MLA's V is K's latent, already scaled)
        k = k.astype(jnp.float32) * gather(kv.k_scale)[..., None]
        if v is not None:
            v = v.astype(jnp.float32) * gather(kv.v_scale)[..., None]
    values = k[..., : shapes.dv] if v is None else v  # [Hkv, B, S, dv]
    batch, queries, seq = q.shape[0], q.shape[1], k.shape[2]
    rows = queries * shapes.group  # each KV head's (query, head) rows, t-major
    qg = jnp.transpose(q.reshape(batch, queries, shapes.kv_heads, shapes.group, shapes.dk), (2, 0, 1, 3, 4))
    qg = qg.reshape(shapes.kv_heads, batch, rows, shapes.dk)
    scores = jnp.einsum("hbrd,hbsd->hbrs", qg, k, preferred_element_type=jnp.float32) * sm_scale
    row_bounds = jnp.repeat(bounds, shapes.group, axis=1)  # [B, rows]
    valid = jnp.arange(seq)[None, None, :] < row_bounds[:, :, None]  # [B, rows, S]
    scores = jnp.where(valid[None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])  # exp(-inf) = 0 for masked tokens
    row_sum = jnp.sum(probs, axis=-1)
    acc = jnp.einsum("hbrs,hbsd->hbrd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out, lse = finish_softmax(acc, safe_max, row_sum, q.dtype)  # [Hkv, B, rows, dv], [Hkv, B, rows]
    out = jnp.transpose(out.reshape(shapes.kv_heads, batch, queries, shapes.group, shapes.dv), (1, 2, 0, 3, 4))
    lse = jnp.transpose(lse.reshape(shapes.kv_heads, batch, queries, shapes.group), (1, 2, 0, 3))
    return out.reshape(batch, queries, shapes.q_heads, shapes.dv), lse.reshape(batch, queries, shapes.q_heads)
