"""The ("tp", "dcp") device mesh and the one table from logical axes to mesh axes.

DCP is the minor factor of a TP rank (`tp_rank = g * DCP + d`), so the DCP
ranks of one KV-head group are contiguous TP ranks, as in vLLM. Every
PartitionSpec in dcpjax is built from `ShardingRules` (`RULES`): a new layout is
a change of one line here, not a hunt through every layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from dcpjax.kernels.kv_cache import KVCache, KVPools
from dcpjax.kernels.linear_state import LinearState
from dcpjax.sharding.config import ParallelConfig, TooFewDevicesError

TP_AXIS = "tp"
DCP_AXIS = "dcp"
MESH_AXES = (TP_AXIS, DCP_AXIS)
MODEL_AXES = (TP_AXIS, DCP_AXIS)  # all TP devices of a replica: reductions of row-parallel layers

MeshAxes = tuple[str, ...] | None  # the mesh axes that split a dimension; None: replicated


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The one table from logical axes (the names parameters and caches give their dimensions)
    to mesh axes. Every PartitionSpec in dcpjax comes from here, so a new layout is a change of
    one field, not a hunt through every layer. Frozen and hashable: a jit static argument.

    Why each field:
      batch, embed, head_dim: replicated; activations are small at decode.
      q_heads: every TP device owns q_heads / TP heads, exactly as without DCP, so Q
        projections and the O projection share work over all TP devices.
      kv_heads: DCP re-uses TP ranks, so only the TP // DCP groups split KV heads.
      kv_tokens: the interleaved token positions of the KV cache, over DCP ranks.
      kv_pages: the paged pools' block axis: each DCP rank has its own pool of blocks.
      ffw / moe_ffw / vocab: linear layers split over all TP devices together; a routed
        expert is split like a dense MLP (tensor-parallel experts, exact for any routing).
      experts: every device holds a slice of every expert (tensor-parallel experts, the default).
      ep_experts: with expert parallelism (`ParallelConfig.enable_expert_parallel`), the routed
        experts split whole over all TP devices (EP size = TP), their FFW unsplit: the token
        activations are replicated after attention here, so each device runs its own experts on
        the tokens routed to them and the one reduction that TP experts need combines them
        (vLLM does the same when there is no data-parallel attention: no all_to_all).
      linear_heads: a linear-attention layer's key and value heads (and their per-slot state),
        split over all TP devices like query heads: each device runs the recurrence of its heads.
    """

    batch: MeshAxes = None
    embed: MeshAxes = None
    head_dim: MeshAxes = None
    q_heads: MeshAxes = (TP_AXIS, DCP_AXIS)
    kv_heads: MeshAxes = (TP_AXIS,)
    kv_tokens: MeshAxes = (DCP_AXIS,)
    kv_pages: MeshAxes = (DCP_AXIS,)
    ffw: MeshAxes = (TP_AXIS, DCP_AXIS)
    moe_ffw: MeshAxes = (TP_AXIS, DCP_AXIS)
    experts: MeshAxes = None
    ep_experts: MeshAxes = (TP_AXIS, DCP_AXIS)
    vocab: MeshAxes = (TP_AXIS, DCP_AXIS)
    linear_heads: MeshAxes = (TP_AXIS, DCP_AXIS)

    def as_dict(self) -> dict[str, MeshAxes]:
        """The table as {logical axis: mesh axes}."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def mesh_axes(self, logical_axis: str) -> MeshAxes:
        """The mesh axes of one logical axis; KeyError (naming the known ones) if there is none."""
        table = self.as_dict()
        if logical_axis not in table:
            raise KeyError(f"unknown logical axis {logical_axis!r}; known: {sorted(table)}")
        return table[logical_axis]

    def spec(self, *logical_axes: str | None) -> PartitionSpec:
        """PartitionSpec for an array whose dimensions carry these logical names.

        `None` (or a name mapped to None) leaves a dimension replicated, e.g.
        `spec("batch", "q_heads", None)` -> `P(None, ("tp", "dcp"), None)`.
        """
        axes = []
        for name in logical_axes:
            mesh_axes = None if name is None else self.mesh_axes(name)
            # one mesh axis is written bare, as shard_map writes it back (equal specs, one compile)
            axes.append(mesh_axes[0] if mesh_axes is not None and len(mesh_axes) == 1 else mesh_axes)
        return PartitionSpec(*axes)

    def ways(self, logical_axis: str | None, pc: ParallelConfig) -> int:
        """How many shards this table cuts a dimension with this logical name into under `pc`."""
        sizes = {TP_AXIS: pc.kv_head_groups, DCP_AXIS: pc.dcp}
        return math.prod(sizes[a] for a in self.mesh_axes(logical_axis) or ()) if logical_axis else 1

    @property
    def kv_pool_spec(self) -> PartitionSpec:
        """A global K/V pool [kv_slots, DCP * num_blocks, block_size, d]."""
        return self.spec("kv_heads", "kv_pages", None, None)

    @property
    def kv_scale_spec(self) -> PartitionSpec:
        """A global fp8 scale pool [kv_slots, DCP * num_blocks, block_size]."""
        return self.spec("kv_heads", "kv_pages", None)

    def kv_cache_spec(self, cache: KVCache) -> KVCache:
        """The PartitionSpecs of a global `KVCache` (same pytree structure, specs as leaves).

        KV heads are split over "tp"; each DCP rank has its own pool of blocks (the block axis
        is split over "dcp"); block tables are replicated (one table serves every rank).
        """
        some = lambda x, spec: None if x is None else spec
        pool, scale = self.kv_pool_spec, self.kv_scale_spec
        return KVCache(
            k=pool, v=some(cache.v, pool), k_scale=some(cache.k_scale, scale),
            v_scale=some(cache.v_scale, scale), index_k=some(cache.index_k, pool),
            index_k_scale=some(cache.index_k_scale, scale), block_tables=some(cache.block_tables, PartitionSpec()),
            v_head_dim=cache.v_head_dim, num_kv_heads=cache.num_kv_heads, capacity=cache.capacity,
        )

    def kv_pools_spec(self, pools: KVPools) -> KVPools:
        """The PartitionSpecs of the engine's `KVPools` (as `kv_cache_spec`, without tables): the
        indexer keys of a sparse layer are split like its latent."""
        some = lambda x, spec: None if x is None else spec
        pool, scale = self.kv_pool_spec, self.kv_scale_spec
        return KVPools(k=pool, v=some(pools.v, pool), k_scale=some(pools.k_scale, scale),
                       v_scale=some(pools.v_scale, scale), index_k=some(pools.index_k, pool),
                       index_k_scale=some(pools.index_k_scale, scale), v_head_dim=pools.v_head_dim)

    @property
    def linear_state_spec(self) -> PartitionSpec:
        """Each array of a `LinearState`: [slots, heads, d, d'], heads split like query heads."""
        return self.spec(None, "linear_heads", None, None)

    def layer_cache_spec(self, cache: KVPools | LinearState) -> KVPools | LinearState:
        """The PartitionSpecs of one layer's cache in the engine, whichever kind it is."""
        if isinstance(cache, LinearState):
            return LinearState(*(self.linear_state_spec,) * 4)
        return self.kv_pools_spec(cache)


RULES = ShardingRules()  # the layout dcpjax runs with


def logical_spec(*logical_axes: str | None) -> PartitionSpec:
    """`RULES.spec`: the PartitionSpec of dimensions with these logical names."""
    return RULES.spec(*logical_axes)


def reduce_model(x: jax.Array) -> jax.Array:
    """psum of a row-parallel product over all TP devices (inside shard_map). At TP 1 it is x
    itself: XLA keeps a one-device all-reduce as a collective in the step (a thunk each on CPU)."""
    return x if jax.lax.axis_size(MODEL_AXES) == 1 else jax.lax.psum(x, MODEL_AXES)


def gather_model(x: jax.Array, axis: int) -> jax.Array:
    """all_gather (tiled) of x's `axis` over all TP devices; x itself at TP 1."""
    return x if jax.lax.axis_size(MODEL_AXES) == 1 else jax.lax.all_gather(x, MODEL_AXES, axis=axis, tiled=True)


def make_mesh(pc: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("tp", "dcp") mesh of shape (TP // DCP, DCP) with `AxisType.Auto` axes.

    Args:
      pc: the parallel configuration.
      devices: the first `pc.tensor_parallel_size` of these are used, in order, as
        TP ranks 0..TP-1 (default: `jax.devices()`).

    Raises:
      ValueError: the sizes break a rule (`ParallelConfig.check`), or fewer devices than
        `tensor_parallel_size` (`TooFewDevicesError`).
    """
    pc.check()  # DCP divides TP (a model's own rules are `pc.validate`'s)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < pc.tp:
        raise TooFewDevicesError(pc.tp, len(devices),
            f"tensor_parallel_size={pc.tp} needs {pc.tp} devices but only {len(devices)} "
            f"{devices[0].platform if devices else ''} device(s) are visible. On CPU, fake devices "
            f"with XLA_FLAGS=--xla_force_host_platform_device_count={pc.tp} (or "
            f"jax.config.update('jax_num_cpu_devices', {pc.tp})) set before JAX starts, or "
            f"dcpjax.use_cpu_devices({pc.tp}) first thing in the program."
        )
    grid = np.array(devices[: pc.tp], dtype=object).reshape(pc.kv_head_groups, pc.dcp)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def check_mesh(mesh: Mesh, pc: ParallelConfig) -> None:
    """Raise `ValueError` unless `mesh` is the ("tp", "dcp") mesh of `pc`."""
    expected = {TP_AXIS: pc.kv_head_groups, DCP_AXIS: pc.dcp}
    if tuple(mesh.axis_names) != MESH_AXES or dict(mesh.shape) != expected:
        raise ValueError(
            f"mesh {dict(mesh.shape)} with axes {mesh.axis_names} does not match {pc}: expected axes "
            f"{MESH_AXES} of shape {expected}. Build it with dcpjax.make_mesh(pc)."
        )


def kv_head_slots(num_kv_heads: int, pc: ParallelConfig) -> int:
    """KV heads as stored: repeated when the "tp" axis has more KV-head groups than heads, so
    each group holds the head its q heads read (MLA: 1 head). The one rule for models, weights,
    checkpoints and the public op."""
    groups = pc.kv_head_groups
    if not (num_kv_heads % groups == 0 or groups % num_kv_heads == 0):
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be split over the TP // DCP = {groups} KV head groups: "
            f"need num_kv_heads % {groups} == 0 or {groups} % num_kv_heads == 0."
        )
    return max(num_kv_heads, groups)
