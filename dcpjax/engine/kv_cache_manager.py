"""A sequence's KV blocks in every KV cache group (vLLM's KVCacheManager): the block pool and its
prefix cache (`block_pool`), the host copy of every running sequence's block tables, growing a
sequence's blocks for a step, freeing what a sliding-window group's window left behind
(`models.kv_groups`), registering full blocks and taking a cached prefix. The scheduler decides who
runs and who is preempted; this module only keeps the blocks.

A sequence's `blocks` is one list per group, all of one length (the virtual blocks it reaches); a
sliding group's entries behind its window are `NULL_BLOCK`. Blocks are freed before each step's
are allocated, so what a window left behind is free for the step's other rows; a step in flight
that still reads or writes a freed block runs before any step that reuses it (each step takes
the caches the one before returned).
"""

from __future__ import annotations

import numpy as np

from dcpjax.engine.block_pool import ROOT, BlockPool, PrefixCacheStats
from dcpjax.engine.config import SchedulerConfig
from dcpjax.models.kv_groups import NULL_BLOCK, KVCacheGroups
from dcpjax.sequence import Sequence
from dcpjax.sharding import layout


class KVCacheManager:
    """Blocks, block tables and the prefix cache of one engine (see the module docstring).

    `block_tables` [max_num_seqs, groups, blocks_per_seq]: every running sequence's tables, by slot,
    so a step's tables are one numpy gather.
    """

    def __init__(self, num_blocks: int, config: SchedulerConfig, *, dcp: int, groups: KVCacheGroups | None = None):
        self.block_size, self.dcp = config.block_size, dcp
        self.blocks_per_seq = layout.blocks_needed(config.max_model_len, config.block_size, dcp)
        self.virtual_block_size = layout.virtual_block_size(config.block_size, dcp)
        self.groups = groups if groups is not None else KVCacheGroups.full_attention()
        self.num_groups = self.groups.num_groups
        self.pool = BlockPool(num_blocks, virtual_block_size=self.virtual_block_size,
                              enable_caching=config.enable_prefix_caching, windows=self.groups.windows)
        self.block_tables = np.zeros((config.max_num_seqs, self.num_groups, self.blocks_per_seq), np.int32)
        self.num_dead_blocks_freed = 0  # sliding groups' blocks freed behind their windows, in all

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def grow(self, seq: Sequence, tokens: int, first_query: int | None = None) -> bool:
        """Blocks for `tokens` positions in every group, after the sliding groups free what queries
        from `first_query` (default: the next position to compute) no longer see; a sliding group's
        new entries behind that window are null, not allocated. False (nothing taken) if not free."""
        first_query = seq.num_computed if first_query is None else first_query
        self.free_dead_blocks(seq, first_query)
        have = len(seq.blocks[0]) if seq.blocks else 0
        need = layout.blocks_needed(tokens, self.block_size, self.dcp)
        if need <= have:
            return True
        starts = [max(have, min(self.groups.first_needed_block(g, first_query, self.virtual_block_size), need))
                  for g in range(self.num_groups)]
        if sum(need - start for start in starts) > self.pool.num_free:
            return False
        if not seq.blocks:
            seq.blocks = [[] for _ in range(self.num_groups)]
        for g, (blocks, start) in enumerate(zip(seq.blocks, starts)):
            new = [NULL_BLOCK] * (start - have) + self.pool.allocate(need - start)
            self.block_tables[seq.slot, g, have:need] = new
            blocks += new
        return True

    def free_dead_blocks(self, seq: Sequence, first_query: int) -> None:
        """Each sliding group's blocks wholly behind the window of a query at `first_query` go back
        to the pool (cached, if registered); their entries become `NULL_BLOCK`. Leading entries are
        null already, so the walk back stops at the first null one."""
        if not self.groups.sliding or not seq.blocks:
            return
        size = self.virtual_block_size
        for g, blocks in enumerate(seq.blocks):
            j = min(self.groups.first_needed_block(g, first_query, size), len(blocks)) - 1
            dead = []
            while j >= 0 and blocks[j] != NULL_BLOCK:
                dead.append(blocks[j])
                blocks[j] = NULL_BLOCK
                j -= 1
            if dead:
                self.block_tables[seq.slot, g, j + 1 : j + 1 + len(dead)] = NULL_BLOCK
                self.pool.free(dead[::-1])
                self.num_dead_blocks_freed += len(dead)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose KV is computed and whose tokens the host knows."""
        size = self.virtual_block_size
        full = min(seq.num_computed, seq.length) // size
        for j in range(seq.num_hashed_blocks, full):
            tokens = seq.token_ids[j * size : (j + 1) * size]
            blocks = [b[j] if j >= seq.sliding_cache_from or w is None else NULL_BLOCK
                      for b, w in zip(seq.blocks, self.groups.windows)]
            seq.prefix_key = self.pool.register(blocks, seq.prefix_key, tokens)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def take_cached_prefix(self, seq: Sequence, budget: int) -> int | None:
        """For a sequence leaving the queue: take the cached blocks of its prefix; returns how many
        tokens to compute now, or None (nothing taken) if the blocks for them are not free."""
        # prompt logprobs need every prompt position computed: such requests skip the lookup
        wanted = 0 if seq.needs_prompt_logprobs else seq.num_tokens - 1
        hits, key = self.pool.lookup(seq.token_ids, wanted)
        found = len(hits[0])
        cached = found * self.virtual_block_size
        want = min(seq.num_tokens - cached, budget)
        extra = (layout.blocks_needed(cached + want, self.block_size, self.dcp) - found) * self.num_groups
        taken = sum(self.pool.num_unreferenced(blocks) for blocks in hits)
        if extra + taken > self.pool.num_free:
            return None
        for g, blocks in enumerate(hits):
            self.pool.share(blocks)
            self.block_tables[seq.slot, g, :found] = blocks
        self.pool.retain(key)
        seq.blocks, seq.num_computed = hits, cached
        seq.num_hashed_blocks, seq.prefix_key = found, key
        if self.pool.enable_caching:
            stats = self.pool.stats
            stats.queries, stats.hits = stats.queries + seq.num_tokens, stats.hits + cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
        return want

    def blocks_for_load(self, seq: Sequence) -> bool:
        """Blocks for a sequence whose prompt's KV comes from elsewhere (its first token appended): a
        sliding group gets only the window of its first query, its first generated token
        (`kv_transfer.device_io` drops what lands behind it); False if they are not free (nothing taken).

        The first block of that window may hold positions the producer had freed already (its own
        windows moved on in its own blocks): the sequence itself never attends to them, but another
        one taking the block from the prefix cache could, so sliding blocks from that one on only are
        registered (`Sequence.sliding_cache_from`)."""
        seq.blocks, seq.num_computed, seq.num_hashed_blocks, seq.prefix_key = [], 0, 0, ROOT
        first_query = seq.num_tokens - 1
        if not self.grow(seq, seq.num_tokens, first_query):
            return False
        seq.sliding_cache_from = 1 + max(self.groups.first_needed_block(g, first_query, self.virtual_block_size)
                                         for g in range(self.num_groups))
        return True

    def release(self, seq: Sequence) -> None:
        """Every block of `seq` and its prefix id back; full groups' last (the LRU queue evicts them
        last: every prefix hit needs them, a sliding group only its window's)."""
        for blocks in reversed(seq.blocks):  # full groups come first (`models.kv_groups`)
            self.pool.free(blocks)
        self.pool.release(seq.prefix_key)
        seq.blocks, seq.num_hashed_blocks, seq.prefix_key, seq.sliding_cache_from = [], 0, ROOT, 0
