"""Pure-jnp attention over a paged `KVCache`, returning (out, lse): the oracle and the CPU path.

Contract in `dcpjax.kernels.common` (callers validate; this module does not).
Scores and sums in float32. The pages of a sequence are gathered once for all
its T queries, which attend as (query, head) rows (`common.to_rows`) like the kernels' tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.common import AttentionShapes, finish_softmax, from_rows, row_bounds, soft_cap, to_rows
from dcpjax.kernels.kv_cache import KVCache, dequantize_fp8, gather_pages


def attention_reference(q: jax.Array, kv: KVCache, bounds: jax.Array, shapes: AttentionShapes,
                        sm_scale: float, starts: jax.Array | None = None,
                        softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """q [batch, T, q_heads, dk], bounds [batch, T] (each query's causal bound), starts [batch, T]
    or None (each query's first visible token, default 0) ->
    out [batch, T, q_heads, dv] (q.dtype), lse [batch, T, q_heads] float32."""
    gather = lambda x: gather_pages(x, kv.block_tables)  # [Hkv, B, S, ...]: heads lead, no transpose
    k, v = gather(kv.k), None if kv.v is None else gather(kv.v)
    if kv.quantized:  # fp8: dequantise (MLA's V is K's latent, already scaled)
        k = dequantize_fp8(k, gather(kv.k_scale))
        if v is not None:
            v = dequantize_fp8(v, gather(kv.v_scale))
    values = k[..., : shapes.dv] if v is None else v  # [Hkv, B, S, dv]
    seq = k.shape[2]
    # heads lead, like the gathered pages: the small q and outputs move, never the KV
    qg = jnp.swapaxes(to_rows(q, shapes), 0, 1)  # [Hkv, B, rows, dk], rows = T * G
    scores = soft_cap(jnp.einsum("hbrd,hbsd->hbrs", qg, k, preferred_element_type=jnp.float32) * sm_scale, softcap)
    index = jnp.arange(seq)[None, None, :]
    valid = index < row_bounds(bounds, shapes)[:, :, None]  # [B, rows, S]
    if starts is not None:
        valid &= index >= row_bounds(starts, shapes)[:, :, None]
    scores = jnp.where(valid[None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])  # exp(-inf) = 0 for masked tokens
    row_sum = jnp.sum(probs, axis=-1)
    acc = jnp.einsum("hbrs,hbsd->hbrd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out, lse = finish_softmax(acc, safe_max, row_sum, q.dtype)  # [Hkv, B, rows, dv], [Hkv, B, rows]
    return from_rows(jnp.swapaxes(out, 0, 1), shapes), from_rows(jnp.swapaxes(lse, 0, 1), shapes)
