"""KV blocks with automatic prefix caching (vLLM's APC), keyed by virtual block, for every KV
cache group (`models.kv_groups`).

A block id names one physical block on every DCP rank; together those hold a *virtual*
block of `block_size * DCP` consecutive positions (`sharding.layout`). Prefix caching
therefore works in virtual blocks: keying per-rank blocks of `block_size` tokens would
match prefixes whose tokens sit on other ranks (the unit vLLM's DCP + APC bugs got wrong).

- Prefixes have ids (`PrefixTable`): the prefix of j + 1 virtual blocks is (the id of its first
  j, the last block's token ids as bytes). The token ids are compared in full by the dict, so two
  different prefixes never share an id (no hash collision by construction). Ids live apart from
  blocks: a sliding group's window can be found after the blocks at the start of its prefix were
  evicted. An id is kept while a cached block, a longer prefix or a sequence refers to it.
- A full virtual block of group g, once its KV is computed and its tokens known on the host, is
  cached under (g, its prefix id).
- Blocks are reference counted; a sequence that finds its prefix takes a reference on each
  block it reuses. Unreferenced blocks wait in a free queue, oldest first, still cached:
  allocation takes the oldest and evicts its key (least recently used). A sequence frees
  its blocks last first, so the end of a prefix is evicted before its start.
- A partly filled block is never registered, so never shared; a shared block is never
  written again (its owner and every reader only write past it).
- With sliding groups, block `NULL_BLOCK` is reserved: the table entry of a block behind a
  window. A hit needs every full group's blocks of the prefix and each sliding group's blocks of
  the window before its end (vLLM's hybrid lookup); the earlier ones are left null.

Everything here is deterministic host bookkeeping: every process of a multi-host replica
makes the same decisions from the same requests.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as Seq

import numpy as np

from dcpjax.models.kv_groups import NULL_BLOCK

ROOT = 0  # id of the empty prefix: the parent of every first block; never released


@dataclasses.dataclass
class PrefixCacheStats:
    """Tokens looked up and found, as vLLM counts them (every admission, recomputes included)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixTable:
    """Prefix ids: (parent id, a virtual block's token bytes) -> id, reference counted (see the
    module docstring). Ids only grow, so a forgotten id is never confused with a new one."""

    def __init__(self):
        self._id_of: dict[tuple[int, bytes], int] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}
        self._refs: dict[int, int] = {}
        self._next = ROOT + 1

    def __len__(self) -> int:
        return len(self._id_of)

    def find(self, parent: int, key: bytes) -> int | None:
        return self._id_of.get((parent, key))

    def child(self, parent: int, key: bytes) -> int:
        """The id of `parent` + one block (made if new, holding a reference on its parent); takes
        no reference on it."""
        found = self._id_of.get((parent, key))
        if found is not None:
            return found
        new, self._next = self._next, self._next + 1
        self._id_of[(parent, key)], self._key_of[new], self._refs[new] = new, (parent, key), 0
        self.retain(parent)
        return new

    def retain(self, prefix: int) -> None:
        if prefix != ROOT:
            self._refs[prefix] += 1

    def release(self, prefix: int) -> None:
        """Drop one reference; an id nothing refers to is forgotten (and its parent released)."""
        while prefix != ROOT:
            self._refs[prefix] -= 1
            if self._refs[prefix] > 0:
                return
            if self._refs[prefix] < 0:
                raise RuntimeError(f"prefix id {prefix} released more often than retained")
            parent, key = self._key_of.pop(prefix)
            del self._id_of[(parent, key)], self._refs[prefix]
            prefix = parent

    def clear(self) -> None:
        self._id_of.clear(), self._key_of.clear(), self._refs.clear()


