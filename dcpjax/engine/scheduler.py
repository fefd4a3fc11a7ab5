"""Continuous batching: which sequences run this step, with how many tokens, in which blocks.

Every step the scheduler fills one batch, first come first served:
  1. running sequences, each with its next chunk (one token when decoding, up to the
     token budget while prefilling), growing its KV blocks as it goes; when the cache
     is full, the most recently admitted running sequence is preempted (its blocks
     freed; it goes back to the head of the queue and later recomputes its prompt and
     the tokens it already generated, so no request is lost and its outputs are the
     same as if it had run alone);
  2. waiting sequences, while rows, tokens and blocks remain.
Block ids are shared by all DCP ranks (each rank holds its tokens of a block), so one
`BlockPool` serves the replica, and all KV cache groups (`models.kv_groups`); the blocks, tables
and prefix cache are the `KVCacheManager`'s (`kv_cache_manager`): a sliding-window group frees
the blocks behind its window before each step's are allocated. With prefix caching, a sequence
admitted from the queue (new, or preempted) first takes the cached blocks of its longest cached prefix, in whole
virtual blocks and leaving at least its last token to compute (its logits are needed),
and computes only the rest. A block is registered once it is full, its tokens known to the host
(a decode row's input may still be on the device) and its KV computed by a step already
dispatched or by this step's prefill call.

Asynchronous scheduling: the step in flight may still be sampling a sequence's next
token when the next step is scheduled. Such a sequence (`num_pending` 1) decodes that
token straight from the device (`ScheduledRow.device_input`); a sequence whose pending
token will reach `max_total` is not scheduled again, and one that is found finished a
step late has its extra row's result dropped by the output processor.

Speculative decoding (`num_lookahead_tokens` k, vLLM's lookahead slots): a decode row gets
blocks and token budget for k drafts beyond its input (never past `max_total`), as
`ScheduledRow.lookahead`; the proposer's drafts then go onto the row (`add_drafts`), advancing
`num_computed`, until `update_from_output` rolls it back to the accepted tokens. Full blocks are
registered in the prefix cache from `min(num_computed, length)`, so a rejected draft never is.

Prefill/decode disaggregation: the KV connector's scheduler side (`connector`) says which waiting
prompts may start and whose prompt KV is remote; such sequences wait in `transfers`
(`transfer_queues`) with their blocks and slot while their KV moves.

The scheduler alone advances a sequence's scheduler state: `schedule` (rows, blocks, slots,
preemption), `add_drafts`, `update_from_output` (what a step that was read computed), `finish`
and `reset`. The output processor appends tokens and decides stops. The runner sees none of it:
`runner_call` hands it each call's rows as a message of ids, counts, token and block ids
(`runner.messages.ScheduledCall`), with the requests admitted and finished since the last one.
"""

from __future__ import annotations

import collections

import numpy as np

from dcpjax.engine.block_pool import PrefixCacheStats
from dcpjax.engine.config import SchedulerConfig
from dcpjax.engine.kv_cache_manager import KVCacheManager
from dcpjax.engine.transfer_queues import TransferQueues
from dcpjax.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.runner.messages import ScheduledCall
from dcpjax.sequence import ScheduledRow, ScheduledStep, Sequence, scheduled_call
from dcpjax.spec_decode.stats import SpecDecodeStats

# Prompt-logprobs chunks get logits at every position ([tokens, vocab] float32, several
# copies while their log-softmax and top-k are taken, on every device): this many tokens a
# step at most, so that a 128 k vocabulary stays under a GiB or so next to a full KV cache.
PROMPT_LOGPROBS_TOKENS = 512


