"""Hold N concurrent streams against a server for a fixed time; count errors and lost requests.

    python benchmarks/load.py                      # starts its own server: tiny model, TP 8, DCP 2, 8 fake CPU devices
    python benchmarks/load.py --base-url http://127.0.0.1:8000 --streams 200 --seconds 60

Each stream sends streaming completions back to back until the time is up. An *error* is
an HTTP or transport failure; a *lost* request is one the server accepted (200) whose
stream ended without a finish_reason. Both must be 0. The KV cache is small on purpose, so
the server preempts under this load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import httpx

from dcpjax.bench.client import make_prompts, one_request
from dcpjax.engine.args import EngineArgs
from dcpjax.serve.process.launch import start_server

# the server started when no --base-url is given: a KV cache small enough that this load preempts
SERVER = EngineArgs(model="tiny-llama", tensor_parallel_size=8, decode_context_parallel_size=2,
                    max_num_batched_tokens=512, kv_cache_memory_bytes=48 * 4096, max_model_len=256,
                    num_cpu_devices=8)


async def hold(base_url: str, model: str, streams: int, seconds: float, input_len: int, output_len: int,
               api_key: str | None = None) -> dict:
    """`streams` clients sending streaming completions back to back for `seconds`; counts of each outcome."""
    prompts = make_prompts(64, input_len)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    counts = {"completed": 0, "errors": 0, "lost": 0, "tokens": 0}
    messages: set[str] = set()
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def stream(i: int):
            n = 0
            while time.perf_counter() < deadline:
                r = await one_request(client, base_url, model, prompts[(i + n) % len(prompts)], output_len, headers)
                n += 1
                if r.ok:
                    counts["completed"] += 1
                    counts["tokens"] += r.output_tokens
                elif r.error.startswith("stream ended"):
                    counts["lost"] += 1
                    messages.add(r.error)
                else:
                    counts["errors"] += 1
                    messages.add(r.error)

        start = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(streams)))
        duration = time.perf_counter() - start
    return {"streams": streams, "seconds": seconds, "duration_s": duration, **counts,
            "requests_per_s": counts["completed"] / duration, "tokens_per_s": counts["tokens"] / duration,
            "messages": sorted(messages)[:5]}


def measure(base: str, args: argparse.Namespace) -> dict:
    """Hold the streams against the server at `base`; add its preemption count."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client() as client:
        model = client.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]
    result = asyncio.run(hold(base, model, args.streams, args.seconds, args.input_len, args.output_len, args.api_key))
    with httpx.Client() as client:
        metrics = client.get(f"{base}/metrics").text
    result["preemptions"] = next((float(line.split()[-1]) for line in metrics.splitlines()
                                  if line.startswith("dcpjax:num_preemptions_total")), None)
    return result


def main(argv: list[str] | None = None) -> int:
    """Hold the load (starting a server unless --base-url); exit status 1 on any error or lost request."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="an already running server (default: start one)")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--api-key")
    args = p.parse_args(argv)
    if args.base_url is not None:
        result = measure(args.base_url, args)
    else:
        with start_server(SERVER.to_cli_args()) as server:
            result = measure(server.base_url, args)
    print(json.dumps(result, indent=1))
    return 0 if result["errors"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
