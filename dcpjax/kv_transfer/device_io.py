"""One sequence's KV read out of the paged DCP cache, or written into it (prefill/decode
disaggregation: `dcpjax.kv_transfer`). The names and shapes of what travels are the
`kv_transfer.layout.KVLayout`'s (`wire_specs`).

Out (a prefill server, `gather`): one program over the mesh takes the sequence's blocks on every
device, stacks the KV layers, keeps each KV head once (a head stored by several "tp" groups is
taken from one) and leaves DCP rank r's tokens, in r's local order, on the devices of rank r:
`"{field}.{r}"` [kv_layers, kv_heads, tokens, dim], one single-device array per rank, padded to the
gather's bucket of blocks. A linear layer's state row of the slot: `"state.{i}.{field}"` [heads, ...].

In (a decode server, `scatter`): per field, [DCP, kv_layers, kv_slots, tokens, dim] in this cache's
local orders (`kv_transfer.resharding` builds it on the host from any producer's layout), placed with
a sharded `device_put` (each device receives its rank's positions of its own head slots, nothing
else), converted to this cache's dtype on the devices (`quantize_fp8`, as a new token is stored) and
written into the blocks the scheduler allocated. State rows go into the sequence's slot.

Block ids come per KV cache group (`models.kv_groups`), [groups, blocks]: each layer's pages are
those of its group's table. A sliding group's entries behind its window are `NULL_BLOCK`: a
gather reads the null block there (the receiver never attends to those positions), a scatter
drops what would land there.

Both compile once per power-of-two bucket (blocks out, tokens per rank in), at start-up when the
engine precompiles (`runner.precompile`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dcpjax.kernels import KVPools, LinearState
from dcpjax.kernels.kv_cache import dequantize_fp8, quantize_fp8
from dcpjax.kv_transfer.layout import SCALE_FIELDS, STATE_FIELDS, KVLayout, bucket, pool_name, state_name
from dcpjax.models.kv_groups import NULL_BLOCK
from dcpjax.sharding.mesh import DCP_AXIS, RULES, TP_AXIS


def describe(runner) -> KVLayout:
    """The `KVLayout` of one runner's cache."""
    cfg, kv, pc = runner.cfg, runner.kv_layout, runner.pc
    kv_heads = 1 if cfg.use_mla else cfg.num_key_value_heads
    states = [c for c in runner.kv_caches if isinstance(c, LinearState)]
    state_shapes = tuple((f, tuple(getattr(states[0], f).shape[1:])) for f in STATE_FIELDS) if states else ()
    return KVLayout(architecture=cfg.architecture,
                    layers=tuple("linear" if cfg.is_linear(i) else "kv" for i in range(cfg.num_hidden_layers)),
                    kv_heads=kv_heads, pool_dims=tuple(kv.pool_dims), kv_dtype=np.dtype(kv.dtype).name, tp=pc.tp,
                    dcp=pc.dcp, interleave=pc.interleave, block_size=kv.block_size,
                    head_repeats=kv.kv_slots // kv_heads, state_shapes=state_shapes,
                    pool_names=tuple(kv.pool_names))


