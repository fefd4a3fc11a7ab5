"""KV cache groups: how a model with sliding-window layers shares its paged pools (vLLM's hybrid
KV cache manager), so that a sliding layer holds only the blocks its window still reaches.

The KV layers are cut into groups of equal size, each group of one attention kind (full, or a
sliding window W): `size` = the gcd of the kinds' layer counts. Gemma 3 270M, 3 full and 15
sliding layers: one full group and five sliding groups of 3 layers. Layer slot j of every group
shares pool tensor j, and each group has its own block table: a block id allocated to group g
holds the KV of g's layers only. So one `BlockPool` serves every group, a block costs `size`
layers' bytes, and memory moves freely between full and sliding groups as the batch changes
(a pool per kind would have to be split at start-up).

A sliding group frees the virtual blocks behind its window as a sequence advances: a query at
position p attends to [p + 1 - W, p], so once the next position to compute is n, blocks wholly
before n + 1 - W are dead and their table entries point at the null block (`NULL_BLOCK`, never
allocated, only ever read under a mask). A model without sliding layers has one group of all
its KV layers: exactly the cache it had before groups.

The runner's cache tuple (`cache_index`): one entry per "owner" layer, in layer order: every
linear-attention layer (its state) and every layer of group 0 (its pools); a layer of another
group uses the pools of the group-0 layer at its slot. Without sliding layers every layer is its
own owner, so the tuple is indexed by layer as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dcpjax.models.config import ModelConfig

NULL_BLOCK = 0  # a sliding group's table entry behind the window (reserved: never allocated)


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """The KV layers of one model in groups (see the module docstring).

    layers: per group, its layer indices (ascending); windows: per group, its sliding window (None:
    full attention); full groups come first. num_layers: the model's layers (linear ones included).
    """

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]
    num_layers: int
    linear: tuple[int, ...] = ()  # linear-attention layers (a state per slot, no blocks)

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVCacheGroups:
        return _groups(cfg)

    @classmethod
    def full_attention(cls) -> KVCacheGroups:
        """One group of full attention (what a scheduler without a model assumes)."""
        return cls(((),), (None,), 0)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def size(self) -> int:
        """Layers per group: the layers whose KV one block id holds."""
        return len(self.layers[0])

    @property
    def sliding(self) -> bool:
        """Some group frees blocks behind a window (then block `NULL_BLOCK` is reserved)."""
        return any(w is not None for w in self.windows)

    @property
    def reserved_blocks(self) -> int:
        """Block ids no sequence can hold: the null block, with sliding groups."""
        return 1 if self.sliding else 0

    @property
    def full_layers(self) -> int:
        """Layers in full-attention groups: what one more token of context costs."""
        return sum(len(layers) for layers, w in zip(self.layers, self.windows) if w is None)

    @property
    def num_sliding_groups(self) -> int:
        return sum(w is not None for w in self.windows)

    @property
    def sliding_windows(self) -> list[int]:
        """The distinct windows of the sliding groups, ascending."""
        return sorted({w for w in self.windows if w is not None})

    @functools.cached_property
    def group_of(self) -> dict[int, int]:
        """Layer -> its group (KV layers only)."""
        return {layer: g for g, layers in enumerate(self.layers) for layer in layers}

    @functools.cached_property
    def owners(self) -> tuple[int, ...]:
        """The layers whose cache the runner's tuple holds, in layer order."""
        return tuple(sorted((*self.linear, *self.layers[0])))

    @functools.cached_property
    def cache_index(self) -> tuple[int, ...]:
        """Per layer, the index of its cache in the runner's tuple (see the module docstring)."""
        position = {layer: i for i, layer in enumerate(self.owners)}
        slot_owner = {layer: self.layers[0][j] for layers in self.layers for j, layer in enumerate(layers)}
        return tuple(position[i] if i in position else position[slot_owner[i]] for i in range(self.num_layers))

    def first_needed_block(self, group: int, position: int, virtual_block_size: int) -> int:
        """The first virtual block group `group` must hold for queries from `position` on: 0 for a
        full group; for a sliding one the block of position + 1 - W (earlier ones are dead)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(position + 1 - window, 0) // virtual_block_size

    def most_blocks(self, group: int, num_tokens: int, virtual_block_size: int, chunk: int) -> int:
        """The most blocks group `group` holds for one sequence of `num_tokens`, computed `chunk`
        positions a step at most (a sliding group holds its window and the chunk being written)."""
        blocks = -(-num_tokens // virtual_block_size)
        window = self.windows[group]
        if window is None:
            return blocks
        return min(blocks, -(-(window - 1 + chunk) // virtual_block_size) + 1)

    def blocks_for(self, num_tokens: int, virtual_block_size: int, chunk: int) -> int:
        """Block ids one sequence of `num_tokens` holds at most, all groups together."""
        return sum(self.most_blocks(g, num_tokens, virtual_block_size, chunk) for g in range(self.num_groups))

    def longest_sequence(self, usable_blocks: int, virtual_block_size: int, chunk: int, most: int) -> int:
        """The most tokens (at most `most`) of one sequence that `usable_blocks` block ids hold: the
        cache's size in tokens (without sliding groups, every block's positions). Where every group
        slides (one sequence would hold any length), what the blocks hold spread over the groups."""
        if all(w is not None for w in self.windows):
            return min(most, usable_blocks // self.num_groups * virtual_block_size)
        if self.blocks_for(most, virtual_block_size, chunk) <= usable_blocks:
            return most
        low, high = 0, most  # blocks_for grows with the tokens: the largest that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.blocks_for(mid, virtual_block_size, chunk) <= usable_blocks else \
                (low, mid - 1)
        return low


@functools.lru_cache(maxsize=64)
def _groups(cfg: ModelConfig) -> KVCacheGroups:
    kv = [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)]
    linear = tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_linear(i))
    by_window: dict[int | None, list[int]] = {}
    for layer in kv:
        by_window.setdefault(cfg.window_of(layer), []).append(layer)
    if set(by_window) == {None} or not kv:
        return KVCacheGroups((tuple(kv),), (None,), cfg.num_hidden_layers, linear)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    kinds = sorted(by_window, key=lambda w: (w is not None, w or 0))  # full attention first
    groups = [(tuple(by_window[w][i : i + size]), w) for w in kinds for i in range(0, len(by_window[w]), size)]
    return KVCacheGroups(tuple(g for g, _ in groups), tuple(w for _, w in groups), cfg.num_hidden_layers, linear)
