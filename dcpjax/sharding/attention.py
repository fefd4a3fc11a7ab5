"""DCP decode attention on a ("tp", "dcp") mesh: the public op for notebooks and tests.

KV is split by head over "tp" (the TP // DCP KV-head groups) and by interleaved
token position over "dcp". One decode step, per device (docs/architecture.md):
  1. q: this device's q_heads / TP heads;
  2. all_gather q over "dcp" -> the q_heads / (TP/DCP) heads of its KV group;
  3. attention over the tokens this rank owns -> partial out + LSE (float32);
  4. LSE merge over "dcp" (ag_rs or a2a) -> this device's own heads, exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax.kernels import AttentionOptions, KVCache, check_attention_backend
from dcpjax.kernels.kv_cache import FP8, MAX_CONTIGUOUS_PAGE, contiguous_page_size
from dcpjax.sharding import layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.local_ops import dcp_attention, owned_slots
from dcpjax.sharding.mesh import RULES, check_mesh, kv_head_slots
from dcpjax.sharding.sparse import dcp_sparse_attention

# The public op's cache is the one `KVCache` type; its arrays are global and sharded:
#   k [kv_slots, DCP * num_blocks, block_size, dk] split P("tp", "dcp", None, None): each rank
#   has its own pool of num_blocks; `block_tables` [batch, pages] (replicated) is shared by all
#   ranks (vLLM's virtual block of block_size * DCP positions). v like k (None for MLA's latent).
#   kv_slots = max(num_kv_heads, TP // DCP): KV heads are repeated when the "tp" axis has more
#   groups than heads, so each group holds the head its q heads use.
DCPKVCache = KVCache

_Q_SPEC = RULES.spec("batch", "q_heads", None)  # [B, Hq, d] and [B, Hq] prefixes
_LSE_SPEC = RULES.spec("batch", "q_heads")
_NEW_KV_SPEC = RULES.spec("batch", "kv_heads", None)
_REPLICATED = PartitionSpec()


def _expand_heads(x, num_kv_heads: int, pc: ParallelConfig, axis: int):
    """Repeat KV heads (numpy or jax array) so each "tp" group gets the head its q heads read."""
    repeats = kv_head_slots(num_kv_heads, pc) // num_kv_heads
    xp = np if isinstance(x, np.ndarray) else jnp
    return x if repeats == 1 else xp.repeat(x, repeats, axis=axis)


# -- building a cache -----------------------------------------------------------
# Built in host numpy, then each device receives only its own shard: no device
# ever holds the whole unsplit cache.
def _interleaved_local(x: np.ndarray, local_cap: int, pc: ParallelConfig) -> np.ndarray:
    """[B, S, H, d] token order -> [B, DCP, local_cap, H, d], zeros past S."""
    batch, seq = x.shape[:2]
    positions = np.asarray(layout.global_position(
        np.arange(local_cap)[None, :], np.arange(pc.dcp)[:, None], pc.dcp, pc.interleave
    ))  # [DCP, local_cap]
    padded = np.zeros((batch, int(positions.max()) + 1, *x.shape[2:]), x.dtype)
    padded[:, :seq] = x
    return padded[:, positions.reshape(-1)].reshape(batch, pc.dcp, local_cap, *x.shape[2:])


def _to_pages(local: np.ndarray, block_tables: np.ndarray, num_blocks: int, block_size: int) -> np.ndarray:
    """[B, DCP, local_cap, H, d] -> per-rank pools, heads first: [H, DCP * num_blocks, block_size, d]."""
    batch, dcp, local_cap = local.shape[:3]
    blocks_per_seq = local_cap // block_size
    pools = np.zeros((dcp, num_blocks, block_size, *local.shape[3:]), local.dtype)
    chunks = local.reshape(batch, dcp, blocks_per_seq, block_size, *local.shape[3:])
    pools[:, block_tables[:, :blocks_per_seq]] = np.moveaxis(chunks, 1, 0)  # [DCP, B, blocks, bs, H, d]
    return np.moveaxis(pools.reshape(dcp * num_blocks, block_size, *local.shape[3:]), 2, 0)


def _contiguous_block_size(capacity: int, pc: ParallelConfig) -> int:
    """Block size that makes a contiguous cache a paged one with an identity table (a reshape):
    I times the largest power of two dividing local_cap / I, at most 128 tokens where I allows
    (a block holds whole runs of I tokens)."""
    local_cap = layout.local_capacity(capacity, pc.dcp, pc.interleave)  # a multiple of I
    runs = contiguous_page_size(local_cap // pc.interleave, limit=max(1, MAX_CONTIGUOUS_PAGE // pc.interleave))
    return pc.interleave * runs


def _geometry(batch: int, capacity: int, pc: ParallelConfig, block_size: int | None, block_tables,
              num_blocks: int | None):
    """(capacity, block_size, blocks_per_seq, block_tables, num_blocks) of a cache to build."""
    if block_size is None:
        block_size = _contiguous_block_size(capacity, pc)
    else:
        layout.check_block_size(block_size, pc.interleave)
        capacity = layout.blocks_needed(capacity, block_size, pc.dcp) * layout.virtual_block_size(block_size, pc.dcp)
    blocks_per_seq = layout.blocks_needed(capacity, block_size, pc.dcp)
    block_tables, num_blocks = _check_block_tables(block_tables, batch, blocks_per_seq, num_blocks)
    return capacity, block_size, blocks_per_seq, block_tables, num_blocks


def _check_block_tables(block_tables, batch: int, blocks_per_seq: int, num_blocks: int | None):
    """Default sequential tables; entries in use must be distinct blocks < num_blocks."""
    if block_tables is None:
        block_tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    block_tables = np.asarray(block_tables, np.int32)
    if block_tables.shape[0] != batch or block_tables.shape[1] < blocks_per_seq:
        raise ValueError(f"block_tables must be [batch={batch}, >= {blocks_per_seq}], got {block_tables.shape}")
    needed = block_tables[:, :blocks_per_seq]
    num_blocks = int(needed.max()) + 1 if num_blocks is None else num_blocks
    if int(needed.min()) < 0 or int(needed.max()) >= num_blocks or len(set(needed.ravel().tolist())) != needed.size:
        raise ValueError(f"block_tables entries in use must be distinct blocks in [0, {num_blocks})")
    return block_tables, num_blocks


def _check_kv(k, v, v_head_dim: int | None) -> int:
    if k.ndim != 4:
        raise ValueError(f"k must be [batch, seq, kv_heads, head_dim], got shape {k.shape}")
    if v is None:
        if v_head_dim is None or not 0 < v_head_dim <= k.shape[3]:
            raise ValueError(f"v=None is MLA's latent form: pass 0 < v_head_dim <= {k.shape[3]}, got {v_head_dim}")
        return v_head_dim
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must match k {k.shape} except in the last dimension")
    return v.shape[3]


def shard_kv_cache(
    k: jax.Array,
    v: jax.Array | None,
    mesh: Mesh,
    pc: ParallelConfig,
    *,
    capacity: int | None = None,
    block_size: int | None = None,
    block_tables: jax.Array | None = None,
    num_blocks: int | None = None,
    v_head_dim: int | None = None,
) -> KVCache:
    """Lay out a KV cache over the mesh: KV heads over "tp", interleaved tokens over "dcp".

    Args:
      k: [batch, seq, kv_heads, dk] in token order (any seq, 0 included).
      v: [batch, seq, kv_heads, dv], or None for MLA's latent form (pass `v_head_dim`).
      capacity: tokens per sequence the cache can hold (default seq); room to append.
      block_size: tokens per block and rank (default: a contiguous layout, i.e. pages that
        tile each sequence's local tokens in order, with an identity block table).
      block_tables: [batch, max_blocks] physical blocks per sequence (default sequential).
        Every entry a sequence needs must be a distinct block < num_blocks.
      num_blocks: blocks per rank in the pool (default: 1 + max(block_tables)).
    Returns a `KVCache` whose pools are [kv_slots, DCP * num_blocks, block_size, d], sharded
    P("tp", "dcp", None, None), with replicated block_tables.
    """
    check_mesh(mesh, pc)
    v_head_dim = _check_kv(k, v, v_head_dim)
    batch, seq, num_kv_heads = k.shape[:3]
    capacity = seq if capacity is None else capacity
    if capacity < max(seq, 1):
        raise ValueError(f"capacity ({capacity}) must be >= 1 and >= the tokens given ({seq})")
    capacity, block_size, blocks_per_seq, block_tables, num_blocks = _geometry(
        batch, capacity, pc, block_size, block_tables, num_blocks)
    sharding = NamedSharding(mesh, RULES.kv_pool_spec)

    def place(x):
        local = _interleaved_local(_expand_heads(np.asarray(x), num_kv_heads, pc, axis=2),
                                   blocks_per_seq * block_size, pc)
        pages = _to_pages(local, block_tables, num_blocks, block_size)
        return jax.make_array_from_callback(pages.shape, sharding, lambda index: pages[index])

    tables = jax.device_put(jnp.asarray(block_tables), NamedSharding(mesh, _REPLICATED))
    return KVCache(place(k), None if v is None else place(v), block_tables=tables, v_head_dim=v_head_dim,
                   num_kv_heads=num_kv_heads, capacity=capacity)


def empty_kv_cache(
    mesh: Mesh,
    pc: ParallelConfig,
    *,
    batch: int,
    capacity: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    use_mla: bool = False,
    dtype=jnp.bfloat16,
    block_size: int | None = None,
) -> KVCache:
    """An all-zero cache to fill with `append_kv` (lengths start at 0).

    dtype float8_e4m3fn makes an fp8 cache: `append_kv` quantises with a float32 scale per
    token and head, and attention dequantises.
    """
    check_mesh(mesh, pc)
    if use_mla and not (v_head_dim and 0 < v_head_dim <= head_dim):
        raise ValueError(f"use_mla: pass 0 < v_head_dim <= {head_dim}, got {v_head_dim}")
    capacity, block_size, _, block_tables, num_blocks = _geometry(batch, capacity, pc, block_size, None, None)
    slots = kv_head_slots(num_kv_heads, pc)
    shape = lambda dim: (slots, pc.dcp * num_blocks, block_size, dim)

    def zeros(shape, dtype, spec):  # made in place on each device: no host copy of the pool
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()

    quantized = jnp.dtype(dtype) == jnp.dtype(FP8)
    scales = lambda: zeros(shape(0)[:3], jnp.float32, RULES.kv_scale_spec) if quantized else None
    return KVCache(
        k=zeros(shape(head_dim), dtype, RULES.kv_pool_spec),
        v=None if use_mla else zeros(shape(v_head_dim or head_dim), dtype, RULES.kv_pool_spec),
        k_scale=scales(), v_scale=None if use_mla else scales(),
        block_tables=jax.device_put(jnp.asarray(block_tables), NamedSharding(mesh, _REPLICATED)),
        v_head_dim=v_head_dim if use_mla else (v_head_dim or head_dim), num_kv_heads=num_kv_heads, capacity=capacity,
    )


# -- appending one token ----------------------------------------------------------
@functools.cache
def _append_fn(mesh: Mesh, pc: ParallelConfig, spec: KVCache):
    def body(cache: KVCache, k_new, v_new, positions):
        slots = owned_slots(positions, cache.block_tables, cache.block_size, pc)
        return cache.write(k_new, v_new, slots)

    has_v = spec.v is not None
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, _NEW_KV_SPEC, _NEW_KV_SPEC if has_v else None, _REPLICATED),
        out_specs=spec,
        check_vma=False,
    )
    return jax.jit(fn)


def append_kv(
    cache: KVCache,
    k_new: jax.Array,
    v_new: jax.Array | None,
    positions: jax.Array,
    mesh: Mesh,
    pc: ParallelConfig,
) -> KVCache:
    """Write one new token per sequence; only the DCP rank that owns its position stores it.

    Args:
      k_new: [batch, kv_heads, dk]; v_new: [batch, kv_heads, dv] (None for MLA).
      positions: [batch] int, the new token's position (usually the current length),
        each < cache.capacity.
    Returns the updated cache (the input's buffers are not modified).
    """
    check_mesh(mesh, pc)
    batch = k_new.shape[0]
    if (v_new is None) != cache.use_mla:
        raise ValueError("pass v_new exactly when the cache has v (MLA caches carry only k)")
    positions = jnp.asarray(positions, jnp.int32)
    if positions.shape != (batch,):
        raise ValueError(f"positions must be [batch={batch}], got {positions.shape}")
    if not isinstance(positions, jax.core.Tracer):
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cache.capacity:
            raise ValueError(f"positions must lie in [0, capacity={cache.capacity}), got [{low}, {high}]")
    k_new = _expand_heads(k_new, cache.num_kv_heads, pc, axis=1)
    v_new = None if v_new is None else _expand_heads(v_new, cache.num_kv_heads, pc, axis=1)
    return _append_fn(mesh, pc, RULES.kv_cache_spec(cache))(cache, k_new, v_new, positions)


# -- decode attention -----------------------------------------------------------
@functools.cache
def _decode_fn(mesh: Mesh, pc: ParallelConfig, spec: KVCache, options: AttentionOptions, window: int | None):
    def body(q, cache: KVCache, lengths):
        out, lse = dcp_attention(q[:, None], cache, lengths[:, None], pc, options, window=window)
        return out[:, 0].astype(q.dtype), lse[:, 0]

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(_Q_SPEC, spec, _REPLICATED),
        out_specs=(_Q_SPEC, _LSE_SPEC),
        check_vma=False,  # Pallas calls inside shard_map
    )
    return jax.jit(fn)


def dcp_decode_attention(
    q: jax.Array,
    cache: KVCache,
    lengths: jax.Array,
    mesh: Mesh,
    pc: ParallelConfig,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    attention_backend: str = "auto",
    sliding_window: int | None = None,
):
    """Decode attention of one new query per sequence over a DCP-sharded cache.

    Args:
      q: [batch, q_heads, dk]; sharded (or shardable) P(None, ("tp", "dcp"), None).
      cache: from `shard_kv_cache` / `empty_kv_cache` on the same mesh and config.
      lengths: [batch] int, valid tokens per sequence (<= cache.capacity).
      sm_scale: softmax scale (default 1/sqrt(dk)).
      return_lse: also return the LSE.
      attention_backend: "auto" | "pallas" | "reference".
      sliding_window: attend only to the last `sliding_window` positions (the new token's
        included), as Gemma's and Mistral's sliding layers do; None: all of them.
    Returns:
      out [batch, q_heads, dv] in q's dtype, sharded over heads by ("tp", "dcp");
      with return_lse, also lse [batch, q_heads] float32 (natural log).
    """
    check_mesh(mesh, pc)
    check_attention_backend(attention_backend)
    if q.ndim != 3 or q.shape[2] != cache.k.shape[3]:
        raise ValueError(f"q must be [batch, q_heads, {cache.k.shape[3]}], got {q.shape}")
    pc.validate(q.shape[1], cache.num_kv_heads, use_mla=cache.use_mla)
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths must be [batch={q.shape[0]}], got {lengths.shape}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
    options = AttentionOptions(None if sm_scale is None else float(sm_scale), attention_backend,
                               mesh.devices.flat[0].platform)
    window = None if sliding_window is None else int(sliding_window)
    out, lse = _decode_fn(mesh, pc, RULES.kv_cache_spec(cache), options, window)(q, cache, lengths)
    return (out, lse) if return_lse else out


# -- sparse decode attention (DSA) --------------------------------------------------
@functools.cache
def _sparse_decode_fn(mesh: Mesh, pc: ParallelConfig, spec: KVCache, index_spec: KVCache, options: AttentionOptions,
                      top_k: int, index_scale: float):
    def body(q, cache: KVCache, index_q, index_weights, index_cache: KVCache, lengths):
        index_cache = index_cache.with_block_tables(cache.block_tables)  # one table addresses both pools
        out, lse, selection = dcp_sparse_attention(q[:, None], cache, index_q[:, None], index_weights[:, None],
                                                   index_cache, lengths[:, None], pc, options, top_k, index_scale)
        if selection is None:  # dense: every position each query sees, in order
            top = jnp.where(jnp.arange(top_k) < lengths[:, None, None], jnp.arange(top_k), -1)
        else:
            top = selection.top
        return out[:, 0].astype(q.dtype), lse[:, 0], top[:, 0]

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(_Q_SPEC, spec, _REPLICATED, _REPLICATED, index_spec, _REPLICATED),
                       out_specs=(_Q_SPEC, _LSE_SPEC, _REPLICATED), check_vma=False)
    return jax.jit(fn)


def dcp_sparse_decode_attention(q: jax.Array, cache: KVCache, index_q: jax.Array, index_weights: jax.Array,
                                index_cache: KVCache, lengths: jax.Array, mesh: Mesh, pc: ParallelConfig, *,
                                top_k: int, index_scale: float, sm_scale: float | None = None,
                                attention_backend: str = "auto"):
    """Decode attention over each sequence's top-k positions by the indexer (DeepSeek's DSA), exact
    under DCP (`dcpjax.sharding.sparse`).

    Args:
      q, cache, lengths: as `dcp_decode_attention`.
      index_q: [batch, index_heads, index_dim], the indexer's queries (replicated).
      index_weights: [batch, index_heads], each indexer head's weight.
      index_cache: the indexer's keys from `shard_kv_cache(keys [batch, seq, 1, index_dim], None,
        v_head_dim=index_dim, ...)` with the same block size, blocks and tables as `cache` (`cache`'s
        tables address both).
      top_k: positions each query attends to; index_scale: the indexer's q . k scale.
      attention_backend: "auto" | "pallas" | "reference" (`kernels.sparse.sparse_attention`).
    Returns out [batch, q_heads, dv] (q's dtype), lse [batch, q_heads] float32 and the selected
    positions [batch, top_k] int32, best first (ties: the lowest position), -1 where fewer exist; when no
    sequence can see more than top_k positions nothing is scored and they are every position in order.
    """
    check_mesh(mesh, pc)
    if q.ndim != 3 or q.shape[2] != cache.k.shape[3]:
        raise ValueError(f"q must be [batch, q_heads, {cache.k.shape[3]}], got {q.shape}")
    if index_q.ndim != 3 or index_q.shape[0] != q.shape[0] or index_q.shape[2] != index_cache.k.shape[3]:
        raise ValueError(f"index_q must be [batch={q.shape[0]}, index_heads, {index_cache.k.shape[3]}], "
                         f"got {index_q.shape}")
    if index_weights.shape != index_q.shape[:2]:
        raise ValueError(f"index_weights must be [batch, index_heads] = {list(index_q.shape[:2])}, "
                         f"got {list(index_weights.shape)}")
    if index_cache.block_size != cache.block_size or index_cache.k.shape[1] != cache.k.shape[1]:
        raise ValueError("index_cache must have the KV cache's blocks: pass the same block_size, block_tables "
                         "and num_blocks to shard_kv_cache")
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be a positive number of positions, got {top_k!r}")
    pc.validate(q.shape[1], cache.num_kv_heads, use_mla=cache.use_mla)
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths must be [batch={q.shape[0]}], got {lengths.shape}")
    check_attention_backend(attention_backend)
    options = AttentionOptions(None if sm_scale is None else float(sm_scale), attention_backend,
                               mesh.devices.flat[0].platform)
    fn = _sparse_decode_fn(mesh, pc, RULES.kv_cache_spec(cache), RULES.kv_cache_spec(index_cache), options,
                           int(top_k), float(index_scale))
    out, lse, top = fn(q, cache, index_q, jnp.asarray(index_weights, jnp.float32), index_cache, lengths)
    return out, lse, top
