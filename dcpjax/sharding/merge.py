"""Exact merge of partial softmax results by their log-sum-exp (LSE).

A partial result over a subset of tokens is (out_i, lse_i) with out_i already
normalised over that subset. Over the union:
    lse = logsumexp_i(lse_i),   out = sum_i exp(lse_i - lse) * out_i.
An empty subset has lse_i = -inf and contributes nothing, whatever out_i holds
(even NaN). All arithmetic is float32.

`merge_over_dcp` runs inside `shard_map` on the ("tp", "dcp") mesh. Input: the
partials of this device's KV-head group, [batch, q_heads / (TP/DCP), dv]; output:
this device's own q_heads / TP heads, merged over all DCP ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.config import ParallelConfig
from dcpjax.sharding.mesh import DCP_AXIS


def _weights(lses: jax.Array, lse_total: jax.Array) -> jax.Array:
    """exp(lse_i - lse_total), 0 for empty partials (no NaN from -inf - -inf)."""
    nonempty = lses > -jnp.inf
    return jnp.where(nonempty, jnp.exp(jnp.where(nonempty, lses - lse_total, 0.0)), 0.0)


def _total_lse(lses: jax.Array, axis: int) -> jax.Array:
    """logsumexp over `axis`; -inf when every partial is empty."""
    peak = jnp.max(lses, axis=axis, keepdims=True)
    safe_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.where(lses > -jnp.inf, jnp.exp(lses - safe_peak), 0.0), axis=axis, keepdims=True)
    lse = jnp.where(total > 0, safe_peak + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return jnp.squeeze(lse, axis)


def _weighted(outs: jax.Array, weights: jax.Array) -> jax.Array:
    # where(), not a product: an empty partial may hold NaN and 0 * NaN = NaN.
    return jnp.where(weights[..., None] > 0, outs.astype(jnp.float32) * weights[..., None], 0.0)


def merge_partials(outs: jax.Array, lses: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Merge N partials stacked on `axis`.

    Args:
      outs: [..., N (at `axis`), ..., dv] partial outputs.
      lses: outs' shape without dv, float32.
    Returns:
      (out float32 without the N axis, lse float32 without the N axis).
    """
    axis = axis % lses.ndim
    lse = _total_lse(lses, axis)
    weights = _weights(lses, jnp.expand_dims(lse, axis))
    return jnp.sum(_weighted(outs, weights), axis=axis), lse


def merge_ag_rs(out: jax.Array, lse: jax.Array, dcp: int, axis_name: str = DCP_AXIS):
    """all_gather LSE, rescale locally, psum_scatter outputs by head.

    out [B, H, dv], lse [B, H] (H = heads of the group) -> [B, H/dcp, dv], [B, H/dcp]
    where this rank keeps head block `axis_index(axis_name)`.
    """
    heads = lse.shape[1]
    all_lse = jax.lax.all_gather(lse, axis_name)  # [dcp, B, H]
    lse_total = _total_lse(all_lse, 0)
    scaled = _weighted(out, _weights(lse, lse_total))
    merged = jax.lax.psum_scatter(scaled, axis_name, scatter_dimension=1, tiled=True)
    rank = jax.lax.axis_index(axis_name)
    mine = jax.lax.dynamic_slice_in_dim(lse_total, rank * (heads // dcp), heads // dcp, axis=1)
    return merged, mine


def merge_a2a(out: jax.Array, lse: jax.Array, dcp: int, axis_name: str = DCP_AXIS):
    """One all_to_all of (out, lse) by head, then a local merge of dcp partials.

    out [B, H, dv], lse [B, H] -> [B, H/dcp, dv], [B, H/dcp].
    """
    batch, heads, dv = out.shape
    packed = jnp.concatenate([out.astype(jnp.float32), lse[..., None]], axis=-1)  # [B, H, dv+1]
    # Rank j receives head block j from every rank, stacked on a new leading axis.
    received = jax.lax.all_to_all(packed, axis_name, split_axis=1, concat_axis=0, tiled=True)
    received = received.reshape(dcp, batch, heads // dcp, dv + 1)
    return merge_partials(received[..., :dv], received[..., dv], axis=0)


def merge_over_dcp(out: jax.Array, lse: jax.Array, pc: ParallelConfig):
    """Merge this group's partials over DCP ranks by `pc.dcp_comm_backend`.

    out [B, q_heads/(TP/DCP), dv], lse [B, q_heads/(TP/DCP)] ->
    out [B, q_heads/TP, dv] float32, lse [B, q_heads/TP] float32.
    """
    if pc.dcp == 1:
        return out.astype(jnp.float32), lse
    if pc.dcp_comm_backend == "a2a":
        return merge_a2a(out, lse, pc.dcp)
    return merge_ag_rs(out, lse, pc.dcp)
