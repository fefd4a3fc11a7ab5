"""Bytes/s of one pull of a prompt's KV, per transport, across two processes on 127.0.0.1.

    python benchmarks/kv_transport.py                                   # 1k / 8k / 32k tokens, 3 repeats
    python benchmarks/kv_transport.py --tokens 1024 --repeats 1         # smoke (seconds)
    python benchmarks/kv_transport.py --connectors JaxTransferConnector --transfer-size-mb 256

The cache is SmolLM2-135M's: 30 layers, 3 KV heads, head_dim 64, K and V in bfloat16, one array per
layer and field ("k.{layer}", "v.{layer}" [heads, tokens, head_dim]), so a token is 30*3*64*2*2 =
23,040 bytes (32k tokens: 755 MB). A producer subprocess (this file, `--serve CONNECTOR`) holds each
prompt as that transport's producer would: host arrays for SocketConnector (the engine's host copies
are made before the offer), device arrays, ready, for JaxTransferConnector. This process pulls it
(`KVReceiver.pull`, checked against the expected shapes, acknowledged) and the time is
`PullResult.seconds`: from the request to the last array in (numpy arrays for the socket transport,
jax.Arrays on this process's device for the other), the acknowledgement's send included. One
unmeasured 1k pull per transport comes first (connections, jax's first transfer). Each pull's first
and last arrays are checked against what the producer filled them with.

On fake CPU devices both transports go through the kernel's loopback and these few cores: the numbers
say what each costs in CPU copies here, not what NICs, NVLink or ICI would give.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
CONNECTORS = ("SocketConnector", "JaxTransferConnector")


def bytes_per_token() -> int:
    return LAYERS * HEADS * HEAD_DIM * 2 * 2  # K and V, bfloat16


def layer_arrays(tokens: int, seed: int) -> dict[str, np.ndarray]:
    import ml_dtypes

    out = {}
    for layer in range(LAYERS):
        for i, field in enumerate("kv"):
            out[f"{field}.{layer}"] = np.full((HEADS, tokens, HEAD_DIM), (seed + 2 * layer + i) % 200 - 100,
                                              ml_dtypes.bfloat16)
    return out


def expected(tokens: int) -> dict:
    import ml_dtypes

    return {f"{field}.{layer}": ((HEADS, tokens, HEAD_DIM), np.dtype(ml_dtypes.bfloat16))
            for layer in range(LAYERS) for field in "kv"}


# -- the producer ------------------------------------------------------------------------------------
def serve(connector: str, options: dict) -> None:
    """Reads `{"key", "tokens", "seed"}` lines, offers each prompt, answers `{"ok"}`; `{"state": 1}`:
    `{"held_bytes"}`."""
    import jax

    from dcpjax.kv_transfer.transport import TRANSPORTS
    from dcpjax.kv_transfer.transport.base import payload_nbytes

    kwargs = {}
    if connector == "JaxTransferConnector" and options.get("transfer_size_mb"):
        kwargs["transfer_size"] = int(options["transfer_size_mb"]) << 20
    sender = TRANSPORTS[connector][0]("127.0.0.1", 0, max_bytes=8 << 30, timeout_s=600.0, **kwargs)
    print(json.dumps({"address": sender.address}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "state" in command:
            print(json.dumps({"held_bytes": sender.held_bytes}), flush=True)
            continue
        arrays = layer_arrays(command["tokens"], command["seed"])
        if sender.device_arrays:
            arrays = jax.block_until_ready({k: jax.device_put(a, jax.local_devices()[0]) for k, a in arrays.items()})
        assert sender.reserve(command["key"], payload_nbytes(arrays))
        sender.offer(command["key"], arrays)
        print(json.dumps({"ok": True}), flush=True)
    sender.close()


class Producer:
    def __init__(self, connector: str, options: dict):
        root = pathlib.Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        env.setdefault("JAX_PLATFORMS", "cpu")
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", connector, json.dumps(options)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.address = self.call(None)["address"]

    def call(self, command: dict | None) -> dict:
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer exited ({self.proc.wait(10)})")
        return json.loads(line)

    def wait_freed(self) -> None:
        deadline = time.monotonic() + 30
        while self.call({"state": 1})["held_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


# -- the consumer ------------------------------------------------------------------------------------
def measure(connector: str, tokens: list[int], repeats: int, options: dict) -> list[dict]:
    from dcpjax.kv_transfer.transport import TRANSPORTS

    producer = Producer(connector, options)
    receiver = TRANSPORTS[connector][1](timeout_s=60.0, retries=0)
    rows = []
    try:
        for n, repeat, measured in [(1024, 0, False)] + [(n, r, True) for n in tokens for r in range(repeats)]:
            key, seed = f"{n}-{repeat}-{measured}", repeat + 7
            producer.call({"key": key, "tokens": n, "seed": seed})
            result = receiver.pull(producer.address, key, expected(n))
            want = layer_arrays(1, seed)
            for name in ("k.0", f"v.{LAYERS - 1}"):
                got = np.asarray(result.arrays[name])
                assert got.shape == (HEADS, n, HEAD_DIM) and (got == want[name][0, 0, 0]).all(), name
            del result.arrays
            producer.wait_freed()
            if measured:
                rows.append({"connector": connector, "tokens": n, "repeat": repeat, "bytes": result.nbytes,
                             "seconds": result.seconds})
    finally:
        producer.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| connector | tokens | MB per pull | seconds per pull (median; min-max) | MB/s (median) |",
             "|---|---:|---:|---|---:|"]
    keys = sorted({(r["connector"], r["tokens"]) for r in rows}, key=lambda k: (CONNECTORS.index(k[0]), k[1]))
    for connector, n in keys:
        runs = [r for r in rows if (r["connector"], r["tokens"]) == (connector, n)]
        seconds = [r["seconds"] for r in runs]
        mb = runs[0]["bytes"] / 1e6
        lines.append(f"| {connector} | {n:,} | {mb:.1f} | {statistics.median(seconds):.3f}; "
                     f"{min(seconds):.3f}-{max(seconds):.3f} | {mb / statistics.median(seconds):,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    parser.add_argument("--transfer-size-mb", type=int, default=None,
                        help="JaxTransferConnector's chunk size (jax's transfer_size; default the sender's)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows here")
    parser.add_argument("--serve", nargs=2, metavar=("CONNECTOR", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], json.loads(args.serve[1]))
        return
    import jax

    options = {"transfer_size_mb": args.transfer_size_mb}
    rows = [row for c in args.connectors for row in measure(c, args.tokens, args.repeats, options)]
    print(f"KV of a SmolLM2-135M-shaped cache ({bytes_per_token():,} bytes per token, {2 * LAYERS} arrays), one pull "
          f"across two processes on 127.0.0.1; jax {jax.__version__}, {os.cpu_count()} CPUs\n")
    print(table(rows))
    print(f"\n    python benchmarks/kv_transport.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
