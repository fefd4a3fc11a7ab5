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

import numpy as np

from dcpjax.runner import step_input
from dcpjax.runner.messages import ScheduledCall, ScheduledChunk
from dcpjax.runner.request_states import RequestStates
from dcpjax.runner.shape_grid import ShapeGrid
from dcpjax.runner.step_input import CallShape
from dcpjax.sampling import GREEDY, SamplerConfig, sampler_config
from dcpjax.sharding import layout


@dataclasses.dataclass
class PreparedCall:
    """One model call, packed on the host and ready to dispatch (`ModelRunner.prepare`).

    chunks: its rows, in order; flat: the call's input (`step_input`); shape: its compile key;
    config: GREEDY (the model's argmax is the sample) or the full sampler; token_offsets: [rows]
    each row's first token in the flat token grid (its prompt logprobs are there).
    """

    chunks: tuple[ScheduledChunk, ...]
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

    def prepare(self, message: ScheduledCall, requests: RequestStates) -> list[PreparedCall]:
        """Pack the scheduler's message for one model call onto the grid: one call, or a packed
        prefill split in several when its rows' pages exceed the widest table.

        requests: the runner's state of each request (its sampling values). A greedy message samples
        every row by argmax and skips logprobs (a draft model's proposals).
        """
        rows, greedy, tables = list(message.chunks), message.greedy, message.block_tables
        config = self._config(rows, requests, greedy)
        longest, verify = max(r.count for r in rows), any(r.num_drafts for r in rows)
        values = None if greedy else np.stack([requests[r.request_id].values for r in rows])
        if verify or longest == 1 or (greedy and longest <= self.grid.verify_chunk):
            return [self._prepare_rows(rows, tables, values, config, verify)]
        prompt = any(r.wants_prompt_logprobs for r in rows) and not greedy
        groups, first = [], 0
        for group in self._packed_groups(rows, prompt):
            part = slice(first, first + len(group))
            groups.append(self._prepare_packed(group, tables[part], None if values is None else values[part], config,
                                               prompt))
            first += len(group)
        return groups

    def _config(self, rows: list[ScheduledChunk], requests: RequestStates, greedy: bool) -> SamplerConfig:
        if greedy:
            return GREEDY
        sampling = [requests[r.request_id].data for r in rows if r.samples]
        return sampler_config([data.params for data in sampling], self.vocab_size,
                              processors=any(data.logits_spec is not None for data in sampling),
                              max_logprobs=self.max_logprobs)

    def _pages(self, row: ScheduledChunk) -> int:
        """Block-table entries the row's chunk reaches."""
        return layout.blocks_needed(row.start + row.count, self.block_size, self.dcp)

    def _room(self, count: int) -> int:
        """Token places a row of `count` tokens takes in a packed call."""
        return -(-count // self.align) * self.align

    def _packed_groups(self, rows: list[ScheduledChunk], prompt: bool) -> list[list[ScheduledChunk]]:
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

    def _fill_rows(self, call: step_input.PackedCall, rows: list[ScheduledChunk], offsets: np.ndarray,
                   values: np.ndarray | None) -> None:
        """The sampling rows' fields (one per row), their tokens and positions at `offsets` (each row's
        first token in the flat token grid); `values`: the rows' request values (None: greedy)."""
        n = len(rows)
        column = lambda values: np.fromiter(values, np.int32, n)
        tokens, positions, from_slot, seq_slots = (call.tokens(name).reshape(-1)
                                                   for name in ("tokens", "positions", "from_slot", "seq_slots"))
        for row, at in zip(rows, offsets):
            positions[at : at + row.count] = np.arange(row.start, row.start + row.count)
            seq_slots[at : at + row.count] = row.slot
            if row.device_input:  # a decode row's token is the slot's last sample, still on the device
                from_slot[at] = row.slot
            else:
                tokens[at : at + row.count] = row.input_ids
        call.set("sample_at", offsets + column(r.count - 1 for r in rows))
        call.set("count", column(r.count for r in rows))
        call.set("slot", column(r.slot for r in rows))
        call.set("samples", column(r.samples for r in rows))
        if values is not None:  # else greedy (a draft's proposals): argmax, no logprobs, whatever its request asks
            call.set_request_values(values)
        call.set("counter", column(r.counter for r in rows))  # the draw's index

    def _prepare_rows(self, rows, tables: np.ndarray, values, config, verify: bool) -> PreparedCall:
        """B rows of one sequence each: decode (chunk 1), verify or a draft's catch-up (chunk 1 + k)."""
        chunk = 1 if max(r.count for r in rows) == 1 and not verify else self.grid.verify_chunk
        shape = self.grid.rows_call(len(rows), max(self._pages(r) for r in rows), chunk, verify)
        call = step_input.PackedCall(shape, len(rows), self.max_num_seqs)
        offsets = np.arange(len(rows), dtype=np.int32) * chunk
        self._fill_rows(call, rows, offsets, values)
        width, groups = min(shape.width, tables.shape[2]), shape.groups
        call.block_tables[:, : len(rows), :width] = tables[:, :groups, :width].transpose(1, 0, 2)
        return PreparedCall(tuple(rows), call.array, shape, config, offsets)

    def _prepare_packed(self, rows, tables: np.ndarray, values, config, prompt: bool) -> PreparedCall:
        """One row of every chunk back to back, their block tables too (`step_input`)."""
        pages = np.fromiter((self._pages(r) for r in rows), np.int32, len(rows))
        rooms = np.fromiter((self._room(r.count) for r in rows), np.int32, len(rows))
        shape = self.grid.packed_call(int(rooms.sum()), int(pages.sum()), prompt)
        call = step_input.PackedCall(shape, len(rows), self.max_num_seqs)
        offsets = (np.cumsum(rooms) - rooms).astype(np.int32)
        page_starts = np.cumsum(pages) - pages
        self._fill_rows(call, rows, offsets, values)
        page_offsets, table = call.tokens("page_offsets").reshape(-1), call.block_tables[:, 0]  # [G, W]
        targets = call.tokens("targets").reshape(-1) if prompt else None
        for row, own, at, first, need in zip(rows, tables, offsets, page_starts, pages):
            page_offsets[at : at + row.count] = first
            table[:, first : first + need] = own[: shape.groups, :need]
            if targets is not None and row.wants_prompt_logprobs:  # each position's next prompt token
                targets[at : at + len(row.prompt_targets)] = row.prompt_targets
        return PreparedCall(tuple(rows), call.array, shape, config, offsets)