class KVMover:
    """The gather and scatter of one runner's caches (see the module docstring)."""

    def __init__(self, runner):
        self.runner, self.layout = runner, describe(runner)
        groups = self.groups = runner.kv_groups
        # per KV layer, in layer order: (its cache in the runner's tuple, its group's table)
        self.kv_layers = [(groups.cache_index[i], groups.group_of[i]) for i in sorted(groups.group_of)]
        self.linear_index = [i for i, c in enumerate(runner.kv_caches) if isinstance(c, LinearState)]
        self._lower_lock = threading.Lock()  # precompile's threads: one trace at a time, compiles in parallel
        mesh, lay = runner.mesh, self.layout
        specs = tuple(RULES.layer_cache_spec(cache) for cache in runner.kv_caches)
        row = RULES.spec("linear_heads", None, None)
        scalar = PartitionSpec()
        stacked = PartitionSpec(DCP_AXIS, None, TP_AXIS)  # [DCP, kv_layers, kv_slots, tokens, ...]
        fields = lay.pool_fields
        gathered = ({f: stacked for f in fields}, {i: LinearState(*(row,) * 4) for i in self.linear_index})
        by_rank = NamedSharding(mesh, PartitionSpec(DCP_AXIS))
        replicated = NamedSharding(mesh, PartitionSpec())
        gather = jax.shard_map(self._gather_body, mesh=mesh, in_specs=(specs, scalar, scalar), out_specs=gathered,
                               check_vma=False)
        repeats = lay.head_repeats

        def distinct_heads(caches, ids, slot):  # the stored copies of a head dropped inside the program
            pools, states = gather(caches, ids, slot)
            return {f: x[:, :, ::repeats] for f, x in pools.items()}, states

        self._gather = jax.jit(distinct_heads, out_shardings=(
            {f: by_rank for f in fields}, {i: LinearState(*(replicated,) * 4) for i in self.linear_index}))
        self.update_sharding = NamedSharding(mesh, stacked)
        self.state_sharding = NamedSharding(mesh, row)
        self._cache_specs, self._stacked_spec, self._row_spec = specs, stacked, row
        self._scatters: dict[tuple[str, ...], object] = {}  # by the producer's pool fields (its dtype's)

    def _scatter_program(self, fields: tuple[str, ...]):
        """The scatter program for a producer's pools (an fp8 producer's carry scales): one per set."""
        if fields not in self._scatters:
            scalar = PartitionSpec()
            in_specs = (self._cache_specs, {f: self._stacked_spec for f in fields},
                        {i: LinearState(*(self._row_spec,) * 4) for i in self.linear_index}, scalar, scalar, scalar)
            self._scatters[fields] = jax.jit(jax.shard_map(self._scatter_body, mesh=self.runner.mesh,
                                                           in_specs=in_specs, out_specs=self._cache_specs,
                                                           check_vma=False), donate_argnums=0)
        return self._scatters[fields]

    # -- ahead of time (`runner.precompile`) -----------------------------------------------------
    def gather_buckets(self, max_tokens: int) -> list[int]:
        """The block-count buckets a gather of a sequence of up to `max_tokens` tokens can take."""
        most = bucket(-(-max_tokens // (self.layout.block_size * self.layout.dcp)), 1)
        return [1 << i for i in range(most.bit_length())]

    def scatter_buckets(self, max_tokens: int) -> list[int]:
        """The tokens-per-rank buckets a scatter of up to `max_tokens` tokens can take."""
        most = bucket(max(self.layout.rank_lengths(max_tokens)))
        return [n for n in (1 << i for i in range(most.bit_length())) if n >= bucket(1)]

    def compile_gather(self, num_ids: int) -> None:
        """Compile the gather of `num_ids` blocks (thread-safe); jit's lower().compile() fills the
        cache its calls use."""
        with self._lower_lock:
            lowered = self._gather.lower(self.runner.kv_caches, np.zeros((self.groups.num_groups, num_ids), np.int32),
                                         np.int32(0))
        lowered.compile()

    def compile_scatter(self, tokens: int) -> None:
        """Compile the scatter of a `tokens`-per-rank bucket (thread-safe), for a producer whose KV dtype
        is this cache's (another dtype compiles at its first transfer)."""
        args = self._scatter_args_like(tokens)
        with self._lower_lock:
            lowered = self._scatter_program(tuple(args[0])).lower(self.runner.kv_caches, *args)
        lowered.compile()

    def _scatter_args_like(self, tokens: int) -> tuple:
        lay, caches = self.layout, self.runner.kv_caches
        updates = {}
        for field in lay.pool_fields:
            pool = getattr(caches[self.kv_layers[0][0]], field)
            shape = (lay.dcp, len(self.kv_layers), pool.shape[0], tokens, *pool.shape[3:])
            updates[field] = jax.ShapeDtypeStruct(shape, pool.dtype, sharding=self.update_sharding)
        states = {i: LinearState(*(jax.ShapeDtypeStruct(getattr(caches[i], f).shape[1:], getattr(caches[i], f).dtype,
                                                        sharding=self.state_sharding) for f in STATE_FIELDS))
                  for i in self.linear_index}
        blocks = jax.ShapeDtypeStruct((self.groups.num_groups, -(-tokens // lay.block_size)), jnp.int32)
        return updates, states, np.zeros(lay.dcp, np.int32), blocks, np.int32(0)

    # -- out -------------------------------------------------------------------------------------
    def gather(self, blocks: Sequence[Sequence[int]], slot: int) -> dict[str, jax.Array]:
        """The sequence's KV and state on the devices, as it travels (module docstring), each rank's
        tokens padded to the bucket of `blocks` [groups, n] x block_size. Enqueued: the arrays are ready
        once the device has run it, whatever writes the blocks afterwards."""
        n = len(blocks[0]) if blocks else 0
        ids = np.zeros((self.groups.num_groups, bucket(n, 1)), np.int32)
        for g, group in enumerate(blocks):
            ids[g] = group[0] if n else 0
            ids[g, :n] = group
        pools, states = self._gather(self.runner.kv_caches, ids, np.int32(slot))
        out: dict[str, jax.Array] = {}
        for field, stacked in pools.items():
            for shard in stacked.addressable_shards:  # [1, kv_layers, kv_heads, tokens, ...] per device
                name = pool_name(field, shard.index[0].start or 0)
                if name not in out:
                    out[name] = shard.data
        for i, state in states.items():
            for f in STATE_FIELDS:
                out[state_name(i, f)] = getattr(state, f).addressable_shards[0].data
        return out

    # -- in --------------------------------------------------------------------------------------
    def place(self, updates: dict[str, np.ndarray], states: dict[int, dict[str, np.ndarray]]) -> tuple:
        """Arriving KV onto the devices (any thread: the cache is not touched), each device receiving its
        rank's positions of its own head slots. updates: per pool field of the producer, [DCP,
        kv_layers, kv_slots, tokens, dim] in this cache's local orders (`resharding.for_receiver`), in the
        producer's dtype; states: per linear layer its state row by field."""
        placed = {f: jax.device_put(a, self.update_sharding) for f, a in updates.items()}
        rows = {i: LinearState(*(jax.device_put(row[f], self.state_sharding) for f in STATE_FIELDS))
                for i, row in states.items()}
        return placed, rows

    def scatter(self, placed: tuple, lengths: Sequence[int], blocks: Sequence[Sequence[int]], slot: int) -> None:
        """Write `place`d KV into `blocks` [groups, n] and `slot` (the engine's thread: the runner's next
        call reads it); lengths [DCP]: the positions each rank owns."""
        updates, rows = placed
        tokens = next(iter(updates.values())).shape[3]
        table = np.zeros((self.groups.num_groups, -(-tokens // self.layout.block_size)), np.int32)
        used = min(len(blocks[0]), table.shape[1])
        for g, group in enumerate(blocks):
            table[g, :used] = group[:used]
        self.runner.write_kv_caches(self._scatter_program(tuple(updates)), updates, rows,
                                    np.asarray(lengths, np.int32), table, np.int32(slot))

    # -- the programs ------------------------------------------------------------------------------
    def _gather_body(self, caches, ids, slot):
        """On each device: its pages of blocks `ids` (its head slots, its DCP rank), stacked over the KV
        layers in local order, and its heads' state rows of `slot`."""
        pools = {}
        for field in self.layout.pool_fields:
            taken = [getattr(caches[c], field)[:, ids[g]] for c, g in self.kv_layers]  # [slots, blocks, bs, ...]
            stacked = jnp.stack(taken)
            pools[field] = stacked.reshape(1, *stacked.shape[:2], -1, *stacked.shape[4:])
        states = {i: LinearState(*(getattr(caches[i], f)[slot] for f in STATE_FIELDS)) for i in self.linear_index}
        return pools, states

    def _scatter_body(self, caches, updates, states, lengths, blocks, slot):
        """On each device: its rank's positions into its pages (past its length: dropped), converted to
        the pools' dtype; its heads' state rows into `slot`."""
        tokens = next(iter(updates.values())).shape[3]
        j = jnp.arange(tokens)
        mine = lengths[jax.lax.axis_index(DCP_AXIS)]
        block_size = self.layout.block_size
        out = list(caches)
        for n, (i, g) in enumerate(self.kv_layers):
            cache = out[i]  # a pool tensor several groups' layers share: each writes its own blocks
            block = blocks[g, jnp.minimum(j // block_size, blocks.shape[1] - 1)]
            keep = (j < mine) & (block != NULL_BLOCK) if self.groups.sliding else j < mine
            target = jnp.where(keep, block, cache.k.shape[1])  # out of range: dropped
            fields = _converted({f: u[0, n] for f, u in updates.items()}, cache)
            out[i] = dataclasses.replace(cache, **{f: getattr(cache, f).at[:, target, j % block_size].set(
                fields[f], mode="drop") for f in fields})
        for i, row in states.items():
            out[i] = LinearState(*(getattr(caches[i], f).at[slot].set(getattr(row, f)) for f in STATE_FIELDS))
        return tuple(out)


def _converted(fields: dict, cache: KVPools) -> dict:
    """One layer's arriving {k, v, index_k[, their scales]} [slots, tokens, ...] in the pools' dtype: an
    fp8 cache quantizes float KV as a new token is stored (`quantize_fp8`); a float cache dequantizes
    fp8 KV as the kernels read it (`dequantize_fp8`)."""
    values = [f for f in fields if f not in SCALE_FIELDS]
    sent_fp8 = "k_scale" in fields
    if cache.k_scale is not None and sent_fp8:
        return fields
    if cache.k_scale is not None:
        out = {}
        for f in values:
            out[f], out[f"{f}_scale"] = quantize_fp8(fields[f])
        return out
    if sent_fp8:
        return {f: dequantize_fp8(fields[f], fields[f"{f}_scale"]).astype(cache.k.dtype) for f in values}
    return {f: fields[f].astype(cache.k.dtype) for f in values}

