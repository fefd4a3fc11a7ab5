"""Packing a model call on the host: which layout the rows take, how a packed prefill is cut to
fit the widest block table, and every per-token and per-row value of the call's flat input
(`step_input`), rounded onto the `ShapeGrid`.

Layouts (`ModelRunner.prepare` -> `CallBuilder.prepare`):
  rows    every row one token (decode), or drafts to verify, or a draft model's catch-up of at
          most 1 + k tokens: B rows of one sequence each;
  packed  anything longer (prefill chunks): one row of every chunk back to back, split into
          several calls where their pages together would pass the widest table (or, where
          attention reads the whole table for every query, would make it read much more than
          each row needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np

from dcpjax.runner import step_input
from dcpjax.runner.shape_grid import ShapeGrid
from dcpjax.runner.step_input import CallShape
from dcpjax.sampling import GREEDY, SamplerConfig, sampler_config
from dcpjax.sequence import ScheduledRow
from dcpjax.sharding import layout


@dataclasses.dataclass
class PreparedCall:
    """One model call, packed on the host and ready to dispatch (`ModelRunner.prepare`).

    flat: the call's input (`step_input`); shape: its compile key; config: GREEDY (the model's
    argmax is the sample) or the full sampler; token_offsets: [rows] each row's first token in
    the flat token grid (its prompt logprobs are there).
    """

    rows: list[ScheduledRow]
    flat: np.ndarray
    shape: CallShape
    config: SamplerConfig
    token_offsets: np.ndarray


class CallBuilder:
    """The host side of a runner's calls: its grid, its pages per block and its slots.

    block_size, dcp: a page's tokens per rank and the DCP size (a virtual block is their
    product); num_slots: max_num_seqs (a padding row's slot); vocab_size, max_logprobs: what the
    full sampler takes; align: a packed call gives each sequence a whole number of `align` token
    places, its padding after its tokens (linear attention's chunk, `models.gated_delta.CHUNK`:
    a chunk then never holds two sequences)."""

    def __init__(self, grid: ShapeGrid, block_size: int, dcp: int, num_slots: int, vocab_size: int,
                 max_logprobs: int, align: int = 1):
        self.grid, self.block_size, self.dcp, self.max_num_seqs = grid, block_size, dcp, num_slots
        self.vocab_size, self.max_logprobs, self.align = vocab_size, max_logprobs, align
        self.requests = step_input.RequestCache()  # each request's fixed sampling values, packed once

    def prepare(self, rows: Seq[ScheduledRow], block_tables: np.ndarray, greedy: bool = False) -> list[PreparedCall]:
        """Pack a model call's rows onto the grid: one call, or a packed prefill split in several
        when its rows' pages exceed the widest table.

        block_tables: the scheduler's host tables [slots, blocks_per_seq], indexed by slot.
        greedy: sample every row greedily and skip logprobs (a draft model's proposals).
        """
        rows = list(rows)
        config = self._config(rows, greedy)
        longest, verify = max(r.count for r in rows), any(r.drafts for r in rows)
        if verify or longest == 1 or (greedy and longest <= self.grid.verify_chunk):
            return [self._prepare_rows(rows, block_tables, config, verify, greedy)]
        prompt = any(r.wants_prompt_logprobs for r in rows) and not greedy
        return [self._prepare_packed(group, block_tables, config, prompt, greedy)
                for group in self._packed_groups(rows, prompt)]

    def _config(self, rows: list[ScheduledRow], greedy: bool) -> SamplerConfig:
        if greedy:
            return GREEDY
        sampling = [r for r in rows if r.samples]
        return sampler_config([r.seq.params for r in sampling], self.vocab_size,
                              processors=any(r.seq.logits_spec is not None for r in sampling),
                              max_logprobs=self.max_logprobs)

    def _pages(self, row: ScheduledRow) -> int:
        """Block-table entries the row's chunk reaches."""
        return layout.blocks_needed(row.start + row.count, self.block_size, self.dcp)

    def _room(self, count: int) -> int:
        """Token places a row of `count` tokens takes in a packed call."""
        return -(-count // self.align) * self.align

    def _packed_groups(self, rows: list[ScheduledRow], prompt: bool) -> list[list[ScheduledRow]]:
        """Rows in order, cut where their pages together would pass the widest packed table, or
        their token places the largest token bucket (with `align` > 1), and, where attention reads
        every page of the table for every query (`ShapeGrid.whole_table` False), where that would
        more than double the (query, page) pairs the rows need alone, beyond the narrowest width:
        tokens x pages of the call <= 2 x sum of each row's own."""
        grid, groups = self.grid, [[]]
        most_tokens = (grid.prompt_tokens if prompt else grid.tokens)[-1]
        tokens = pages = own = 0
        for row in rows:
            need, room = self._pages(row), self._room(row.count)
            t, p, o = tokens + room, pages + need, own + row.count * need
            wasteful = not grid.whole_table and p > grid.packed_widths[0] and t * p > 2 * o
            if groups[-1] and (p > grid.max_packed_width or t > most_tokens or wasteful):
                groups.append([])
                t, p, o = room, need, row.count * need
            groups[-1].append(row)
            tokens, pages, own = t, p, o
        return groups

    def _fill_rows(self, call: step_input.PackedCall, rows: list[ScheduledRow], offsets: np.ndarray,
                   greedy: bool) -> None:
        """The sampling rows' fields (one per row), their tokens and positions at `offsets`
        (each row's first token in the flat token grid)."""
        n = len(rows)
        column = lambda values: np.fromiter(values, np.int32, n)
        tokens, positions, from_slot, seq_slots = (call.tokens(name).reshape(-1)
                                                   for name in ("tokens", "positions", "from_slot", "seq_slots"))
        for row, at in zip(rows, offsets):
            positions[at : at + row.count] = np.arange(row.start, row.start + row.count)
            seq_slots[at : at + row.count] = row.seq.slot
            if row.device_input:  # a decode row's token is the slot's last sample, still on the device
                from_slot[at] = row.seq.slot
            else:
                tokens[at : at + row.count] = row.input_ids
        call.set("sample_at", offsets + column(r.count - 1 for r in rows))
        call.set("count", column(r.count for r in rows))
        call.set("slot", column(r.seq.slot for r in rows))
        call.set("samples", column(r.samples for r in rows))
        call.set_request_values(np.stack([self.requests.values(r.seq) for r in rows]))
        call.set("counter", column(r.seq.num_tokens - 1 - r.seq.num_prompt_tokens for r in rows))  # the draw's index
        if greedy:  # a draft's proposals: argmax, whatever its request asks
            call.set("temperature", np.zeros(n, np.float32))
            call.set("wants_logprobs", np.zeros(n, np.int32))

    def _prepare_rows(self, rows, block_tables, config, verify: bool, greedy: bool) -> PreparedCall:
        """B rows of one sequence each: decode (chunk 1), verify or a draft's catch-up (chunk 1 + k)."""
        chunk = 1 if max(r.count for r in rows) == 1 and not verify else self.grid.verify_chunk
        shape = self.grid.rows_call(len(rows), max(self._pages(r) for r in rows), chunk, verify)
        call = step_input.PackedCall(shape, len(rows), self.max_num_seqs)
        offsets = np.arange(len(rows), dtype=np.int32) * chunk
        self._fill_rows(call, rows, offsets, greedy)
        slots = np.fromiter((r.seq.slot for r in rows), np.int32, len(rows))
        call.block_tables[: len(rows)] = block_tables[slots, : shape.width]
        return PreparedCall(rows, call.array, shape, config, offsets)

    def _prepare_packed(self, rows, block_tables, config, prompt: bool, greedy: bool) -> PreparedCall:
        """One row of every chunk back to back, their block tables too (`step_input`)."""
        pages = np.fromiter((self._pages(r) for r in rows), np.int32, len(rows))
        rooms = np.fromiter((self._room(r.count) for r in rows), np.int32, len(rows))
        shape = self.grid.packed_call(int(rooms.sum()), int(pages.sum()), prompt)
        call = step_input.PackedCall(shape, len(rows), self.max_num_seqs)
        offsets = (np.cumsum(rooms) - rooms).astype(np.int32)
        page_starts = np.cumsum(pages) - pages
        self._fill_rows(call, rows, offsets, greedy)
        page_offsets, table = call.tokens("page_offsets").reshape(-1), call.block_tables[0]
        targets = call.tokens("targets").reshape(-1) if prompt else None
        for row, at, first, need in zip(rows, offsets, page_starts, pages):
            page_offsets[at : at + row.count] = first
            table[first : first + need] = block_tables[row.seq.slot, :need]
            if targets is not None and row.wants_prompt_logprobs:  # each position's next prompt token
                seq, end = row.seq, min(row.start + row.count + 1, row.seq.num_prompt_tokens)
                after = seq.token_ids[row.start + 1 : end]
                targets[at : at + len(after)] = after
        return PreparedCall(rows, call.array, shape, config, offsets)
