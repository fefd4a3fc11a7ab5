"""The KV cache types: paged K/V pools (or MLA's latent) with optional fp8 scales, and the block
tables that address them.

`KVCache` (pools + block tables) is what every attention path reads: the kernels (one device's
pools), the per-device DCP steps inside `shard_map` and the public op (`dcpjax.shard_kv_cache`,
whose arrays are global and sharded by `dcpjax.sharding.mesh.ShardingRules.kv_cache_spec`).
`KVPools` is the engine's stored cache, one per layer: the pools alone, since a step's tables
travel in its `StepBatch`; the layers join the two with `KVPools.with_block_tables`. Contiguous
KV is a paged cache with an identity block table (`KVCache.from_sequences`), so no kernel has a
contiguous branch.

One writer for both, `write`,, stores new tokens at flat slots and quantises them
when the cache is fp8. Which slots (the DCP rank's interleaved ownership) is
`dcpjax.sharding.local_ops.owned_slots`, computed once per step, not per layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
MAX_CONTIGUOUS_PAGE = 128


@dataclasses.dataclass(frozen=True)
class _Pools:
    """What both cache types hold and do: the paged pools, heads first (one KV head's page is a
    contiguous [block_size, d] tile), and their one writer.

    k: [kv_heads, num_blocks, block_size, dk]
    v: [kv_heads, num_blocks, block_size, dv], or None for MLA's latent form (V = K[..., :v_head_dim])
    k_scale, v_scale: [kv_heads, num_blocks, block_size] float32 for an fp8 (e4m3) cache, else None
      (MLA: v_scale None, V shares K's scales)
    index_k: [1, num_blocks, block_size, index_dim], a sparse-attention (DSA) layer's indexer keys
      in the same blocks (`kernels.sparse`), else None; index_k_scale its fp8 scales like k_scale.
    """

    k: jax.Array
    v: jax.Array | None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    index_k: jax.Array | None = None
    index_k_scale: jax.Array | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def use_mla(self) -> bool:
        return self.v is None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def write(self, new_k: jax.Array, new_v: jax.Array | None, slots: jax.Array):
        """Store N new tokens: new_k [N, kv_heads, dk], new_v [N, kv_heads, dv] (None for MLA).

        slots: [N] flat slots (`block * block_size + offset`); negative slots (tokens this
        rank does not own, padding) are dropped. An fp8 cache quantises with one scale per
        token and head. Returns the same type with the new pools.
        """
        if (new_v is None) != self.use_mla:
            raise ValueError("pass new_v exactly when the cache has v (MLA caches carry only the latent k)")
        if (jnp.dtype(self.k.dtype) == jnp.dtype(FP8)) != self.quantized:
            raise ValueError("an fp8 cache needs k_scale (v_scale too unless MLA) to be written")
        k, k_scale = _store(self.k, self.k_scale, new_k, slots)
        v, v_scale = (None, None) if new_v is None else _store(self.v, self.v_scale, new_v, slots)
        return dataclasses.replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def write_index(self, new_keys: jax.Array, slots: jax.Array):
        """Store N new indexer keys [N, index_dim] at flat slots [N] (negative: dropped), quantised
        like the KV (one scale per token) when the cache is fp8."""
        if self.index_k is None:
            raise ValueError("this cache has no indexer keys (index_k): only a sparse-attention layer's has")
        if (jnp.dtype(self.index_k.dtype) == jnp.dtype(FP8)) != (self.index_k_scale is not None):
            raise ValueError("an fp8 index_k needs index_k_scale to be written")
        index_k, index_k_scale = _store(self.index_k, self.index_k_scale, new_keys[:, None], slots)
        return dataclasses.replace(self, index_k=index_k, index_k_scale=index_k_scale)

    def bytes_per_device(self) -> int:
        """KV bytes (pools and scales) one device holds of these (sharded) arrays."""
        fields = (self.k, self.v, self.k_scale, self.v_scale, self.index_k, self.index_k_scale)
        arrays = [x for x in fields if x is not None]
        return sum(a.addressable_shards[0].data.nbytes for a in arrays)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "k_scale", "v_scale", "index_k", "index_k_scale"],
    meta_fields=["v_head_dim"],
)
@dataclasses.dataclass(frozen=True)
class KVPools(_Pools):
    """One layer's stored KV in the engine, the pools alone (shapes: `_Pools`; inside the step
    each DCP rank sees its own blocks). A step's block tables arrive with its `StepBatch`, and
    `with_block_tables` makes the kernels' `KVCache` view of the pools for that step.

    v_head_dim: dv (static).
    """

    v_head_dim: int = 0

    def with_block_tables(self, block_tables: jax.Array) -> KVCache:
        """The pools as the kernels read them, with this step's tables [batch, pages] int32."""
        return KVCache(self.k, self.v, self.k_scale, self.v_scale, self.index_k, self.index_k_scale, block_tables,
                       v_head_dim=self.v_head_dim)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "k_scale", "v_scale", "index_k", "index_k_scale", "block_tables"],
    meta_fields=["v_head_dim", "num_kv_heads", "capacity"],
)
@dataclasses.dataclass(frozen=True)
class KVCache(_Pools):
    """Paged KV with its block tables: what every attention kernel reads, and the public op's
    global cache (pools and scales: `_Pools`).

    block_tables: [batch, pages] int32, the physical blocks of each sequence
    v_head_dim: dv (static)
    num_kv_heads, capacity: the public op's bookkeeping (KV heads before repetition over
      "tp" groups; tokens per sequence that fit), None elsewhere.
    """

    block_tables: jax.Array | None = None
    v_head_dim: int = 0
    num_kv_heads: int | None = None
    capacity: int | None = None

    def with_block_tables(self, block_tables: jax.Array | None) -> KVCache:
        return dataclasses.replace(self, block_tables=block_tables)

    @property
    def index_keys(self) -> KVCache:
        """The indexer keys as the kernels read them (`kernels.sparse.index_scores`), with these tables."""
        return KVCache(self.index_k, None, self.index_k_scale, block_tables=self.block_tables,
                       v_head_dim=self.index_k.shape[-1])

    @classmethod
    def from_sequences(cls, k, v=None, *, v_head_dim: int | None = None, k_scale=None, v_scale=None,
                       page: int | None = None) -> KVCache:
        """Contiguous per-sequence KV as pages with an identity block table (a free reshape).

        k: [batch, seq, kv_heads, dk]; v: [batch, seq, kv_heads, dv] or None (pass v_head_dim);
        scales: [batch, seq, kv_heads]. page: tokens per page (default: the largest power of
        two <= 128 that divides seq).
        """
        batch, seq = k.shape[:2]
        page = page or contiguous_page_size(seq)

        def as_pages(x):  # [B, S, H, ...] -> [H, B * S / page, page, ...]
            if x is None:
                return None
            return jnp.moveaxis(x.reshape(batch * (seq // page), page, *x.shape[2:]), 2, 0)

        tables = identity_block_tables(batch, max(seq // page, 1))
        dv = v.shape[-1] if v is not None else v_head_dim
        return cls(as_pages(k), as_pages(v), as_pages(k_scale), as_pages(v_scale), block_tables=tables, v_head_dim=dv)


def contiguous_page_size(seq: int, limit: int = MAX_CONTIGUOUS_PAGE) -> int:
    """Largest power of two <= limit that divides seq (so paging contiguous KV is a reshape)."""
    page = 1
    while page * 2 <= limit and seq % (page * 2) == 0:
        page *= 2
    return page


def identity_block_tables(batch: int, pages_per_seq: int) -> jax.Array:
    """Sequence b owns blocks b * pages_per_seq ... (b + 1) * pages_per_seq - 1."""
    return jnp.asarray(np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq))


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., d] -> (e4m3 values [..., d], float32 scales [...]): one scale per token and head."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax, 1e-12) / FP8_MAX
    return (x.astype(jnp.float32) / scale[..., None]).astype(FP8), scale


def dequantize_fp8(values: jax.Array, scale: jax.Array) -> jax.Array:
    """`quantize_fp8`'s inverse: e4m3 values [..., d] times their float32 scales [...] -> float32."""
    return values.astype(jnp.float32) * scale[..., None]


def _scatter(pool: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """pool [H, num_blocks, bs, ...] with new [N, H, ...] stored at flat slots [N]; slots < 0 dropped.

    Indexed by (block, offset) in the pool's own shape: scattering into a flattened
    [H, num_blocks * bs, ...] view made XLA:CPU copy the whole pool every step (in-place
    aliasing lost through the reshape when the step also gathers from the pool).
    """
    block_size = pool.shape[2]
    blocks = jnp.where(slots < 0, pool.shape[1], slots // block_size)  # out of range: dropped
    return pool.at[:, blocks, slots % block_size].set(jnp.moveaxis(new, 1, 0).astype(pool.dtype), mode="drop")


def _store(pool, scales, new, slots):
    if scales is None:
        return _scatter(pool, new, slots), None
    values, token_scales = quantize_fp8(new)
    return _scatter(pool, values, slots), _scatter(scales, token_scales, slots)


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[H, num_blocks, block_size, ...] pages -> [H, batch, pages * block_size, ...] in token order."""
    batch, max_blocks = block_tables.shape
    gathered = pages[:, block_tables]  # [H, batch, max_blocks, block_size, ...]
    return gathered.reshape(pages.shape[0], batch, max_blocks * pages.shape[2], *pages.shape[3:])
