"""The engine on its own thread, fed by asyncio request handlers.

The engine is not thread-safe, so only its thread touches it: handlers post
commands (add, abort) to a queue that the thread drains before each step, and the
thread posts each request's progress back to that request's asyncio queue.
Streamed text holds back what could still change: a possible prefix of a stop
string, or a trailing incomplete UTF-8 character.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from dcpjax.engine.core import Engine, Sequence
from dcpjax.serve.metrics import Metrics
from dcpjax.serve.process import faults

logger = logging.getLogger(__name__)
FAILED = object()  # put on a request's queue when the engine has failed: the handler answers 503


class EngineDeadError(RuntimeError):
    """The engine failed (or a process of a multi-process model died): the server answers 503."""


@dataclasses.dataclass
class Update:
    text_delta: str
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None
    seq: Sequence


def _stable_text(seq: Sequence) -> str:
    text = seq.text or ""
    if seq.finished:
        return text
    holdback = max((len(s) - 1 for s in seq.params.stop), default=0)
    stable = text[: len(text) - holdback] if holdback else text
    return stable.rstrip("\ufffd")  # an incomplete UTF-8 character may still change


class _Stream:
    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.seq, self.loop = seq, loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.sent_text, self.sent_tokens = 0, 0
        self.arrival = time.monotonic()
        self.first_token: float | None = None


class AsyncEngine:
    """channel: a `process.multihost.CommandChannel` when several processes share the model (this
    one being process 0); every command then goes to all processes before each step, with a
    heartbeat carrying the step counter. failure_timeout: seconds without progress after
    which the engine counts as failed (a follower died or hung; multi-process only)."""

    def __init__(self, engine: Engine, metrics: Metrics, channel=None,
                 failure_timeout: float = faults.DEFAULT_FAILURE_TIMEOUT):
        self.engine, self.metrics, self.channel = engine, metrics, channel
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, _Stream] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.failure: str | None = None  # why the engine is dead; the server answers 503 from then on
        self.steps = 0
        self.watchdog = None
        if channel is not None:
            self.watchdog = faults.Watchdog(failure_timeout, lambda s: self.fail(
                f"process 0: no engine progress for {s:.0f} s: a follower process died or hung"))
            self.watchdog.start()
        self.thread = threading.Thread(target=self._loop, name="dcpjax-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop ------------------------------------------------------
    async def generate(self, seq: Sequence):
        """Yield Updates for `seq` until it finishes; aborts it if the consumer goes away."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        stream = _Stream(seq, asyncio.get_running_loop())
        self.commands.put(("add", stream))
        self.wake.set()
        try:
            while True:
                update = await stream.queue.get()
                if update is FAILED:
                    raise EngineDeadError(self.failure)
                yield update
                if update.finish_reason is not None:
                    return
        finally:
            if not seq.finished:  # client went away (or the handler failed): free its blocks now
                self.commands.put(("abort", seq.request_id))
                self.wake.set()

    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (queued adds included)."""
        return len(self.streams) + sum(kind == "add" for kind, _ in list(self.commands.queue))

    def abort_everything(self) -> None:
        """Abort every accepted request; each gets its final update (finish_reason "abort")."""
        self.commands.put(("abort_all", None))
        self.wake.set()

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.channel is not None and self.failure is None:
            self.channel.exchange([{"op": "stop"}])

    def fail(self, reason: str) -> None:
        """The engine is dead (multi-process): log it once, answer every request 503, exit 1 soon."""
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("%s; failing %d request(s), /health -> 503, exiting", reason, self.num_in_flight())
        for stream in list(self.streams.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, FAILED)
        while True:  # requests not yet handed to the engine
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                arg.loop.call_soon_threadsafe(arg.queue.put_nowait, FAILED)
        faults.exit_process(1, delay=2.0)

    # -- the engine thread -------------------------------------------------------------------
    def _drain_commands(self) -> None:
        pending = []
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "abort_all":  # everything accepted so far, including adds drained just now
                known = [*self.streams, *(stream.seq.request_id for k, stream in pending if k == "add")]
                pending += [("abort", request_id) for request_id in known]
            else:
                pending.append((kind, arg))
        for kind, arg in pending:  # known before the exchange, so a failure there reaches them
            if kind == "add":
                self.streams[arg.seq.request_id] = arg
        if self.channel is not None:  # the other processes apply the same commands, in order
            from dcpjax.serve.process.multihost import encode_add

            beat = {"op": "beat", "step": self.steps}  # a follower checks it has taken as many steps
            self.channel.exchange([beat, *(encode_add(arg.seq) if kind == "add" else {"op": "abort", "request_id": arg}
                                           for kind, arg in pending)])
        for kind, arg in pending:
            if kind == "add":
                self.engine.add(arg.seq)
                self.metrics.prompt_tokens.inc(len(arg.seq.prompt_ids))
                if arg.seq.finished:  # a decode server's first token (from the prefill server) ended it
                    self._publish(self.streams.pop(arg.seq.request_id))
            elif kind == "abort":
                self.engine.abort(arg)
                stream = self.streams.pop(arg, None)
                if stream is not None:
                    self._publish(stream)

    def _publish(self, stream: _Stream) -> None:
        seq = stream.seq
        text = _stable_text(seq)
        new_tokens = seq.output_ids_since(stream.sent_tokens)
        if not new_tokens and len(text) == stream.sent_text and not seq.finished:
            return
        now = time.monotonic()
        if new_tokens and stream.first_token is None:
            stream.first_token = now
            self.metrics.time_to_first_token.observe(now - stream.arrival)
        update = Update(text[stream.sent_text:], new_tokens, seq.logprobs[stream.sent_tokens:] if seq.params.logprobs
                        is not None else [], seq.finish_reason, seq)
        stream.sent_text, stream.sent_tokens = len(text), seq.num_output_tokens
        self.metrics.generation_tokens.inc(len(new_tokens))
        if seq.finished and stream.first_token is not None and seq.num_output_tokens > 1:
            self.metrics.time_per_output_token.observe((now - stream.first_token) / (seq.num_output_tokens - 1))
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)

    def _loop(self) -> None:
        while not self.stopped and self.failure is None:
            try:
                self._iterate()
            except Exception as error:  # an engine failure must not leave clients hanging
                if self.channel is not None:  # the processes may now disagree: stop them all
                    self.fail(f"process 0: engine failed: {error!r}")
                    self._tell_followers_to_fail(repr(error))
                    return
                logger.exception("engine step failed; failing the running requests")
                self.engine.abort_all()  # results of a failed step are not to be read
                for request_id in list(self.streams):
                    self._publish(self.streams.pop(request_id))
            if self.watchdog is not None:
                self.watchdog.beat()

    def _iterate(self) -> None:
        """One iteration: hand over commands (and, multi-process, the heartbeat), then one step."""
        self._drain_commands()
        if not self.engine.has_work():
            self.metrics.update(self.engine)
            # with other processes, come back soon: each iteration is also their heartbeat
            self.wake.wait(timeout=0.5 if self.channel is None else 0.05)
            self.wake.clear()
            return
        faults.inject_fault(0, self.steps)
        stats = self.engine.step()
        self.steps += 1
        self.metrics.preemptions.inc(stats.preempted)
        for request_id, stream in list(self.streams.items()):
            self._publish(stream)
            if stream.seq.finished:
                del self.streams[request_id]
        self.metrics.update(self.engine)

    def _tell_followers_to_fail(self, reason: str) -> None:
        """Best effort (a follower stuck in a collective will not hear it; its watchdog ends it)."""
        threading.Thread(target=lambda: self.channel.exchange([{"op": "fail", "reason": reason}]),
                         name="dcpjax-fail-followers", daemon=True).start()
