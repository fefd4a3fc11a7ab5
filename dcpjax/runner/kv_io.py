"""One sequence's KV read out of the paged DCP cache, or written into it (prefill/decode
disaggregation: `dcpjax.kv_transfer`).

Out (a prefill server): the sequence's blocks gathered on each device in one program
(`shard_map`: every device takes its own heads' pages of its own DCP rank, nothing else moves),
copied to the host, and cut to what the wire carries: for each attention layer and each DCP rank
r of this layout, the rank's tokens in its local order, `[kv_heads, n_r, d]` (each KV head once,
however many TP groups store it), and a linear-attention layer's state row of the slot,
`[heads, ...]`.

In (a decode server): the tokens in position order, `[kv_heads, num_tokens, d]` in this cache's
dtype, scattered into the blocks the scheduler gave the sequence, each position onto the DCP rank,
block and offset that own it under this layout (`sharding.layout`), each stored KV head slot
from its head; a state row into the sequence's slot.

Both compile once per power-of-two bucket of blocks / tokens, at start-up when the engine
precompiles (`runner.precompile`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dcpjax.kernels import KVPools, LinearState
from dcpjax.sharding import layout
from dcpjax.sharding.mesh import DCP_AXIS, RULES

POOL_FIELDS = ("k", "v", "k_scale", "v_scale")
STATE_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")


def bucket(n: int, smallest: int = 16) -> int:
    """The power of two >= n (at least `smallest`): the compiled sizes of a gather or scatter."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def rank_lengths(num_tokens: int, dcp: int, interleave: int) -> list[int]:
    """How many of positions 0 .. num_tokens - 1 each DCP rank owns (`layout.local_length`, in ints)."""
    rounds, rest = divmod(num_tokens, interleave * dcp)
    return [rounds * interleave + min(max(rest - r * interleave, 0), interleave) for r in range(dcp)]


def wire_name(layer: int, field: str, rank: int | None = None) -> str:
    """An array's name on the wire: "3.k.0" (layer 3's K of DCP rank 0), "5.recurrent"."""
    return f"{layer}.{field}" if rank is None else f"{layer}.{field}.{rank}"