class Scheduler:
    """Queues, KV blocks, device token slots and preemption (see the module docstring).

    `block_tables` [max_num_seqs, groups, blocks_per_seq]: the `KVCacheManager`'s tables of every
    running sequence, by slot. `groups`: the model's KV cache groups (default: one full-attention group).
    """

    def __init__(self, num_blocks: int, config: SchedulerConfig, *, dcp: int,
                 spec_stats: SpecDecodeStats | None = None, connector=None, groups: KVCacheGroups | None = None):
        self.config, self.block_size, self.dcp = config, config.block_size, dcp
        self.num_lookahead_tokens = config.num_lookahead_tokens  # room for speculative drafts on decode rows
        self.max_num_seqs, self.token_budget = config.max_num_seqs, config.max_num_batched_tokens
        self.kv = KVCacheManager(num_blocks, config, dcp=dcp, groups=groups)
        self.allocator, self.block_tables = self.kv.pool, self.kv.block_tables  # read by the engine and tests
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.spec_stats = spec_stats  # drafts proposed and accepted, counted as steps are read
        self._prompt_logprobs_budget = 0  # set by each schedule()
        self._finished_ids: list[str] = []  # finished since the runner's last message
        self._live: dict[str, Sequence] = {}  # the queued and running sequences, by request id
        self.connector = connector  # the KV connector's scheduler side (`kv_transfer`), or None
        self.transfers = TransferQueues(connector)  # sequences whose KV moves (loading, loaded, saving)

    # -- queues ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq`; its request id must not be one of a queued or running request (the runner
        keeps each request's state by id)."""
        if seq.request_id in self._live:
            raise ValueError(f"request id {seq.request_id!r} is already queued or running: give each request "
                             "its own id")
        self._live[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.transfers)

    def unfinished(self) -> list[Sequence]:
        """The queued, running and loading sequences (not a finished prompt still being saved)."""
        moving = self.transfers
        return [*self.waiting, *self.running, *moving.loaded, *moving.loading.values()]

    @property
    def waits_for_transfers(self) -> bool:
        """Nothing may run until a transfer moves on: loads or saves under way, or a full buffer."""
        return bool(self.transfers.loading or self.transfers.saving or self.transfers.waits_for_buffer)

    def find(self, request_id: str) -> Sequence | None:
        """The queued or running sequence of `request_id`, or None."""
        return self._live.get(request_id)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out of the queues and free its blocks and slot (a
        load under way, or a save, keeps them until the runner reports it)."""
        for queue in (self.running, self.waiting, self.transfers.loaded):
            try:
                queue.remove(seq)  # in neither if preempted and finished in one step, or interrupted mid-admission
            except ValueError:
                pass
        self.kv.cache_full_blocks(seq)
        saving = self.connector is not None and self.connector.request_finished(seq)
        if saving:
            self.transfers.saving[seq.request_id] = seq
        elif seq.request_id not in self.transfers.loading:
            self._release(seq)
        if self._live.get(seq.request_id) is seq:
            del self._live[seq.request_id]
        self._finished_ids.append(seq.request_id)

    def reset(self) -> None:
        """Finish every sequence (after a failed or interrupted step, whose tokens in flight will
        never be read): every block and slot is free, nothing is pending, and the prefix cache is
        emptied (a step that failed may not have written what it holds)."""
        moving = self.transfers
        for seq in self.unfinished():
            self.finish(seq)
            seq.num_pending = 0
        if self.connector is not None:
            self.connector.reset()
        for seq in [*moving.loading.values(), *moving.saving.values()]:  # the runner dropped their transfers
            self._release(seq)
        self.transfers = TransferQueues(self.connector)
        self.allocator.reset()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False while requests hold blocks."""
        return self.allocator.reset()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.allocator.stats

    @property
    def num_cached_blocks(self) -> int:
        return self.allocator.num_cached

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.kv.usage

    @property
    def num_dead_blocks_freed(self) -> int:
        return self.kv.num_dead_blocks_freed

    def _start_load(self, seq: Sequence) -> bool:
        """For a sequence whose prompt's KV comes from a prefill server (its first token appended):
        blocks for the prompt and that token, and its load recorded; False if the blocks are not free."""
        if not self.kv.blocks_for_load(seq):
            return False
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = 0
        self.transfers.loading[seq.request_id] = seq
        self.connector.update_state_after_alloc(seq)
        return True

    # -- the connector's messages (`transfer_queues`) ---------------------------------------------
    def build_connector_meta(self) -> KVConnectorMetadata:
        return self.transfers.meta()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.transfers.report(output, self._release, self.waiting.appendleft)

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.cache_full_blocks(seq)  # its recompute finds them, unless evicted meanwhile
        self._release(seq)
        seq.num_computed = 0  # recompute prompt + generated tokens when readmitted
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- one step ------------------------------------------------------------------------------
    def _row(self, seq: Sequence, count: int) -> ScheduledRow:
        row = ScheduledRow(seq, seq.num_computed, count, samples=seq.num_computed + count == seq.num_tokens,
                           device_input=seq.num_pending > 0)
        seq.num_computed += count
        if row.samples:
            seq.num_pending += 1
        if row.wants_prompt_logprobs:
            self._prompt_logprobs_budget -= count
        if not row.is_decode and not row.wants_prompt_logprobs:
            # Cache its full blocks now: a sequence admitted later in this step may reuse them,
            # since the prefill call, which runs first, writes every row's KV before any row
            # attends. (Rows of the later calls register at the next step.)
            self.kv.cache_full_blocks(seq)
        return row

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Drafts a decode row may verify: blocks and token budget are reserved for them (vLLM's
        lookahead slots), never past the sequence's last token."""
        # a decode row (one token left to compute), not waiting on the device
        if (not self.num_lookahead_tokens or seq.num_tokens - seq.num_computed != 1 or seq.num_pending
                or seq.needs_prompt_logprobs):
            return 0
        return max(0, min(self.num_lookahead_tokens, seq.max_total - seq.num_tokens - 1, budget - 1))

    def _budget_for(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` may compute this step: prompt-logprobs chunks also share a smaller budget."""
        if seq.needs_prompt_logprobs and seq.num_computed < seq.num_prompt_tokens - 1:
            return min(budget, self._prompt_logprobs_budget)
        return budget

    def schedule(self) -> ScheduledStep:
        """The rows of the next step (running sequences first, then new ones, vLLM's order);
        updates each scheduled sequence's progress."""
        self._prompt_logprobs_budget = min(self.token_budget, PROMPT_LOGPROBS_TOKENS)
        rows, budget, preempted = self._schedule_running(self.token_budget)
        rows += self._admit_waiting(budget)
        prefill = [r for r in rows if not r.is_decode and not r.wants_prompt_logprobs]
        decode = [r for r in rows if r.is_decode and not r.wants_prompt_logprobs]
        return ScheduledStep(prefill, decode, preempted, [r for r in rows if r.wants_prompt_logprobs])

    def runner_call(self, rows: list[ScheduledRow]) -> ScheduledCall:
        """One call's rows as the runner's message (`sequence.scheduled_call`), carrying the ids of the
        requests finished since the last message (the runner forgets them first)."""
        call = scheduled_call(rows, self.block_tables, finished_request_ids=self._finished_ids)
        self._finished_ids = []  # delivered (cleared only once the message exists)
        return call

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRow], int, int]:
        """(rows, budget left, preemptions) for the running sequences, oldest first: a sequence
        without room for its blocks preempts the newest ones (itself last)."""
        rows, preempted, index = [], 0, 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            index += 1
            self.kv.cache_full_blocks(seq)
            if seq.num_pending and seq.num_tokens >= seq.max_total:
                continue  # its pending token ends it ("length"): nothing more to compute
            want = min(seq.num_tokens - seq.num_computed, self._budget_for(seq, budget))
            if want <= 0:
                continue
            lookahead = self._lookahead(seq, budget)
            while not self.kv.grow(seq, seq.num_computed + want + lookahead):
                victim = self._victim(seq)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.slot is None:  # preempted itself: everything after it went first
                break
            rows.append(self._row(seq, want))
            rows[-1].lookahead = lookahead
            budget -= want + lookahead
        return rows, budget, preempted

    def _victim(self, seq: Sequence) -> Sequence:
        """The newest running sequence to preempt for `seq` (itself last), sparing those whose token
        in flight ends them: their blocks come back when it is read, and a prefill server still
        hands their KV on then (`kv_transfer`)."""
        for victim in reversed(self.running):
            if victim is seq or not (victim.num_pending and victim.num_tokens >= victim.max_total):
                return victim
        return seq

    def _admit_waiting(self, budget: int) -> list[ScheduledRow]:
        """Rows for waiting sequences, first come first served, while slots, blocks and `budget` last
        (first the sequences whose remote KV has arrived: they hold their blocks and slot already)."""
        rows = []
        while self.transfers.loaded and budget > 0:
            seq = self.transfers.loaded.popleft()
            self.running.append(seq)
            rows.append(self._row(seq, 1))
            rows[-1].admitted = True
            budget -= 1
        self.transfers.waits_for_buffer = False
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last token was in flight: admitted once it is read
            if self._budget_for(seq, budget) <= 0:
                break  # the prompt-logprobs budget is spent: next step
            if self.connector is not None and not self.connector.can_admit(seq):
                self.transfers.waits_for_buffer = True
                break  # the transfer buffer is full: it starts once a decode server has pulled enough
            seq.slot = self.free_slots.pop()
            if self.connector is not None and self.connector.num_remote_tokens(seq):
                if not self._start_load(seq):
                    self.free_slots.append(seq.slot)
                    seq.slot = None
                    break
                self.waiting.popleft()
                continue
            want = self.kv.take_cached_prefix(seq, self._budget_for(seq, budget))
            if want is None:
                self.free_slots.append(seq.slot)
                seq.slot = None
                break  # nobody overtakes the head of the queue
            self.kv.grow(seq, seq.num_computed + want)
            self.waiting.popleft()
            self.running.append(seq)
            rows.append(self._row(seq, want))
            rows[-1].admitted = True
            budget -= want
        return rows

    # -- after the proposer and after the device -------------------------------------------------
    def add_drafts(self, rows: list[ScheduledRow], drafts: list[list[int]]) -> None:
        """Verify each decode row's proposed `drafts` too (at most its `lookahead`, for which room
        is reserved): the row then covers positions start .. start + len(drafts)."""
        for row, proposed in zip(rows, drafts):
            proposed = list(proposed[: row.lookahead])
            grown = len(proposed) - len(row.drafts)
            row.seq.num_computed += grown
            row.count += grown
            row.drafts = proposed

    def update_from_output(self, rows: list[ScheduledRow], num_accepted: np.ndarray | None) -> None:
        """What a step that has been read leaves behind: each row that sampled no longer waits on
        the device; a verify row (`num_accepted` [rows]: drafts kept, from the step) keeps the KV of
        its input and accepted drafts only: the rejected drafts' positions are computed again, their
        KV rewritten before any query can reach it (a query attends only up to its own position)."""
        for i, row in enumerate(rows):
            if not row.samples:
                continue
            seq = row.seq
            seq.num_pending -= 1
            if num_accepted is None or seq.finished:
                continue
            accepted = int(num_accepted[i])
            if self.spec_stats is not None:
                self.spec_stats.record(len(row.drafts), accepted)
            seq.num_computed = row.start + accepted + 1
