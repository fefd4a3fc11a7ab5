"""Several processes, one model: process 0 serves HTTP, every process runs the same engine.

Each process holds an identical engine. Before every step, process 0 broadcasts the
commands its HTTP handlers queued (adds, aborts; an empty list as a heartbeat when
idle) with `jax.experimental.multihost_utils.broadcast_one_to_all`, and every process
applies them in the same order. Scheduling and seeded sampling are deterministic, so
all processes enter the same jitted step with the same inputs (SPMD), as JAX's
multi-controller runtime requires.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from dcpjax.engine import Engine, Sequence
from dcpjax.sampling import SamplingParams


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


def follow(engine: Engine, channel: CommandChannel) -> None:
    """The loop of every process but 0: apply the leader's commands, step in lockstep."""
    while True:
        for command in channel.exchange():
            if command["op"] == "stop":
                return
            if command["op"] == "add":
                engine.add(decode_add(command))
            elif command["op"] == "abort":
                engine.abort(command["request_id"])
        if engine.has_work():
            engine.step()