class BlockPool:
    """Physical block ids (each a block on every DCP rank), their references and the prefix cache
    of every KV cache group (`windows`: per group its sliding window, None for full attention).

    `num_free` counts every unreferenced block, cached or not: all can be allocated.
    """

    def __init__(self, num_blocks: int, *, virtual_block_size: int, enable_caching: bool = True,
                 windows: Seq[int | None] = (None,)):
        self.num_blocks, self.virtual_block_size = num_blocks, virtual_block_size
        self.enable_caching, self.windows = enable_caching, tuple(windows)
        self.reserved = 1 if any(w is not None for w in self.windows) else 0  # `KVCacheGroups.reserved_blocks`
        if num_blocks <= self.reserved:
            raise ValueError(f"a KV cache of {num_blocks} block(s) holds nothing: raise kv_cache_memory_bytes")
        self.ref_counts = [0] * num_blocks
        first = self.reserved  # NULL_BLOCK == 0 is never handed out
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(first, num_blocks))
        self._block_of: dict[tuple[int, int], int] = {}  # (group, prefix id) -> cached block
        self._key_of: list[tuple[int, int] | None] = [None] * num_blocks
        self.prefixes = PrefixTable()
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_usable(self) -> int:
        """Blocks that can be allocated (all but the null block)."""
        return self.num_blocks - self.reserved

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
        """Drop one reference on each block (null entries skipped); unreferenced ones join the free
        queue, last block first."""
        for block in reversed(blocks):
            if self.reserved and block == NULL_BLOCK:
                continue
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            if self.ref_counts[block] == 0:
                self._free[block] = None

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def _key(tokens: Seq[int]) -> bytes:
        return np.asarray(tokens, np.int32).tobytes()

    def lookup(self, token_ids: Seq[int], max_tokens: int) -> tuple[list[list[int]], int]:
        """The cached blocks of the longest prefix of `token_ids` in whole virtual blocks, at most
        `max_tokens` long, that every group can serve: per group a list of m blocks (a sliding
        group's entries before its window `NULL_BLOCK`), and the prefix id the next block chains
        to. Takes no reference."""
        size, ids, parent = self.virtual_block_size, [], ROOT
        empty = [[] for _ in self.windows]
        if not self.enable_caching:
            return empty, ROOT
        for start in range(0, max_tokens - size + 1, size):
            found = self.prefixes.find(parent, self._key(token_ids[start : start + size]))
            if found is None:
                break
            ids.append(parent := found)
        m = 0  # every full group's blocks of the first m
        while m < len(ids) and all(self._block_of.get((g, ids[m])) is not None
                                   for g, w in enumerate(self.windows) if w is None):
            m += 1
        if all(w is None for w in self.windows):
            hits = [[self._block_of[(g, i)] for i in ids[:m]] for g in range(self.num_groups)]
            return hits, ids[m - 1] if m else ROOT
        for length in range(m, 0, -1):  # the longest whose windows are cached too
            hits = self._window_hits(ids, length)
            if hits is not None:
                return hits, ids[length - 1]
        return empty, ROOT

    def _window_hits(self, ids: list[int], m: int) -> list[list[int]] | None:
        """Each group's blocks for a hit of m virtual blocks, or None if a sliding group lacks one of
        the window's (the positions m * size - W + 1 .. m * size - 1 that the next query sees)."""
        hits = []
        for g, window in enumerate(self.windows):
            first = 0 if window is None else max(m * self.virtual_block_size + 1 - window, 0) // self.virtual_block_size
            blocks = [NULL_BLOCK] * first
            for i in ids[first:m]:
                block = self._block_of.get((g, i))
                if block is None:
                    return None
                blocks.append(block)
            hits.append(blocks)
        return hits

    def num_unreferenced(self, blocks: Seq[int]) -> int:
        """How many of `blocks` sit in the free queue (sharing them takes them out of it)."""
        return sum(self.ref_counts[b] == 0 for b in blocks if not (self.reserved and b == NULL_BLOCK))

    def share(self, blocks: Seq[int]) -> None:
        """Take a reference on each cached block a sequence reuses (null entries skipped)."""
        for block in blocks:
            if self.reserved and block == NULL_BLOCK:
                continue
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def register(self, blocks: Seq[int], parent: int, tokens: Seq[int]) -> int:
        """Cache full virtual block `blocks` (one per group, its KV computed; null entries skipped)
        holding `tokens` after the prefix `parent`; returns the prefix id its successor chains to.
        The caller's reference on `parent` moves to the returned id. If a group's block of that
        prefix is cached already (two sequences computed it side by side), the cached block stays
        and this one is not shared."""
        if not self.enable_caching:
            return ROOT
        prefix = self.prefixes.child(parent, self._key(tokens))
        self.prefixes.retain(prefix)
        self.prefixes.release(parent)
        for group, block in enumerate(blocks):
            if (self.reserved and block == NULL_BLOCK) or (group, prefix) in self._block_of:
                continue
            if self._key_of[block] is not None:
                raise RuntimeError(f"KV block {block} is cached already under another prefix")
            self._block_of[(group, prefix)], self._key_of[block] = block, (group, prefix)
            self.prefixes.retain(prefix)
        return prefix

    def retain(self, prefix: int) -> None:
        """A sequence takes a reference on the prefix id it chains to (`lookup`'s)."""
        self.prefixes.retain(prefix)

    def release(self, prefix: int) -> None:
        """A sequence lets go of the prefix id it chained to."""
        if self.enable_caching:
            self.prefixes.release(prefix)

    def _forget(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._block_of[key]
            self._key_of[block] = None
            self.prefixes.release(key[1])

    def reset(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`); False, changing nothing,
        while any block is still referenced."""
        if len(self._free) != self.num_usable:
            return False
        for block in range(self.num_blocks):
            self._forget(block)
        self.prefixes.clear()
        return True
