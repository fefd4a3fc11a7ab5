"""The collectives that merge DCP ranks' partial attention results exactly.

Runs inside `shard_map` on the ("tp", "dcp") mesh. Input: the partials of this
device's KV-head group, [batch, q_heads / (TP/DCP), dv] with their LSE; output:
this device's own q_heads / TP heads, merged over all DCP ranks. The arithmetic
(LSE weights, logsumexp) is `dcpjax.kernels.merge`; this module only moves data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.kernels.merge import merge_partials, merge_weights, total_lse, weighted
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import DCP_AXIS


def merge_ag_rs(out: jax.Array, lse: jax.Array, dcp: int, axis_name: str = DCP_AXIS):
    """all_gather LSE, rescale locally, psum_scatter outputs by head.

    out [B, H, dv], lse [B, H] (H = heads of the group) -> [B, H/dcp, dv], [B, H/dcp]
    where this rank keeps head block `axis_index(axis_name)`.
    """
    heads = lse.shape[1]
    all_lse = jax.lax.all_gather(lse, axis_name)  # [dcp, B, H]
    lse_total = total_lse(all_lse, 0)
    scaled = weighted(out, merge_weights(lse, lse_total))
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
