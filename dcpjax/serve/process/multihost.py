"""Several processes, one model: process 0 serves HTTP, every process runs the same engine.

Each process holds an identical engine. Before every step, process 0 broadcasts the
commands its HTTP handlers queued (adds, aborts; an empty list as a heartbeat when
idle) with `jax.experimental.multihost_utils.broadcast_one_to_all`, and every process
applies them in the same order. Each exchange starts with a heartbeat carrying process 0's
step counter; a follower whose own counter differs has diverged and stops (`faults`).
Scheduling and seeded sampling are deterministic, so all processes enter the same jitted step
with the same inputs (SPMD), as JAX's multi-controller runtime requires.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import numpy as np

from dcpjax.engine.core import Engine, Sequence
from dcpjax.sampling import SamplingParams
from dcpjax.serve.process import faults

logger = logging.getLogger(__name__)


def encode_add(seq: Sequence) -> dict:
    return {"op": "add", "request_id": seq.request_id, "prompt": seq.prompt, "prompt_ids": seq.prompt_ids,
            "params": dataclasses.asdict(seq.params), "max_total": seq.max_total, "seed": seq.seed}


def decode_add(command: dict) -> Sequence:
    return Sequence(request_id=command["request_id"], prompt=command["prompt"], prompt_ids=command["prompt_ids"],
                    params=SamplingParams(**command["params"]), max_total=command["max_total"], seed=command["seed"])


class CommandChannel:
    """Process 0 -> all processes, once per engine iteration."""

    def __init__(self):
        import jax

        self.is_leader = jax.process_index() == 0

    def exchange(self, commands: list[dict] | None = None) -> list[dict]:
        """Leader: send `commands`; everyone: return what the leader sent."""
        from jax.experimental import multihost_utils

        payload = json.dumps(commands or []).encode() if self.is_leader else b""
        size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
        bucket = 1 << max(6, (size - 1).bit_length())  # few distinct shapes to compile
        buffer = np.zeros(bucket, np.uint8)
        buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
        data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
        return json.loads(bytes(data[:size]).decode())


def follow(engine: Engine, channel: CommandChannel, process: int,
           failure_timeout: float = faults.DEFAULT_FAILURE_TIMEOUT) -> int:
    """The loop of every process but 0: apply the leader's commands, step in lockstep.

    Returns 0 when process 0 says stop. Ends the process with 1 (one log line saying why)
    when process 0 reports a failure, goes silent for `failure_timeout` seconds, or its
    heartbeat's step counter disagrees with this process's (the engines diverged), or when
    this process's own engine fails.
    """
    watchdog = faults.Watchdog(failure_timeout, lambda s: _give_up(
        f"process {process}: no word from process 0 for {s:.0f} s (it died or hung)"))
    watchdog.start()
    try:
        _follow_steps(engine, channel, process, watchdog)
    finally:
        watchdog.stop()
    return 0


def _follow_steps(engine: Engine, channel: CommandChannel, process: int, watchdog: faults.Watchdog) -> None:
    """Until process 0 says stop: its commands, then the same step."""
    steps = 0
    while True:
        for command in channel.exchange():
            watchdog.beat()
            if command["op"] == "stop":
                return
            if command["op"] == "fail":
                _give_up(f"process {process}: process 0 failed: {command['reason']}")
            elif command["op"] == "beat" and command["step"] != steps:
                _give_up(f"process {process}: diverged from process 0 (at step {steps}, process 0 at "
                         f"{command['step']})")
            elif command["op"] == "add":
                engine.add(decode_add(command))
            elif command["op"] == "abort":
                engine.abort(command["request_id"])
        if engine.has_work():
            try:
                faults.inject_fault(process, steps)
                engine.step()
            except Exception:
                logger.exception("process %d: engine step failed", process)
                _give_up(f"process {process}: engine failed")
            steps += 1


def _give_up(reason: str) -> None:
    logger.error("%s; exiting", reason)
    faults.exit_process(1)
    threading.Event().wait()  # the exit thread ends the process
