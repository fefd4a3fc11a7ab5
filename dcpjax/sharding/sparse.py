"""Sparse attention under DCP (DeepSeek's DSA): an exact global top-k, then the LSE merge.

Inside `shard_map` on the ("tp", "dcp") mesh. Each DCP rank holds the indexer keys of the positions
it owns (the KV layout), so per query and layer:
  1. every rank scores its own visible positions and keeps its local top-k (`kernels.sparse`);
  2. one all_gather over "dcp" of each rank's k candidates, (score, position) packed in one int32
     array, and a sort by (score descending, position ascending) on every rank give the exact
     global top-k: an element of the global top-k has fewer than k elements above it anywhere, so
     it is in its own rank's local top-k. Ties go to the lowest position (`jax.lax.top_k`'s rule,
     the float64 oracle's; torch's CPU topk follows no fixed rule: docs/models.md, sparse attention);
  3. each rank attends over the selected positions it owns (k latents read per query, not the
     context) and `merge_over_dcp` combines the ranks as for dense attention: a rank that owns
     none of them gives the merge's identity (out 0, lse -inf).
A row that sees at most k positions selects all of them, so it is exactly dense. When no row of
the call can see more than k positions (the tables are narrow), the indexer is skipped and the
dense kernels run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dcpjax.kernels import AttentionOptions, KVCache
from dcpjax.kernels.sparse import index_scores, local_top_k, sparse_attention
from dcpjax.sharding import layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.local_ops import dcp_attention, group_queries, local_ranges, merge_queries
from dcpjax.sharding.mesh import DCP_AXIS


def merge_top_k(values: jax.Array, positions: jax.Array, top_k: int, pc: ParallelConfig
                ) -> tuple[jax.Array, jax.Array]:
    """The exact global top-k from every rank's local candidates.

    Args:
      values: [B, T, K] float32, this rank's local top-k scores (-inf: not a candidate).
      positions: [B, T, K] int32, their positions in the sequence.
    Returns:
      selected: [B, T, K] bool, which of this rank's candidates are in the global top-k;
      top: [B, T, min(top_k, DCP * K)] int32, the global top-k's positions best first (-1 past the
        candidates that exist), the same on every rank.
    """
    if pc.dcp == 1:
        order = jnp.where(values > -jnp.inf, positions, -1)
        return values > -jnp.inf, order[..., :top_k]
    # one collective: a float32 score and its int32 position travel as two int32 words
    packed = jnp.stack([jax.lax.bitcast_convert_type(values, jnp.int32), positions], axis=-1)
    gathered = jax.lax.all_gather(packed, DCP_AXIS, axis=2, tiled=True)  # [B, T, DCP * K, 2]
    all_values = jax.lax.bitcast_convert_type(gathered[..., 0], jnp.float32)
    neg, pos = jax.lax.sort((-all_values, gathered[..., 1]), dimension=-1, num_keys=2)
    n = min(top_k, neg.shape[-1])
    kth_value, kth_position = -neg[..., n - 1 : n], pos[..., n - 1 : n]
    selected = (values > kth_value) | ((values == kth_value) & (positions <= kth_position))
    top = jnp.where(neg[..., :n] < jnp.inf, pos[..., :n], -1)
    return selected & (values > -jnp.inf), top


@functools.partial(jax.tree_util.register_dataclass, data_fields=["indices", "selected", "top"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Selection:
    """Which positions each query attends to, as this DCP rank holds them (`dcp_top_k`).

    indices: [B, T, K] int32, local token indices into the row's pages (this rank's candidates);
    selected: [B, T, K] bool, those in the global top-k; top: [B, T, top_k] int32, the global top-k's
    positions best first (-1 where fewer exist), the same on every rank. A layer that shares the
    previous layer's selection (GLM-5's "shared" indexer layers) attends with it as it is.
    """

    indices: jax.Array
    selected: jax.Array
    top: jax.Array


def is_dense(kv: KVCache, pc: ParallelConfig, top_k: int) -> bool:
    """No row of the call can see more than top_k positions (its tables are narrow): every row selects
    all it sees, so dense attention is the same and cheaper."""
    return kv.block_tables.shape[1] * kv.block_size * pc.dcp <= top_k


def dcp_top_k(index_q: jax.Array, index_weights: jax.Array, index_keys: KVCache, bounds: jax.Array,
              pc: ParallelConfig, top_k: int, index_scale: float, page_offsets: jax.Array | None = None) -> Selection:
    """The exact global top-k of the indexer's scores, as this rank holds it.

    Args:
      index_q: [B, T, index_heads, index_dim], the indexer's queries (all its heads, replicated).
      index_weights: [B, T, index_heads] float32, each indexer head's weight.
      index_keys: this rank's indexer key pages [1, num_blocks, block_size, index_dim], the KV's tables.
      bounds: [B, T] global causal bounds; page_offsets: packed rows (`local_ops.dcp_attention`).
      top_k: positions each query attends to; index_scale: the indexer's q . k scale.
    """
    ends, starts = local_ranges(bounds, index_keys.block_size, pc, page_offsets)
    scores = index_scores(index_q, index_weights, index_keys, ends, starts, index_scale)
    values, indices = local_top_k(scores, top_k)
    first = jnp.zeros_like(ends) if starts is None else starts  # a packed row's sequence starts there
    positions = layout.global_position(indices - first[..., None], jax.lax.axis_index(DCP_AXIS), pc.dcp,
                                       pc.interleave)
    selected, top = merge_top_k(values, positions.astype(jnp.int32), top_k, pc)
    return Selection(indices, selected, top)


def dcp_attend_selected(q: jax.Array, kv: KVCache, selection: Selection, pc: ParallelConfig,
                        options: AttentionOptions) -> tuple[jax.Array, jax.Array]:
    """Attention of this device's query heads over the selected positions, merged exactly.

    q: [B, T, q_heads / TP, dk]; kv: this rank's KV pages with block_tables [B, P] (MLA: the latent).
    Returns out [B, T, q_heads / TP, dv] float32 and lse [B, T, q_heads / TP] float32.
    """
    out, lse = sparse_attention(group_queries(q, pc), kv, selection.indices, selection.selected, options)
    return merge_queries(out, lse, pc)


def dcp_sparse_attention(q: jax.Array, kv: KVCache, index_q: jax.Array, index_weights: jax.Array,
                         index_keys: KVCache, bounds: jax.Array, pc: ParallelConfig, options: AttentionOptions,
                         top_k: int, index_scale: float, page_offsets: jax.Array | None = None,
                         ) -> tuple[jax.Array, jax.Array, Selection | None]:
    """`dcp_top_k`, then `dcp_attend_selected`; dense attention (`local_ops.dcp_attention`) when no row
    can see more than top_k positions (`is_dense`), with no selection (None).

    Returns out [B, T, q_heads / TP, dv] float32, lse [B, T, q_heads / TP] float32 and the `Selection`.
    """
    if is_dense(kv, pc, top_k):
        out, lse = dcp_attention(q, kv, bounds, pc, options, page_offsets)
        return out, lse, None
    selection = dcp_top_k(index_q, index_weights, index_keys, bounds, pc, top_k, index_scale, page_offsets)
    out, lse = dcp_attend_selected(q, kv, selection, pc, options)
    return out, lse, selection
