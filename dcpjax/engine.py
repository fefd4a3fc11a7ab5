"""Continuous batching over the paged DCP cache.

Every step the scheduler fills one batch, first come first served:
  1. running sequences, each with its next chunk (one token when decoding, up to the
     token budget while prefilling), growing its KV blocks as it goes; when the cache
     is full, the most recently admitted running sequence is preempted (its blocks
     freed; it goes back to the head of the queue and later recomputes its prompt and
     the tokens it already generated, so no request is lost and its outputs are the
     same as if it had run alone);
  2. waiting sequences, while rows, tokens and blocks remain.
Prefill chunks and decode tokens advance in the same step, in two model calls (a
decode row is never padded to a prefill chunk). A row samples when its chunk reaches
the last known token. Block ids are shared by all DCP ranks
(each rank holds its tokens of a block), so one allocator serves the replica.
Shapes are bucketed (rows and chunk to powers of two, block-table width fixed by
max_model_len), so sequences grow without recompiling.
"""

from __future__ import annotations

import collections
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
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str | None = None
    preemptions: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_input(self) -> list[int]:
        """Known tokens whose KV is not cached yet (the prompt, or the last sampled token)."""
        known = self.prompt_ids + self.output_ids
        return known[self.num_computed :]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class StepStats:
    scheduled: int = 0
    tokens: int = 0
    preempted: int = 0
    finished: list = dataclasses.field(default_factory=list)


class Engine:
    """Schedules sequences onto the model runner, one step at a time."""

    def __init__(self, runner, tokenizer, eos_token_ids, *, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int):
        self.runner, self.tokenizer, self.eos = runner, tokenizer, frozenset(eos_token_ids)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.dcp = runner.pc.dcp
        self.blocks_per_seq = layout.blocks_needed(max_model_len, block_size, self.dcp)
        self.allocator = BlockAllocator(runner.kv_layout.num_blocks)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._sample = jax.jit(sample, static_argnames=("num_top",))

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not queued or running."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    seq.finish_reason = "abort"
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return 1.0 - self.allocator.num_free / self.allocator.num_blocks

    # -- scheduling ------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return layout.blocks_needed(tokens, self.block_size, self.dcp)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        extra = self._blocks_for(tokens) - len(seq.blocks)
        if extra > self.allocator.num_free:
            return False
        if extra > 0:
            seq.blocks += self.allocator.allocate(extra)
        return True

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0  # recompute prompt + generated tokens when readmitted
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule(self, stats: StepStats) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to feed) for this step."""
        batch, budget = [], self.token_budget
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an earlier sequence
            want = min(len(seq.next_input()), budget)
            if want <= 0:
                break
            while not self._grow(seq, seq.num_computed + want):
                victim = self.running[-1]
                self._preempt(victim)
                stats.preempted += 1
                if victim is seq:
                    break
            if seq in self.running:
                batch.append((seq, want))
                budget -= want
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            want = min(len(seq.next_input()), budget)
            if not self._grow(seq, seq.num_computed + want):
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, want))
            budget -= want
        return batch

    # -- one step --------------------------------------------------------------------------
    def step(self) -> StepStats:
        """Schedule, run the model, sample, and retire finished sequences.

        Prefill chunks and decode tokens advance in the same engine step but in two model
        calls, [rows, chunk] and [rows, 1]: a decode row padded to a prefill chunk would
        cost a whole chunk of compute.
        """
        stats = StepStats()
        batch = self._schedule(stats)
        if not batch:
            if self.waiting and not self.running:
                raise RuntimeError("the first waiting request does not fit in an empty KV cache")
            return stats
        is_prefill = [n > 1 or seq.num_computed + n < seq.length for seq, n in batch]
        prefill = [row for row, p in zip(batch, is_prefill) if p]
        decode = [row for row, p in zip(batch, is_prefill) if not p]
        for group in (prefill, decode):
            if group:
                self._run(group)
        for seq, _ in batch:
            if seq.finished:
                self.running.remove(seq)
                self._release(seq)
                stats.finished.append(seq)
        stats.scheduled, stats.tokens = len(batch), sum(n for _, n in batch)
        return stats

    def _run(self, group: list[tuple[Sequence, int]]) -> None:
        """One model call for these rows, then sampling for rows that reached their last known token."""
        rows = _pow2_at_least(len(group))
        chunk = _pow2_at_least(max(n for _, n in group))
        tokens = np.zeros((rows, chunk), np.int32)
        positions = np.zeros((rows, chunk), np.int32)
        valid = np.zeros((rows, chunk), bool)
        last = np.zeros((rows,), np.int32)
        tables = np.zeros((rows, self.blocks_per_seq), np.int32)
        sampling = []
        for i, (seq, n) in enumerate(group):
            tokens[i, :n] = seq.next_input()[:n]
            positions[i] = seq.num_computed + np.arange(chunk)
            valid[i, :n] = True
            last[i] = n - 1
            tables[i, : len(seq.blocks)] = seq.blocks
            seq.num_computed += n
            if seq.num_computed == seq.length:  # reached the last known token: sample the next
                sampling.append(i)
        logits = self.runner.step(tokens, positions, valid, last, tables)
        if sampling:
            self._sample_into([seq for seq, _ in group], logits, sampling)

    def run(self, sequences: list[Sequence], on_finish=None) -> None:
        """Add the sequences and step until the engine is idle (offline generation)."""
        for seq in sequences:
            self.add(seq)
        while self.has_work():
            for seq in self.step().finished:
                if on_finish is not None:
                    on_finish(seq)

    def _sample_into(self, seqs, logits, rows: list[int]) -> None:
        batch = logits.shape[0]
        temperature = np.zeros(batch, np.float32)
        top_k = np.zeros(batch, np.int32)
        top_p = np.ones(batch, np.float32)
        min_p = np.zeros(batch, np.float32)
        seeds = np.zeros(batch, np.uint32)
        counters = np.zeros(batch, np.int32)
        num_top = 0
        for i in rows:
            p = seqs[i].params
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
            seeds[i], counters[i] = seqs[i].seed % 2**32, len(seqs[i].output_ids)
            num_top = max(num_top, p.logprobs or 0)
        result = jax.device_get(self._sample(
            logits, temperature, top_k, top_p, min_p, seeds, counters, num_top=max(1, _pow2_at_least(num_top)),
        ))
        for i in rows:
            self._append(seqs[i], result, i)

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
