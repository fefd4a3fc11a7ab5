"""Offline generation over the paged DCP cache: block allocation, chunked prefill, decode.

Requests run in waves: a wave takes, first come first served, the requests whose
blocks fit; it prefills their prompts in chunks (all sequences of the wave side
by side, ragged), then decodes one token per step until every sequence stops.
Block ids are shared by all DCP ranks (each rank holds its tokens of a block),
so one allocator serves the replica. Shapes are bucketed (batch to a power of
two, chunk to a power of two <= max chunk, block-table width fixed by
max_model_len), so sequences grow without recompiling.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from dcpjax.outputs import CompletionOutput, Logprob, RequestOutput
from dcpjax.sampling import SamplingParams, sample
from dcpjax.sharding import layout

logger = logging.getLogger("dcpjax")


class BlockAllocator:
    """Free list of physical block ids (each id is a block on every DCP rank)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_ids):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self.free_ids)} free")
        return [self.free_ids.pop() for _ in range(count)]

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(reversed(ids))


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_total: int  # prompt + output tokens this sequence may reach
    seed: int  # the request's seed, or one drawn from the LLM's seed
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    blocks: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class OfflineEngine:
    def __init__(self, runner, tokenizer, eos_token_ids, *, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_chunk: int):
        self.runner, self.tokenizer, self.eos = runner, tokenizer, frozenset(eos_token_ids)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_num_seqs, self.max_chunk = max_num_seqs, max_chunk
        self.dcp = runner.pc.dcp
        self.blocks_per_seq = layout.blocks_needed(max_model_len, block_size, self.dcp)
        self.allocator = BlockAllocator(runner.kv_layout.num_blocks)
        self._sample = jax.jit(sample, static_argnames=("num_top",))

    def blocks_for(self, seq: Sequence) -> int:
        return layout.blocks_needed(seq.max_total, self.block_size, self.dcp)

    def run(self, sequences: list[Sequence]) -> None:
        pending = list(sequences)
        while pending:
            wave = []
            while pending and len(wave) < self.max_num_seqs and self.blocks_for(pending[0]) <= self.allocator.num_free:
                seq = pending.pop(0)
                seq.blocks = self.allocator.allocate(self.blocks_for(seq))
                wave.append(seq)
            if not wave:
                raise RuntimeError("a request needs more KV blocks than the whole cache holds")  # checked earlier
            try:
                self._run_wave(wave)
            finally:
                for seq in wave:
                    self.allocator.free(seq.blocks)
                    seq.blocks = []

    # -- one wave ----------------------------------------------------------------------
    def _tables(self, wave, batch):
        tables = np.zeros((batch, self.blocks_per_seq), np.int32)
        for i, seq in enumerate(wave):
            tables[i, : len(seq.blocks)] = seq.blocks
        return tables

    def _run_wave(self, wave: list[Sequence]) -> None:
        batch = _pow2_at_least(len(wave))
        tables = self._tables(wave, batch)
        longest = max(len(s.prompt_ids) for s in wave)
        chunk = min(self.max_chunk, max(16, _pow2_at_least(longest)))
        for start in range(0, longest, chunk):
            tokens = np.zeros((batch, chunk), np.int32)
            positions = np.zeros((batch, chunk), np.int32)
            valid = np.zeros((batch, chunk), bool)
            last = np.zeros((batch,), np.int32)
            ending = []
            for i, seq in enumerate(wave):
                piece = seq.prompt_ids[start : start + chunk]
                tokens[i, : len(piece)] = piece
                positions[i] = start + np.arange(chunk)
                valid[i, : len(piece)] = True
                if start <= len(seq.prompt_ids) - 1 < start + chunk:
                    last[i] = len(seq.prompt_ids) - 1 - start
                    ending.append(i)
            logits = self.runner.step(tokens, positions, valid, last, tables)
            if ending:
                self._sample_into(wave, logits, ending)
        while True:
            active = [i for i, s in enumerate(wave) if s.finish_reason is None]
            if not active:
                return
            tokens = np.zeros((batch, 1), np.int32)
            positions = np.zeros((batch, 1), np.int32)
            valid = np.zeros((batch, 1), bool)
            for i in active:
                seq = wave[i]
                tokens[i, 0] = seq.output_ids[-1]
                positions[i, 0] = seq.length - 1
                valid[i, 0] = True
            logits = self.runner.step(tokens, positions, valid, np.zeros((batch,), np.int32), tables)
            self._sample_into(wave, logits, active)

    def _sample_into(self, wave, logits, rows: list[int]) -> None:
        batch = logits.shape[0]
        temperature = np.zeros(batch, np.float32)
        top_k = np.zeros(batch, np.int32)
        top_p = np.ones(batch, np.float32)
        min_p = np.zeros(batch, np.float32)
        seeds = np.zeros(batch, np.uint32)
        counters = np.zeros(batch, np.int32)
        num_top = 0
        for i in rows:
            p = wave[i].params
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
            seeds[i], counters[i] = wave[i].seed % 2**32, len(wave[i].output_ids)
            num_top = max(num_top, p.logprobs or 0)
        result = jax.device_get(self._sample(
            logits, temperature, top_k, top_p, min_p, seeds, counters, num_top=max(1, _pow2_at_least(num_top)),
        ))
        for i in rows:
            self._append(wave[i], result, i)

    def _append(self, seq: Sequence, result, row: int) -> None:
        token = int(result.tokens[row])
        seq.output_ids.append(token)
        seq.cumulative_logprob += float(result.logprobs[row])
        if seq.params.logprobs is not None:
            entry = {token: Logprob(float(result.logprobs[row]), int(result.ranks[row]), self._piece(token))}
            for rank, (tid, lp) in enumerate(zip(result.top_ids[row], result.top_logprobs[row])):
                if rank < seq.params.logprobs and int(tid) not in entry:
                    entry[int(tid)] = Logprob(float(lp), rank + 1, self._piece(int(tid)))
            seq.logprobs.append(entry)
        self._check_stop(seq, token)

    def _piece(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_text(token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids)
        if not params.ignore_eos and token in self.eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and seq.text is not None and (hit := _first_stop(seq.text, params.stop)) is not None:
            at, stop = hit
            seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.length >= seq.max_total:
            seq.finish_reason = "length"
        stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        if stopped_by_token and self.tokenizer is not None:  # EOS / stop token ids are not part of the text
            seq.text = self.tokenizer.decode(seq.output_ids[:-1])

    @staticmethod
    def output(seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=seq.text, token_ids=list(seq.output_ids), cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        )
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_ids), [completion], finished=True)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
