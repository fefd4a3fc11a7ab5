"""How one dcpjax parameter is read from a Hugging Face checkpoint: a `Rule` maps the part a
device holds (an index of slices into the dcpjax layout) to the slice of the checkpoint tensor(s)
it comes from, so each device reads only its bytes. Fused and permuted tensors are split or
rearranged here, so the models see one layout. Families combine these through
`dcpjax.models.component_rules`; the loader (`dcpjax.loader.weights`) runs them on a `TensorReader`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Protocol

import numpy as np


class TensorReader(Protocol):
    """What a rule reads from: a named checkpoint tensor's slice as numpy (the loader's
    `TensorSource` is one; the protocol keeps the models free of the loader)."""

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


def bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) of each axis of `index` into an array of `shape`."""
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


# (rows, cols) of a checkpoint tensor's quantization block -> the dcpjax-layout group sizes it maps to
Groups = Callable[[tuple[int, int]], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one dcpjax parameter is read: the checkpoint tensors it comes from (name ->
    shape) and `read(source, index, shape)`, the slice mapping.

    `groups`, for the rules a quantized checkpoint tensor can be held through: given its block
    (rows, cols), the size along each dcpjax axis of groups of elements that all lie in one block
    (so one scale serves each group); None: such a tensor is dequantized at load instead.
    """

    tensors: dict[str, tuple[int, ...]]
    read: Callable[[TensorReader, tuple[slice, ...], tuple[int, ...]], np.ndarray]
    groups: Groups | None = None


def row_groups(block_rows: int, row_width: int, offset: int, width: int, repeats: int = 1) -> tuple[int, int]:
    """Groups along (heads, head_dim) for rows laid out per head: head h's `width` rows start at
    h * row_width + offset (each head repeated `repeats` times in the dcpjax layout). Whole heads
    share a block when blocks hold whole heads; otherwise groups of the largest size that divides
    the block, the row pitch and the offset (so no group crosses a block edge)."""
    if block_rows % row_width == 0:
        return repeats * (block_rows // row_width), width
    return 1, math.gcd(block_rows, row_width, offset, width)


def same(hf_name: str, hf_shape: tuple[int, ...]) -> Rule:
    """dcpjax and the checkpoint share the layout."""
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx),
                (lambda block: tuple(block)) if len(hf_shape) == 2 else None)


def transposed(hf_name: str, hf_shape: tuple[int, ...]) -> Rule:
    """dcpjax [in, out] <- torch Linear [out, in]."""
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx[::-1]).T,
                lambda block: (block[1], block[0]))


def stacked_experts(hf_names: list[str], hf_shape: tuple[int, int]) -> Rule:
    """dcpjax [experts, in, out] <- one torch Linear [out, in] per expert."""

    def read(src, idx, shape):
        (x0, x1), (i0, i1), (o0, o1) = bounds(idx, shape)
        return np.stack([src.read(hf_names[e], (slice(o0, o1), slice(i0, i1))).T for e in range(x0, x1)])

    return Rule({name: hf_shape for name in hf_names}, read, lambda block: (1, block[1], block[0]))


def head_rows(hf_name: str, heads: int, head_dim: int, repeats: int, hidden: int | None) -> Rule:
    """q/k/v projection ([heads*d, hidden] -> [hidden, slots, d]) or bias ([heads*d] -> [slots, d]).

    Slot s holds head s // repeats (KV heads repeated over the "tp" groups).
    """

    def read(src, idx, shape):
        spans = bounds(idx, shape)
        (s0, s1), (d0, d1) = spans[-2], spans[-1]
        h0, h1 = s0 // repeats, (s1 - 1) // repeats + 1
        rows = slice(h0 * head_dim, h1 * head_dim)
        if hidden is None:  # bias
            block = src.read(hf_name, (rows,)).reshape(h1 - h0, head_dim)
        else:
            e0, e1 = spans[0]
            block = src.read(hf_name, (rows, slice(e0, e1))).reshape(h1 - h0, head_dim, e1 - e0)
        block = np.repeat(block, repeats, axis=0)[s0 - h0 * repeats : s1 - h0 * repeats, d0:d1]
        return block if hidden is None else np.moveaxis(block, 2, 0)

    hf_shape = (heads * head_dim,) if hidden is None else (heads * head_dim, hidden)
    if hidden is None:
        return Rule({hf_name: hf_shape}, read)
    return Rule({hf_name: hf_shape}, read, lambda block: (block[1], *row_groups(block[0], head_dim, 0, head_dim,
                                                                                   repeats)))


def output_heads(hf_name: str, heads: int, head_dim: int, hidden: int) -> Rule:
    """O projection: [hidden, heads*d] -> [heads, d, hidden]."""

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (e0, e1) = bounds(idx, shape)
        block = src.read(hf_name, (slice(e0, e1), slice(h0 * head_dim, h1 * head_dim)))
        return np.moveaxis(block.reshape(e1 - e0, h1 - h0, head_dim), 0, 2)[:, d0:d1]

    return Rule({hf_name: (hidden, heads * head_dim)}, read,
                lambda block: (*row_groups(block[1], head_dim, 0, head_dim), block[0]))


def kv_b_part(hf_name: str, heads: int, nope: int, v: int, lora: int, part: str) -> Rule:
    """MLA's kv_b_proj [heads*(nope+v), lora] -> W_UK [heads, nope, lora] or W_UV [heads, v, lora]."""
    offset = 0 if part == "k" else nope

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (c0, c1) = bounds(idx, shape)
        block = src.read(hf_name, (slice(h0 * (nope + v), h1 * (nope + v)), slice(c0, c1)))
        return block.reshape(h1 - h0, nope + v, c1 - c0)[:, offset + d0 : offset + d1]

    width = nope if part == "k" else v
    return Rule({hf_name: (heads * (nope + v), lora)}, read,
                lambda block: (*row_groups(block[0], nope + v, offset, width), block[1]))


def grouped_rows(hf_name: str, groups: int, group_rows: int, offset: int, heads_per_group: int, head_dim: int,
                 hidden: int) -> Rule:
    """One part of a fused projection whose rows come in groups (Qwen3-Next's in_proj_qkvz: per key
    head [q, k, v of its value heads, z of them]): [groups * group_rows, hidden] -> [hidden, heads,
    head_dim], head j being head j % heads_per_group of group j // heads_per_group's part, which
    starts `offset` rows into the group."""

    def read(src, idx, shape):
        (e0, e1), (h0, h1), (d0, d1) = bounds(idx, shape)
        g0, g1 = h0 // heads_per_group, (h1 - 1) // heads_per_group + 1
        block = src.read(hf_name, (slice(g0 * group_rows, g1 * group_rows), slice(e0, e1)))
        part = block.reshape(g1 - g0, group_rows, e1 - e0)[:, offset : offset + heads_per_group * head_dim]
        heads = part.reshape((g1 - g0) * heads_per_group, head_dim, e1 - e0)
        first = h0 - g0 * heads_per_group
        return np.moveaxis(heads[first : first + h1 - h0, d0:d1], 2, 0)

    def held_groups(block):
        if block[0] % group_rows == 0:  # whole groups of heads in a block
            return block[1], heads_per_group * (block[0] // group_rows), head_dim
        return block[1], 1, math.gcd(block[0], group_rows, offset, head_dim)

    return Rule({hf_name: (groups * group_rows, hidden)}, read, held_groups)


def squeezed(rule: Rule) -> Rule:
    """A [hidden, heads, 1] rule read as [hidden, heads]."""
    inner = rule.groups
    return Rule(rule.tensors, lambda src, idx, shape: rule.read(src, (*idx, slice(0, 1)), (*shape, 1))[..., 0],
                None if inner is None else lambda block: inner(block)[:-1])


def conv_channels(hf_name: str, channels: int, offset: int, heads: int, head_dim: int, taps: int) -> Rule:
    """A depthwise conv1d [channels, 1, K] -> [heads, head_dim, K] of the channels from `offset`."""

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (t0, t1) = bounds(idx, shape)
        rows = slice(offset + h0 * head_dim, offset + h1 * head_dim)
        block = src.read(hf_name, (rows, slice(0, 1), slice(t0, t1)))[:, 0]
        return block.reshape(h1 - h0, head_dim, t1 - t0)[:, d0:d1]

    return Rule({hf_name: (channels, 1, taps)}, read)
