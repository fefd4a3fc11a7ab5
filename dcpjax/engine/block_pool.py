"""KV blocks with automatic prefix caching (vLLM's APC), keyed by virtual block.

A block id names one physical block on every DCP rank; together those hold a *virtual*
block of `block_size * DCP` consecutive positions (`sharding.layout`). Prefix caching
therefore works in virtual blocks: keying per-rank blocks of `block_size` tokens would
match prefixes whose tokens sit on other ranks (the unit vLLM's DCP + APC bugs got wrong).

- A full virtual block, once its KV is computed and its tokens known on the host, is
  registered under the key (parent's key id, its token ids as bytes). The parent's key id
  chains in the whole prefix before it; the token ids are compared in full by the dict, so
  two different prefixes can never share a block (no hash collision by construction).
- Blocks are reference counted; a sequence that finds its prefix takes a reference on each
  block it reuses. Unreferenced blocks wait in a free queue, oldest first, still cached:
  allocation takes the oldest and evicts its key (least recently used). A sequence frees
  its blocks last first, so the end of a prefix is evicted before its start.
- A partly filled block is never registered, so never shared; a shared block is never
  written again (its owner and every reader only write past it).

Everything here is deterministic host bookkeeping: every process of a multi-host replica
makes the same decisions from the same requests.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as Seq

import numpy as np

ROOT = 0  # key id of the empty prefix: the parent of every first block


@dataclasses.dataclass
class PrefixCacheStats:
    """Tokens looked up and found, as vLLM counts them (every admission, recomputes included)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Physical block ids (each a block on every DCP rank), their references and the prefix cache.

    `num_free` counts every unreferenced block, cached or not: all can be allocated.
    """

    def __init__(self, num_blocks: int, *, virtual_block_size: int, enable_caching: bool = True):
        self.num_blocks, self.virtual_block_size = num_blocks, virtual_block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._block_of: dict[tuple[int, bytes], int] = {}  # key -> cached block
        self._key_of: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._key_id_of = [ROOT] * num_blocks  # the id its children chain to
        self._next_key_id = ROOT + 1
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (referenced or not)."""
        return len(self._block_of)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each; evicts the least recently freed cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Seq[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the free queue, last block first."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            if self.ref_counts[block] == 0:
                self._free[block] = None

    # -- prefix cache --------------------------------------------------------------------------
    def _key(self, parent: int, tokens: Seq[int]) -> tuple[int, bytes]:
        return parent, np.asarray(tokens, np.int32).tobytes()

    def lookup(self, token_ids: Seq[int], max_tokens: int) -> tuple[list[int], int]:
        """The cached blocks of the longest prefix of `token_ids` in whole virtual blocks, at most
        `max_tokens` long, and the key id to chain the next block to. Takes no reference."""
        size, blocks, parent = self.virtual_block_size, [], ROOT
        if not self.enable_caching:
            return blocks, parent
        for start in range(0, max_tokens - size + 1, size):
            block = self._block_of.get(self._key(parent, token_ids[start : start + size]))
            if block is None:
                break
            blocks.append(block)
            parent = self._key_id_of[block]
        return blocks, parent

    def num_unreferenced(self, blocks: Seq[int]) -> int:
        """How many of `blocks` sit in the free queue (sharing them takes them out of it)."""
        return sum(self.ref_counts[b] == 0 for b in blocks)

    def share(self, blocks: Seq[int]) -> None:
        """Take a reference on each cached block a sequence reuses."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def register(self, block: int, parent: int, tokens: Seq[int]) -> int:
        """Cache full block `block` (its KV computed) holding `tokens` after the prefix `parent`;
        returns the key id its successor chains to. If that prefix is cached already (two
        sequences computed it side by side), the cached block stays and this one is not shared."""
        if not self.enable_caching:
            return ROOT
        key = self._key(parent, tokens)
        cached = self._block_of.get(key)
        if cached is not None:
            return self._key_id_of[cached]
        if self._key_of[block] is not None:
            raise RuntimeError(f"KV block {block} is cached already under another prefix")
        self._block_of[key], self._key_of[block] = block, key
        self._key_id_of[block], self._next_key_id = self._next_key_id, self._next_key_id + 1
        return self._key_id_of[block]

    def _forget(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._block_of[key]
            self._key_of[block], self._key_id_of[block] = None, ROOT

    def reset(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`); False, changing nothing,
        while any block is still referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in range(self.num_blocks):
            self._forget(block)
        return True
