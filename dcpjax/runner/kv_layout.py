"""The paged KV pools' shape: blocks, heads as stored, widths and dtype, and how many blocks fit a
byte budget. Plain arithmetic over the model config (no flax), so the planner sizes a cache the
way the engine does."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dcpjax.kernels.kv_cache import FP8
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import kv_head_slots


@dataclasses.dataclass
class KVCacheLayout:
    """Sizes of the paged KV pools (per layer, per DCP rank)."""

    num_blocks: int  # physical blocks per rank; block ids are shared by all ranks
    block_size: int
    kv_slots: int  # KV heads as stored (repeated over "tp" groups when needed)
    pool_dims: tuple[int, ...]  # last dim of each pool of a layer: (dk, dv), (latent,) for MLA
    dtype: jnp.dtype  # float8_e4m3fn: quantised, with a float32 scale per token and head
    # the `KVPools` field of each pool: ("k", "v"), MLA ("k",), MLA with DSA's indexer keys ("k", "index_k")
    pool_names: tuple[str, ...] = ("k", "v")

    @property
    def quantized(self) -> bool:
        return jnp.dtype(self.dtype) == FP8

    def share_of(self, field: str) -> float:
        """The part of a stored token's bytes in pool `field` (0 for a pool this cache has not)."""
        if field not in self.pool_names:
            return 0.0
        per_pool = [d * jnp.dtype(self.dtype).itemsize + (4 if self.quantized else 0) for d in self.pool_dims]
        return per_pool[self.pool_names.index(field)] / sum(per_pool)

    def bytes_per_block_per_device(self, num_layers: int, tp_groups: int) -> int:
        local_heads = self.kv_slots // tp_groups
        per_token_head = (sum(self.pool_dims) * jnp.dtype(self.dtype).itemsize
                          + (4 * len(self.pool_dims) if self.quantized else 0))
        return num_layers * self.block_size * local_heads * per_token_head


def kv_block_layout(cfg: ModelConfig, pc: ParallelConfig, *, block_size: int, dtype) -> KVCacheLayout:
    """The shape of one model's KV blocks (num_blocks still 0)."""
    if cfg.use_mla and cfg.use_sparse_attention:  # and one indexer key per token beside it
        slots, dims, fields = kv_head_slots(1, pc), (cfg.latent_dim, cfg.index_head_dim), ("k", "index_k")
    elif cfg.use_mla:  # one latent per token: the compressed KV and the shared rotary key
        slots, dims, fields = kv_head_slots(1, pc), (cfg.latent_dim,), ("k",)
    else:
        slots, dims, fields = kv_head_slots(cfg.num_key_value_heads, pc), (cfg.head_dim, cfg.head_dim), ("k", "v")
    return KVCacheLayout(0, block_size, slots, dims, jnp.dtype(dtype), fields)


def kv_cache_layout(cfg: ModelConfig, pc: ParallelConfig, *, block_size: int, bytes_per_device: int,
                    dtype, extra_bytes_per_block: int = 0) -> KVCacheLayout:
    """Blocks that fit `bytes_per_device` of KV on each device (`extra_bytes_per_block`: what
    another cache with the same block ids, a draft model's, takes per block). A block id holds the
    layers of one KV cache group (`models.kv_groups`: all KV layers without sliding windows)."""
    layout = kv_block_layout(cfg, pc, block_size=block_size, dtype=dtype)
    per_block = layout.bytes_per_block_per_device(KVCacheGroups.of(cfg).size, pc.kv_head_groups) + extra_bytes_per_block
    layout.num_blocks = int(bytes_per_device // per_block)
    if layout.num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={bytes_per_device} holds no block ({per_block} bytes per block "
                         f"per device) — raise it (--kv-cache-memory-bytes {per_block} or more)")
    return layout
