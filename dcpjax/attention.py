"""DCP decode attention on a ("tp", "dcp") mesh: the public op for notebooks and tests.

KV is split by head over "tp" (the TP // DCP KV-head groups) and by interleaved
token position over "dcp". One decode step, per device (DESIGN.md):
  1. q: this device's q_heads / TP heads;
  2. all_gather q over "dcp" -> the q_heads / (TP/DCP) heads of its KV group;
  3. attention over the tokens this rank owns -> partial out + LSE (float32);
  4. LSE merge over "dcp" (ag_rs or a2a) -> this device's own heads, exact.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax.config import ParallelConfig
from dcpjax.kernels.dispatch import check_attention_backend
from dcpjax.sharding import layout
from dcpjax.sharding.local_ops import dcp_attention, owned_slots, write_tokens
from dcpjax.sharding.mesh import check_mesh, logical_spec


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "block_tables"],
    meta_fields=["num_kv_heads", "v_head_dim", "capacity", "block_size"],
)
@dataclasses.dataclass(frozen=True)
class DCPKVCache:
    """A KV cache laid out over the ("tp", "dcp") mesh.

    Contiguous (block_size None):
      k [batch, DCP * local_capacity, kv_slots, dk], sharded P(None, "dcp", "tp", None):
      rank d's block of the token axis holds, at local index j, the token at
      `layout.global_position(j, d, DCP, I)`.
    Paged (block_size set):
      k [DCP * num_blocks, block_size, kv_slots, dk], sharded P("dcp", None, "tp", None):
      each rank has its own pool of num_blocks; `block_tables` [batch, max_blocks]
      (replicated) is shared by all ranks (vLLM's virtual block of block_size * DCP).
    v: like k with dv, or None for MLA's latent form (V = K[..., :v_head_dim]).
    kv_slots = max(num_kv_heads, TP // DCP): KV heads are repeated when the "tp"
    axis has more groups than heads, so each group holds the head its q heads use.
    """

    k: jax.Array
    v: jax.Array | None
    block_tables: jax.Array | None
    num_kv_heads: int
    v_head_dim: int
    capacity: int
    block_size: int | None = None

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def use_mla(self) -> bool:
        return self.v is None

    def bytes_per_device(self) -> int:
        """KV bytes one device holds (its shard of k and v)."""
        arrays = [self.k] if self.v is None else [self.k, self.v]
        return sum(a.addressable_shards[0].data.nbytes for a in arrays)


# -- specs ------------------------------------------------------------------
def _kv_spec(paged: bool) -> PartitionSpec:
    if paged:
        return logical_spec("kv_pages", None, "kv_heads", None)
    return logical_spec("batch", "kv_tokens", "kv_heads", None)


_Q_SPEC = logical_spec("batch", "q_heads", None)  # [B, Hq, d] and [B, Hq] prefixes
_LSE_SPEC = logical_spec("batch", "q_heads")
_NEW_KV_SPEC = logical_spec("batch", "kv_heads", None)
_REPLICATED = PartitionSpec()


def _kv_slots(num_kv_heads: int, pc: ParallelConfig) -> int:
    groups = pc.kv_head_groups
    if not (num_kv_heads % groups == 0 or groups % num_kv_heads == 0):
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be split over the TP // DCP = {groups} KV head groups: "
            f"need num_kv_heads % {groups} == 0 or {groups} % num_kv_heads == 0."
        )
    return max(num_kv_heads, groups)


def _expand_heads(x, num_kv_heads: int, pc: ParallelConfig, axis: int):
    """Repeat KV heads (numpy or jax array) so each "tp" group gets the head its q heads read."""
    repeats = _kv_slots(num_kv_heads, pc) // num_kv_heads
    xp = np if isinstance(x, np.ndarray) else jnp
    return x if repeats == 1 else xp.repeat(x, repeats, axis=axis)


# -- building a cache -----------------------------------------------------------
# Built in host numpy, then each device receives only its own shard: no device
# ever holds the whole unsplit cache.
def _interleaved_local(x: np.ndarray, capacity: int, pc: ParallelConfig) -> np.ndarray:
    """[B, S, H, d] token order -> [B, DCP, local_capacity, H, d], zeros past S."""
    batch, seq = x.shape[:2]
    local_cap = layout.local_capacity(capacity, pc.dcp, pc.interleave)
    positions = np.asarray(layout.global_position(
        np.arange(local_cap)[None, :], np.arange(pc.dcp)[:, None], pc.dcp, pc.interleave
    ))  # [DCP, local_cap]
    padded = np.zeros((batch, int(positions.max()) + 1, *x.shape[2:]), x.dtype)
    padded[:, :seq] = x
    return padded[:, positions.reshape(-1)].reshape(batch, pc.dcp, local_cap, *x.shape[2:])


def _to_pages(local: np.ndarray, block_tables: np.ndarray, num_blocks: int, block_size: int) -> np.ndarray:
    """[B, DCP, local_cap, H, d] -> per-rank pools [DCP * num_blocks, block_size, H, d]."""
    batch, dcp, local_cap = local.shape[:3]
    blocks_per_seq = local_cap // block_size
    pools = np.zeros((dcp, num_blocks, block_size, *local.shape[3:]), local.dtype)
    chunks = local.reshape(batch, dcp, blocks_per_seq, block_size, *local.shape[3:])
    pools[:, block_tables[:, :blocks_per_seq]] = np.moveaxis(chunks, 1, 0)  # [DCP, B, blocks, bs, H, d]
    return pools.reshape(dcp * num_blocks, block_size, *local.shape[3:])


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
) -> DCPKVCache:
    """Lay out a KV cache over the mesh: KV heads over "tp", interleaved tokens over "dcp".

    Args:
      k: [batch, seq, kv_heads, dk] in token order (any seq, 0 included).
      v: [batch, seq, kv_heads, dv], or None for MLA's latent form (pass `v_head_dim`).
      capacity: tokens per sequence the cache can hold (default seq); room to append.
      block_size: paged layout with this many tokens per block and rank.
      block_tables: [batch, max_blocks] physical blocks per sequence (paged; default
        sequential). Every entry a sequence needs must be a distinct block < num_blocks.
      num_blocks: blocks per rank in the pool (default: 1 + max(block_tables)).
    """
    check_mesh(mesh, pc)
    if k.ndim != 4:
        raise ValueError(f"k must be [batch, seq, kv_heads, head_dim], got shape {k.shape}")
    batch, seq, num_kv_heads, dk = k.shape
    if v is None:
        if v_head_dim is None or not 0 < v_head_dim <= dk:
            raise ValueError(f"v=None is MLA's latent form: pass 0 < v_head_dim <= {dk}, got {v_head_dim}")
    elif v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must match k {k.shape} except in the last dimension")
    else:
        v_head_dim = v.shape[3]
    capacity = seq if capacity is None else capacity
    if capacity < max(seq, 1):
        raise ValueError(f"capacity ({capacity}) must be >= 1 and >= the tokens given ({seq})")

    if block_size is not None:
        layout.check_block_size(block_size, pc.interleave)
        blocks_per_seq = layout.blocks_needed(capacity, block_size, pc.dcp)
        capacity = blocks_per_seq * layout.virtual_block_size(block_size, pc.dcp)
        if block_tables is None:
            block_tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
        block_tables = np.asarray(block_tables, np.int32)
        if block_tables.shape[0] != batch or block_tables.shape[1] < blocks_per_seq:
            raise ValueError(f"block_tables must be [batch={batch}, >= {blocks_per_seq}], got {block_tables.shape}")
        needed = block_tables[:, :blocks_per_seq]
        num_blocks = int(needed.max()) + 1 if num_blocks is None else num_blocks
        if int(needed.min()) < 0 or int(needed.max()) >= num_blocks or len(set(needed.ravel().tolist())) != needed.size:
            raise ValueError(f"block_tables entries in use must be distinct blocks in [0, {num_blocks})")

    sharding = NamedSharding(mesh, _kv_spec(block_size is not None))

    def place(x):
        x = _expand_heads(np.asarray(x), num_kv_heads, pc, axis=2)
        local = _interleaved_local(x, capacity, pc)
        if block_size is None:
            arranged = local.reshape(batch, pc.dcp * local.shape[2], *local.shape[3:])
        else:
            arranged = _to_pages(local, block_tables, num_blocks, block_size)
        return jax.make_array_from_callback(arranged.shape, sharding, lambda index: arranged[index])

    return DCPKVCache(
        k=place(k),
        v=None if v is None else place(v),
        block_tables=None if block_size is None else jax.device_put(jnp.asarray(block_tables), NamedSharding(mesh, _REPLICATED)),
        num_kv_heads=num_kv_heads,
        v_head_dim=v_head_dim,
        capacity=capacity,
        block_size=block_size,
    )


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
) -> DCPKVCache:
    """An all-zero cache to fill with `append_kv` (lengths start at 0)."""
    k = jnp.zeros((batch, 0, num_kv_heads, head_dim), dtype)
    v = None if use_mla else jnp.zeros((batch, 0, num_kv_heads, v_head_dim or head_dim), dtype)
    return shard_kv_cache(
        k, v, mesh, pc, capacity=capacity, block_size=block_size, v_head_dim=v_head_dim if use_mla else None
    )


# -- appending one token ----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _append_fn(mesh: Mesh, pc: ParallelConfig, paged: bool, block_size: int | None, has_v: bool):
    def body(k, v, tables, k_new, v_new, positions):
        slots = owned_slots(positions, pc, block_tables=tables, block_size=block_size)
        k = write_tokens(k, k_new, slots, paged)
        v = write_tokens(v, v_new, slots, paged) if has_v else v
        return k, v

    kv_spec = _kv_spec(paged)
    v_spec = kv_spec if has_v else None
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(kv_spec, v_spec, _REPLICATED, _NEW_KV_SPEC, _NEW_KV_SPEC if has_v else None, _REPLICATED),
        out_specs=(kv_spec, v_spec),
        check_vma=False,
    )
    return jax.jit(fn)


def append_kv(
    cache: DCPKVCache,
    k_new: jax.Array,
    v_new: jax.Array | None,
    positions: jax.Array,
    mesh: Mesh,
    pc: ParallelConfig,
) -> DCPKVCache:
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
    fn = _append_fn(mesh, pc, cache.paged, cache.block_size, not cache.use_mla)
    k, v = fn(cache.k, cache.v, cache.block_tables, k_new, v_new, positions)
    return dataclasses.replace(cache, k=k, v=v)


# -- decode attention -----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _decode_fn(
    mesh: Mesh, pc: ParallelConfig, paged: bool, has_v: bool, v_head_dim: int,
    sm_scale: float | None, attention_backend: str,
):
    def body(q, k, v, tables, lengths):
        out, lse = dcp_attention(
            q[:, None], k, v, lengths[:, None], pc, block_tables=tables, sm_scale=sm_scale,
            v_head_dim=v_head_dim, attention_backend=attention_backend, platform=mesh.devices.flat[0].platform,
        )
        return out[:, 0].astype(q.dtype), lse[:, 0]

    kv_spec = _kv_spec(paged)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(_Q_SPEC, kv_spec, kv_spec if has_v else None, _REPLICATED if paged else None, _REPLICATED),
        out_specs=(_Q_SPEC, _LSE_SPEC),
        check_vma=False,  # Pallas calls inside shard_map
    )
    return jax.jit(fn)


def dcp_decode_attention(
    q: jax.Array,
    cache: DCPKVCache,
    lengths: jax.Array,
    mesh: Mesh,
    pc: ParallelConfig,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    attention_backend: str = "auto",
):
    """Decode attention of one new query per sequence over a DCP-sharded cache.

    Args:
      q: [batch, q_heads, dk]; sharded (or shardable) P(None, ("tp", "dcp"), None).
      cache: from `shard_kv_cache` / `empty_kv_cache` on the same mesh and config.
      lengths: [batch] int, valid tokens per sequence (<= cache.capacity).
      sm_scale: softmax scale (default 1/sqrt(dk)).
      return_lse: also return the LSE.
      attention_backend: "auto" | "pallas" | "reference".
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
    fn = _decode_fn(
        mesh, pc, cache.paged, not cache.use_mla, cache.v_head_dim,
        None if sm_scale is None else float(sm_scale), attention_backend,
    )
    out, lse = fn(q, cache.k, cache.v, cache.block_tables, lengths)
    return (out, lse) if return_lse else out
