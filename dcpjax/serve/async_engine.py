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

from dcpjax.engine import Engine, Sequence
from dcpjax.serve.metrics import Metrics

logger = logging.getLogger(__name__)


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
    """channel: a `multihost.CommandChannel` when several processes share the model (this
    one being process 0); every command then goes to all processes before each step."""

    def __init__(self, engine: Engine, metrics: Metrics, channel=None):
        self.engine, self.metrics, self.channel = engine, metrics, channel
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, _Stream] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="dcpjax-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop ------------------------------------------------------
    async def generate(self, seq: Sequence):
        """Yield Updates for `seq` until it finishes; aborts it if the consumer goes away."""
        stream = _Stream(seq, asyncio.get_running_loop())
        self.commands.put(("add", stream))
        self.wake.set()
        try:
            while True:
                update = await stream.queue.get()
                yield update
                if update.finish_reason is not None:
                    return
        finally:
            if not seq.finished:  # client went away (or the handler failed): free its blocks now
                self.commands.put(("abort", seq.request_id))
                self.wake.set()

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)
        if self.channel is not None:
            self.channel.exchange([{"op": "stop"}])

    # -- the engine thread -------------------------------------------------------------------
    def _drain_commands(self) -> None:
        pending = []
        while True:
            try:
                pending.append(self.commands.get_nowait())
            except queue.Empty:
                break
        if self.channel is not None:  # the other processes apply the same commands, in order
            from dcpjax.serve.multihost import encode_add

            self.channel.exchange([encode_add(arg.seq) if kind == "add" else {"op": "abort", "request_id": arg}
                                   for kind, arg in pending])
        for kind, arg in pending:
            if kind == "add":
                self.streams[arg.seq.request_id] = arg
                self.engine.add(arg.seq)
                self.metrics.prompt_tokens.inc(len(arg.seq.prompt_ids))
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
        while not self.stopped:
            self._drain_commands()
            if not self.engine.has_work():
                self.metrics.update(self.engine)
                # with other processes, come back soon: each iteration is also their heartbeat
                self.wake.wait(timeout=0.5 if self.channel is None else 0.05)
                self.wake.clear()
                continue
            try:
                stats = self.engine.step()
            except Exception:  # an engine failure must not leave clients hanging
                logger.exception("engine step failed; failing the running requests")
                self.engine.abort_all()  # results of a failed step are not to be read
                for request_id in list(self.streams):
                    self._publish(self.streams.pop(request_id))
                continue
            self.metrics.preemptions.inc(stats.preempted)
            for request_id, stream in list(self.streams.items()):
                self._publish(stream)
                if stream.seq.finished:
                    del self.streams[request_id]
            self.metrics.update(self.engine)
