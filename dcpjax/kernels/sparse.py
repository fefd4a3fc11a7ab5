"""Sparse attention on one device (DeepSeek's DSA): the lightning indexer's scores over a paged
key cache, each query's local top-k, and attention over only the selected tokens.

The indexer keeps one key per token ([1, num_blocks, block_size, index_dim] pages, addressed by
the same block tables as the KV). A query's score for token s is

    score[s] = sum_h w[h] * relu(q[h] . k[s]) * scale          (float32)

over the indexer's query heads h. The model attends only to the `top_k` best tokens, so a decode
step reads top_k latents per query, not the context. What crosses DCP ranks (the exact global
top-k, the LSE merge) is `dcpjax.sharding.sparse`; here every index is this device's local one.

Ties: among equal scores the lowest local index wins (`jax.lax.top_k`'s rule), which for the
interleaved layout is the lowest position (local order is position order on every rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.common import AttentionOptions, finish_softmax
from dcpjax.kernels.dispatch import attention
from dcpjax.kernels.kv_cache import KVCache, dequantize_fp8, gather_pages

GATHERED_PAGE = 16  # the selected tokens are gathered in pages of 16 (a Triton dot's smallest M)
HEADS_PER_PASS = 8  # indexer heads scored at once: [B, T, 8, S] in float32, not [B, T, 64, S]


def index_scores(q: jax.Array, weights: jax.Array, keys: KVCache, bounds: jax.Array, starts: jax.Array | None,
                 scale: float) -> jax.Array:
    """The indexer's score of every token of each query's pages.

    Args:
      q: [B, T, index_heads, index_dim] indexer queries.
      weights: [B, T, index_heads] each head's weight (the model folds its own factors in).
      keys: the indexer's key pages [1, num_blocks, block_size, index_dim] (fp8 with k_scale or
        float) with block_tables [B, P].
      bounds, starts: [B, T] each query's visible local tokens starts .. bounds - 1 (starts None: 0).
      scale: multiplies q . k inside the ReLU.
    Returns [B, T, P * block_size] float32 scores, -inf outside each query's visible range.
    """
    pages = gather_pages(keys.k, keys.block_tables)[0]  # [B, S, d]
    if keys.quantized:
        pages = dequantize_fp8(pages, gather_pages(keys.k_scale, keys.block_tables)[0])
    pages = pages.astype(jnp.float32)
    heads = q.shape[2]
    step = min(HEADS_PER_PASS, heads)
    pad = -heads % step  # zero-weight heads add nothing
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    wf = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, 0), (0, pad)))
    qf = jnp.moveaxis(qf.reshape(*q.shape[:2], -1, step, q.shape[3]), 2, 0)  # [passes, B, T, step, d]
    wf = jnp.moveaxis(wf.reshape(*q.shape[:2], -1, step), 2, 0)

    def one_pass(total, qw):
        qs, ws = qw
        # float32 products on every platform (not TF32 / bf16 passes): near-ties at the k-th score decide
        dots = jnp.einsum("bthd,bsd->bths", qs, pages, precision=jax.lax.Precision.HIGHEST) * scale
        return total + jnp.einsum("bth,bths->bts", ws, jax.nn.relu(dots), precision=jax.lax.Precision.HIGHEST), None

    total = jnp.zeros((*q.shape[:2], pages.shape[1]), jnp.float32)
    total, _ = jax.lax.scan(one_pass, total, (qf, wf))
    index = jnp.arange(pages.shape[1])
    visible = index < bounds[..., None]
    if starts is not None:
        visible &= index >= starts[..., None]
    # -0.0 (negative weights times ReLU's zeros) made 0.0: top_k orders -0.0 below 0.0, the merge's
    # sort and the oracle treat them as one value, and ties must break the same way everywhere
    return jnp.where(visible, jnp.where(total == 0, 0.0, total), -jnp.inf)


def local_top_k(scores: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """[B, T, S] scores -> (values, local indices) [B, T, min(top_k, S)], best first, ties to the lowest
    index; -inf values are tokens the query does not see (fewer than top_k visible)."""
    return jax.lax.top_k(scores, min(top_k, scores.shape[-1]))


def gather_tokens(pool: jax.Array | None, block_tables: jax.Array, tokens: jax.Array) -> jax.Array | None:
    """pool [H, num_blocks, block_size, ...] -> [H, B, T, K, ...]: each query's tokens [B, T, K] (local
    indices into its row's pages, block_tables [B, P]) read by (block, offset); None stays None."""
    if pool is None:
        return None
    block_size = pool.shape[2]
    blocks = jnp.take_along_axis(block_tables[:, None, :], tokens // block_size, axis=2)  # [B, T, K]
    return pool[:, blocks, tokens % block_size]


def sparse_attention_reference(q: jax.Array, kv: KVCache, indices: jax.Array, selected: jax.Array,
                               sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """Attention of each query over its own selected tokens only.

    Args:
      q: [B, T, q_heads, dk].
      kv: this device's pages [kv_heads, num_blocks, block_size, d] with block_tables [B, P]
        (MLA's latent form: one head, V = K[..., :v_head_dim]; or K and V pools).
      indices: [B, T, K] int, local token indices (into the row's pages in table order).
      selected: [B, T, K] bool, which of them the query attends to (the rest are ignored).
      sm_scale: the softmax scale.
    Returns out [B, T, q_heads, dv] (q.dtype) and lse [B, T, q_heads] float32; a query that selects
    nothing gives 0 and -inf (the LSE merge's identity).
    Reads K tokens per query from the pages, gathered by (block, offset).
    """
    safe = jnp.where(selected, indices, 0)
    take = lambda pool: gather_tokens(pool, kv.block_tables, safe)  # [H, B, T, K, ...]

    k = take(kv.k)
    if kv.quantized:
        k = dequantize_fp8(k, take(kv.k_scale))
    values = k[..., : kv.v_head_dim] if kv.use_mla else take(kv.v)
    if kv.quantized and not kv.use_mla:
        values = dequantize_fp8(values, take(kv.v_scale))
    kv_heads, q_heads = k.shape[0], q.shape[2]
    group = q_heads // kv_heads
    qg = q.reshape(*q.shape[:2], kv_heads, group, q.shape[3])  # q head j reads KV head j // group
    scores = jnp.einsum("bthgd,hbtkd->bthgk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where(selected[:, :, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])
    acc = jnp.einsum("bthgk,hbtkd->bthgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out, lse = finish_softmax(acc, safe_max, jnp.sum(probs, axis=-1), q.dtype)
    return out.reshape(*q.shape[:3], -1), lse.reshape(*q.shape[:3])


def sparse_attention(q: jax.Array, kv: KVCache, indices: jax.Array, selected: jax.Array,
                     options: AttentionOptions) -> tuple[jax.Array, jax.Array]:
    """`sparse_attention_reference`'s contract, on the kernel `options` picks.

    The jnp reference gathers and attends in one pass. For the Pallas kernels (`options.backend`
    "pallas", or "auto" on GPU and TPU) each query's selected tokens are gathered first, selected ones
    first, into pages of their own ([B * T sequences, K tokens]); the dense paged kernel then attends
    each query over its first `count` tokens, so the kernels need no sparse variant.
    """
    platform = options.platform or jax.default_backend()
    if options.backend == "reference" or (options.backend == "auto" and platform == "cpu"):
        return sparse_attention_reference(q, kv, indices, selected, options.scale(q.shape[-1]))
    batch, queries, k = indices.shape
    padded = -(-k // GATHERED_PAGE) * GATHERED_PAGE
    pad = ((0, 0), (0, 0), (0, padded - k))
    indices, selected = jnp.pad(indices, pad), jnp.pad(selected, pad)
    order = jnp.argsort(~selected, axis=-1, stable=True)  # the selected tokens first
    tokens = jnp.where(jnp.take_along_axis(selected, order, -1), jnp.take_along_axis(indices, order, -1), 0)

    def take(pool):  # [H, num_blocks, bs, ...] -> [B * T, K, H, ...]: one sequence per query
        taken = gather_tokens(pool, kv.block_tables, tokens)  # [H, B, T, K, ...]
        if taken is None:
            return None
        return jnp.moveaxis(taken, 0, 3).reshape(batch * queries, padded, *taken.shape[:1], *taken.shape[4:])

    gathered = KVCache.from_sequences(take(kv.k), take(kv.v), v_head_dim=kv.v_head_dim, k_scale=take(kv.k_scale),
                                      v_scale=take(kv.v_scale), page=GATHERED_PAGE)
    counts = jnp.sum(selected, axis=-1).reshape(batch * queries, 1)
    out, lse = attention(q.reshape(batch * queries, 1, *q.shape[2:]), gathered, counts, options)
    return out.reshape(*q.shape[:3], -1), lse.reshape(*q.shape[:3])
