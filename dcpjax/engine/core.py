"""The engine: a short loop over the scheduler, the model runner and the output processor.

With asynchronous scheduling (the default) the host stays one step ahead of the device:

    schedule step N -> pack and dispatch step N (returns at once)
    -> read step N-1's tokens (the device is busy with step N meanwhile)
    -> detokenize, check stops, publish step N-1

Step N's decode rows take their input token from step N-1's samples on the device,
so no token waits for a round trip. A stop seen one step late costs that sequence
one wasted row, never an extra output token (see `OutputProcessor.process`).
With `async_scheduling=False` each step is read right after it is dispatched.

Speculative decoding (a `proposer`) runs synchronously: proposals need every token of a sequence
on the host, so each step is read before the next is scheduled (as vLLM did when it added
speculative decoding to its V1 engine). Decode rows get room for `num_speculative_tokens` drafts
from the scheduler, drafts from the proposer, and are verified in the decode call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import NamedTuple

from dcpjax.engine.block_pool import BlockPool, PrefixCacheStats
from dcpjax.engine.config import SchedulerConfig
from dcpjax.engine.output_processor import OutputProcessor
from dcpjax.engine.scheduler import Scheduler
from dcpjax.kv_transfer.connector import KVConnector
from dcpjax.outputs import RequestOutput
from dcpjax.runner.model_runner import ModelRunner
from dcpjax.runner.step_output import StepResult
from dcpjax.sequence import ScheduledRow, Sequence
from dcpjax.spec_decode.stats import SpecDecodeStats

__all__ = ["BlockPool", "Engine", "Sequence", "StepStats", "StepTimings"]


class InFlight(NamedTuple):
    """A dispatched call: the engine's rows (row i is the result's row i) and the runner's handle."""

    rows: list[ScheduledRow]
    result: StepResult


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's counters (`Engine.stats`): numbers as of the call, the two stats objects live."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_preemptions: int
    prefix_cache: PrefixCacheStats
    num_cached_blocks: int  # blocks the prefix cache holds
    steps_compiled_after_ready: int  # model and sampler shapes XLA compiled after the server said ready
    spec_decode: SpecDecodeStats | None  # drafts proposed and accepted (None: no speculative decoding)


