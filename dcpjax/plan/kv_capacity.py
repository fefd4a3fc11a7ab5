"""What a KV cache of a given size holds, for a model's KV cache
groups (`models.kv_groups`): without sliding windows every block holds every KV layer's tokens;
with them a block holds one group's layers, full groups keep every token and sliding groups their
window (and the chunk being computed). The engine sizes its cache with the same arithmetic
(`runner.kv_budget`)."""

from __future__ import annotations

import dataclasses

from dcpjax.engine.args import EngineArgs
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.runner.kv_budget import kv_cache_tokens

# tokens a step computes (the engine's default max_num_batched_tokens): a sequence's sliding-window
# groups hold their window and one such chunk
PLAN_CHUNK = EngineArgs.max_num_batched_tokens


@dataclasses.dataclass(frozen=True)
class KVCapacity:
    """tokens: the cache's size (the longest one sequence with sliding groups); fit: sequences of
    `per_seq` tokens held at once; bytes_per_token: what one more token of context costs a device
    (the full layers'); bytes_per_layer_token: one layer's one token on a device."""

    tokens: int
    fit: int
    bytes_per_token: float
    bytes_per_layer_token: float


def kv_capacity(cfg: ModelConfig, num_blocks: int, per_block: int, block_size: int, dcp: int,
                per_seq: int) -> KVCapacity:
    """The capacity of `num_blocks` blocks of `per_block` bytes per device (`block_size` tokens per
    DCP rank) for sequences of `per_seq` tokens."""
    groups = KVCacheGroups.of(cfg)
    per_layer_token = per_block / groups.size / block_size / dcp
    tokens = kv_cache_tokens(cfg, num_blocks, block_size, dcp, PLAN_CHUNK)
    if not groups.sliding:
        return KVCapacity(tokens, tokens // per_seq, per_layer_token * groups.size, per_layer_token)
    fit = (num_blocks - groups.reserved_blocks) // groups.blocks_for(per_seq, block_size * dcp, PLAN_CHUNK)
    return KVCapacity(tokens, fit, per_layer_token * groups.full_layers, per_layer_token)