class KVMover:
    """The gather and scatter of one runner's caches (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        kv, cfg = runner.kv_layout, runner.cfg
        self.kv_heads = 1 if cfg.use_mla else cfg.num_key_value_heads
        self._lower_lock = threading.Lock()  # precompile's threads: one trace at a time, compiles in parallel
        self.repeats = kv.kv_slots // self.kv_heads  # stored copies of each head (TP groups > KV heads)
        self.dcp, self.interleave, self.block_size = runner.pc.dcp, runner.pc.interleave, kv.block_size
        specs = tuple(RULES.layer_cache_spec(cache) for cache in runner.kv_caches)
        row = RULES.spec("linear_heads", None, None)
        rows = tuple(LinearState(*(row,) * 4) if isinstance(c, LinearState) else self._update_spec(c)
                     for c in runner.kv_caches)
        gathered = tuple(LinearState(*(row,) * 4) if isinstance(c, LinearState) else s
                         for c, s in zip(runner.kv_caches, specs))
        scalar = PartitionSpec()
        self._gather = jax.jit(jax.shard_map(_gather_body, mesh=runner.mesh, in_specs=(specs, scalar, scalar),
                                             out_specs=gathered, check_vma=False))
        self._scatter = jax.jit(jax.shard_map(_scatter_body, mesh=runner.mesh,
                                              in_specs=(specs, rows, scalar, scalar, scalar, scalar),
                                              out_specs=specs, check_vma=False), donate_argnums=0)

    @property
    def state_row_bytes(self) -> int:
        """Bytes of one slot's linear-attention state, all layers (0 without linear layers)."""
        return sum(a.nbytes // a.shape[0] for c in self.runner.kv_caches if isinstance(c, LinearState)
                   for a in (c.conv_q, c.conv_k, c.conv_v, c.recurrent))

    @staticmethod
    def _update_spec(pools: KVPools) -> KVPools:
        """Specs of a layer's position-ordered update: [kv_slots, tokens, d] heads split like the pool."""
        values, scales = RULES.spec("kv_heads", None, None), RULES.spec("kv_heads", None)
        some = lambda x, spec: None if x is None else spec
        return KVPools(values, some(pools.v, values), some(pools.k_scale, scales), some(pools.v_scale, scales),
                       v_head_dim=pools.v_head_dim)

    # -- ahead of time (`runner.precompile`) -----------------------------------------------------
    def gather_buckets(self, max_tokens: int) -> list[int]:
        """The block-count buckets a gather of a sequence of up to `max_tokens` tokens can take."""
        most = bucket(-(-max_tokens // layout.virtual_block_size(self.block_size, self.dcp)), 1)
        return [1 << i for i in range(most.bit_length())]

    def scatter_buckets(self, max_tokens: int) -> list[int]:
        """The token buckets a scatter of up to `max_tokens` tokens can take."""
        return [n for n in (1 << i for i in range(bucket(max_tokens).bit_length())) if n >= bucket(1)]

    def compile_gather(self, num_ids: int) -> None:
        """Compile the gather of `num_ids` blocks (thread-safe); jit's lower().compile() fills the
        cache its calls use."""
        with self._lower_lock:
            lowered = self._gather.lower(self.runner.kv_caches, np.zeros(num_ids, np.int32), np.int32(0))
        lowered.compile()

    def compile_scatter(self, tokens: int) -> None:
        """Compile the scatter of a `tokens` bucket (thread-safe), on arrays shaped as `scatter` makes them."""
        like = lambda a, dims: None if a is None else jax.ShapeDtypeStruct(dims, a.dtype)
        updates = []
        for cache in self.runner.kv_caches:
            if isinstance(cache, LinearState):
                updates.append(LinearState(*(like(a, a.shape[1:]) for a in (getattr(cache, f) for f in STATE_FIELDS))))
            else:
                pools = (getattr(cache, f) for f in POOL_FIELDS)
                updates.append(KVPools(*(like(a, a is not None and (a.shape[0], tokens, *a.shape[3:])) for a in pools),
                                       v_head_dim=cache.v_head_dim))
        index = jax.ShapeDtypeStruct((tokens,), jnp.int32)
        with self._lower_lock:
            lowered = self._scatter.lower(self.runner.kv_caches, tuple(updates), index, index, index, np.int32(0))
        lowered.compile()

    # -- out -------------------------------------------------------------------------------------
    def gather(self, blocks: Sequence[int], slot: int) -> tuple:
        """The sequence's pages and state rows on the devices (its host copy started): each layer's
        KVPools [kv_slots, DCP * pad, block_size, d] or LinearState rows [heads, ...]."""
        ids = np.full(bucket(len(blocks), 1), blocks[0] if blocks else 0, np.int32)
        ids[: len(blocks)] = blocks
        out = self._gather(self.runner.kv_caches, ids, np.int32(slot))
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        return out

    def wire_arrays(self, gathered: tuple, num_tokens: int) -> dict[str, np.ndarray]:
        """`gather`'s arrays as the wire carries them (host; any thread): per attention layer and DCP
        rank its first local_length tokens, each KV head once; per linear layer its state rows."""
        out: dict[str, np.ndarray] = {}
        lengths = rank_lengths(num_tokens, self.dcp, self.interleave)
        for i, layer in enumerate(gathered):
            if isinstance(layer, LinearState):
                out |= {wire_name(i, f): np.asarray(getattr(layer, f)) for f in STATE_FIELDS}
                continue
            for field in POOL_FIELDS:
                pages = getattr(layer, field)
                if pages is None:
                    continue
                pages = np.asarray(pages)[:: self.repeats]  # [kv_heads, DCP * pad, block_size, ...]
                per_rank = pages.reshape(self.kv_heads, self.dcp, -1, *pages.shape[3:])
                for r, n in enumerate(lengths):
                    out[wire_name(i, field, r)] = np.ascontiguousarray(per_rank[:, r, :n])
        return out

    # -- in --------------------------------------------------------------------------------------
    def scatter(self, arrays: dict[str, np.ndarray], num_tokens: int, blocks: Sequence[int], slot: int) -> None:
        """Write a sequence's arriving KV (position order, this cache's dtype: `arrays` named
        "{layer}.{field}", [kv_heads, num_tokens, ...]; state rows [heads, ...]) into `blocks` and
        `slot`; the runner's next call reads it."""
        runner, pad = self.runner, bucket(num_tokens)
        pos = np.arange(pad)
        rank = np.where(pos < num_tokens, layout.owner_rank(pos, self.dcp, self.interleave), -1).astype(np.int32)
        logical = np.minimum(pos // layout.virtual_block_size(self.block_size, self.dcp), len(blocks) - 1)
        block = np.asarray(blocks, np.int32)[logical]
        offset = (layout.local_index(pos, self.dcp, self.interleave) % self.block_size).astype(np.int32)
        updates = []
        for i, cache in enumerate(runner.kv_caches):
            if isinstance(cache, LinearState):
                updates.append(LinearState(*(arrays[wire_name(i, f)] for f in STATE_FIELDS)))
                continue
            slots = np.arange(runner.kv_layout.kv_slots) // self.repeats  # each stored slot's head
            parts = {f: None if getattr(cache, f) is None else _padded(arrays[wire_name(i, f)][slots], pad)
                     for f in POOL_FIELDS}
            updates.append(KVPools(**parts, v_head_dim=cache.v_head_dim))
        runner.kv_caches = self._scatter(runner.kv_caches, tuple(updates), rank, block, offset, np.int32(slot))


def _gather_body(caches, ids, slot):
    """On each device: its pages of blocks `ids` (its heads, its DCP rank), its state rows of `slot`."""
    out = []
    for cache in caches:
        if isinstance(cache, LinearState):
            out.append(LinearState(*(getattr(cache, f)[slot] for f in STATE_FIELDS)))
        else:
            take = lambda a: None if a is None else a[:, ids]
            out.append(KVPools(*(take(getattr(cache, f)) for f in POOL_FIELDS), v_head_dim=cache.v_head_dim))
    return tuple(out)


def _scatter_body(caches, updates, rank, block, offset, slot):
    """On each device: the positions its DCP rank owns into its pages (others dropped), its heads'
    state rows into `slot`."""
    mine = jax.lax.axis_index(DCP_AXIS)
    out = []
    for cache, update in zip(caches, updates):
        if isinstance(cache, LinearState):
            out.append(LinearState(*(getattr(cache, f).at[slot].set(getattr(update, f)) for f in STATE_FIELDS)))
            continue
        target = jnp.where(rank == mine, block, cache.k.shape[1])  # out of range: dropped
        out.append(KVPools(*(_put(getattr(cache, f), getattr(update, f), target, offset) for f in POOL_FIELDS),
                           v_head_dim=cache.v_head_dim))
    return tuple(out)


def _put(pool, new, target, offset):
    return None if pool is None else pool.at[:, target, offset].set(new, mode="drop")


def _padded(a: np.ndarray, tokens: int) -> np.ndarray:
    """[heads, n, ...] padded with zeros to [heads, tokens, ...] (a compiled bucket's size)."""
    return np.pad(a, [(0, 0), (0, tokens - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