@dataclasses.dataclass
class StepStats:
    preempted: int = 0
    finished: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepTimings:
    """Host seconds per phase, summed over steps (what `bench throughput` breaks down).

    wait: blocked on the device for a step's tokens. Everything else is host work, which
    asynchronous scheduling overlaps with the device's step in flight.
    """

    steps: int = 0
    model_calls: int = 0
    schedule: float = 0.0
    prepare: float = 0.0  # pack the rows and transfer them (one array per model call)
    dispatch: float = 0.0  # enqueue the compiled step
    propose: float = 0.0  # speculative drafts (n-gram lookup, or the draft model's steps)
    wait: float = 0.0
    process: float = 0.0  # detokenize, stop checks, logprobs

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Engine:
    """Schedules sequences onto the model runner, one step at a time."""

    def __init__(self, runner: ModelRunner, tokenizer, eos_token_ids: Iterable[int], config: SchedulerConfig,
                 proposer=None, kv_connector: KVConnector | None = None):
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.proposer = proposer
        self.kv_connector = kv_connector  # prefill/decode disaggregation (`dcpjax.kv_transfer`), or None
        self.spec_stats = SpecDecodeStats(config.num_lookahead_tokens) if proposer else None
        self.scheduler = Scheduler(runner.kv_layout.num_blocks, config, dcp=runner.pc.dcp, spec_stats=self.spec_stats,
                                   connector=kv_connector.scheduler if kv_connector is not None else None,
                                   groups=runner.kv_groups)
        self.processor = OutputProcessor(tokenizer, eos_token_ids)
        self.async_scheduling = config.async_scheduling and proposer is None
        self.in_flight: list[InFlight] = []  # dispatched, not yet read
        self.timings = StepTimings()

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq`. A decode server's request for a transferred prompt starts with the producer's
        first token (`KVConnector.on_request`); one that token already finished is not queued."""
        if self.kv_connector is not None:
            self.kv_connector.on_request(seq, self.processor)
        if not seq.finished:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not queued or running.
        A token of it still in flight is dropped when read."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"  # first: the connector saves nothing of an aborted prompt
        self.scheduler.finish(seq)
        return True

    def abort_all(self) -> None:
        """Abort every request and drop the steps in flight (after an error or an interrupt
        inside `step`, whose state is then not to be trusted): every block and slot is free, and
        the prefix cache is emptied (a step that failed may not have written what it holds)."""
        self.in_flight.clear()
        for seq in self.scheduler.unfinished():
            seq.finish_reason = "abort"
        if self.kv_connector is not None:
            self.runner.drop_kv_transfers()  # loads under way are dropped: their blocks go back now
        self.scheduler.reset()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # queues and counters, as the server's metrics and the tests read them
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    kv_usage = property(lambda self: self.scheduler.kv_usage)
    # blocks sliding-window groups gave back behind their windows, since start (`models.kv_groups`)
    num_dead_blocks_freed = property(lambda self: self.scheduler.num_dead_blocks_freed)
    prefix_cache_stats: PrefixCacheStats = property(lambda self: self.scheduler.prefix_cache_stats)
    num_cached_blocks = property(lambda self: self.scheduler.num_cached_blocks)

    def reset_stats(self) -> None:
        """Start counting step timings and speculative acceptance afresh (a benchmark's timed run)."""
        self.timings = StepTimings()
        if self.spec_stats is not None:
            self.spec_stats.reset()

    def stats(self) -> EngineStats:
        """The counters the server's metrics and the benchmarks read, in one object."""
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           kv_usage=self.scheduler.kv_usage, num_preemptions=self.scheduler.num_preemptions,
                           prefix_cache=self.scheduler.prefix_cache_stats,
                           num_cached_blocks=self.scheduler.num_cached_blocks,
                           steps_compiled_after_ready=self.runner.steps_compiled_after_ready,
                           spec_decode=self.spec_stats)

    # -- one step --------------------------------------------------------------------------
    def step(self) -> StepStats:
        """Schedule and dispatch a step, then read the previous one (or this one, if not async)."""
        t = self.timings
        start = time.perf_counter()
        self._exchange_with_connector()  # loads finished, transfers ended: before this step's admissions
        scheduled = self.scheduler.schedule()
        now = time.perf_counter()
        t.schedule += now - start
        dispatched, tables = [], self.scheduler.block_tables
        for rows in scheduled.calls:
            if self.proposer is not None and rows is scheduled.decode:
                self.scheduler.add_drafts(rows, self.proposer.propose(rows, tables))
                before, now = now, time.perf_counter()
                t.propose += now - before
            before = now
            prepared = self.runner.prepare(self.scheduler.runner_call(rows))
            now = time.perf_counter()
            t.prepare += now - before
            by_id = {row.seq.request_id: row for row in rows}
            for call in prepared:
                result = self.runner.launch(call)
                dispatched.append(InFlight([by_id[i] for i in result.request_ids], result))
            if self.proposer is not None and rows is not scheduled.decode:
                self.proposer.after_prefill(rows, tables)  # the draft model computes the same chunks
            before, now = now, time.perf_counter()
            t.dispatch += now - before
        t.steps += bool(dispatched)
        t.model_calls += len(dispatched)
        if not dispatched and not self.in_flight:
            if self.kv_connector is not None and self.scheduler.waits_for_transfers:
                self.runner.wait_for_kv_transfers(0.01)  # nothing to run until a transfer moves on
            elif self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the first waiting request does not fit in an empty KV cache")
        if self.async_scheduling:
            to_read, self.in_flight = self.in_flight, dispatched
        else:
            to_read = dispatched
        stats = StepStats(preempted=scheduled.preempted)
        for result in to_read:
            stats.finished += self._read(result)
        if stats.finished:  # a prefill server's prompts are offered before anyone sees their handles
            self._exchange_with_connector()
        return stats

    def _exchange_with_connector(self) -> None:
        """The KV connector's step messages: the scheduler's saves and loads to the runner, the runner's
        report of what finished back to the scheduler."""
        if self.kv_connector is not None:
            meta = self.scheduler.build_connector_meta()
            self.scheduler.update_connector_output(self.runner.kv_connector_step(meta))

    def _read(self, dispatched: InFlight) -> list[Sequence]:
        """A dispatched call's outputs: the scheduler's bookkeeping first, then the tokens; frees and
        returns the sequences it finished."""
        before = time.perf_counter()
        dispatched.result.block_until_ready()
        now = time.perf_counter()
        self.timings.wait += now - before
        output = dispatched.result.fetch()
        self.scheduler.update_from_output(dispatched.rows, output.num_accepted)
        finished = self.processor.process(dispatched.rows, output)
        for seq in finished:
            self.scheduler.finish(seq)  # a prefill server's prompt: its handle now, its save next step
        self.timings.process += time.perf_counter() - now
        return finished

    def run(self, sequences: list[Sequence], on_finish=None, on_step=None) -> None:
        """Add the sequences and step until the engine is idle (offline generation); `on_finish(seq)`
        for each finished sequence, `on_step()` after each step (a progress bar's)."""
        for seq in sequences:
            self.add(seq)
            if seq.finished and on_finish is not None:  # its first token, from a prefill server, ended it
                on_finish(seq)
        try:
            while self.has_work():
                for seq in self.step().finished:
                    if on_finish is not None:
                        on_finish(seq)
                if on_step is not None:
                    on_step()
        except BaseException:  # an error or Ctrl-C mid-step: leave a clean engine for the next call
            self.abort_all()
            raise

    def output(self, seq: Sequence) -> RequestOutput:
        return self.processor.make_output(seq)
