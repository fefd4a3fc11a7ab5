"""Failing fast when serving: a stalled or failed engine is detected, reported and exits.

Several processes run one model in lockstep (`multihost`): if one of them dies or hangs,
the others block in the next collective forever. So every process runs a `Watchdog`
that its loop beats once per iteration (process 0 beats even when idle: each idle
iteration is also the followers' heartbeat). A watchdog that misses its beats for
`--failure-timeout` seconds (default 30) ends the process with one log line naming the
process and the cause; process 0 first fails its in-flight requests with a 503 and
turns /health to 503. The exit is `os._exit`: a process stuck in a collective cannot
be unwound, and jax.distributed's own shutdown would wait for the dead peer.

`DCPJAX_INJECT_FAULT=step_error:<process>:<step>` makes that process's engine raise at
that step: the tests use it to prove an engine exception on either side is handled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
FAULT_ENV = "DCPJAX_INJECT_FAULT"
DEFAULT_FAILURE_TIMEOUT = 30.0


def inject_fault(process: int, step: int) -> None:
    """Raise if `FAULT_ENV` asks this process to fail at this engine step (tests only)."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec.startswith("step_error:"):
        _, target, at = spec.split(":")
        if int(target) == process and step >= int(at):
            raise RuntimeError(f"injected fault at engine step {step} of process {process} ({FAULT_ENV}={spec})")


def exit_process(code: int, delay: float = 0.0) -> None:
    """End the process with `code` after `delay` seconds (time for error responses to leave)."""

    def stop():
        time.sleep(delay)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=stop, name="dcpjax-exit", daemon=True).start()


class Watchdog(threading.Thread):
    """Calls `on_stall(seconds_without_beat)` once if `beat()` stops for `timeout` seconds."""

    def __init__(self, timeout: float, on_stall: Callable[[float], None], name: str = "dcpjax-watchdog"):
        super().__init__(name=name, daemon=True)
        self.timeout, self.on_stall = timeout, on_stall
        self.last = time.monotonic()
        self.stopped = False

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self.stopped = True

    def run(self) -> None:
        while not self.stopped:
            time.sleep(min(1.0, self.timeout / 10))
            silent = time.monotonic() - self.last
            if silent > self.timeout and not self.stopped:
                self.on_stall(silent)
                return
