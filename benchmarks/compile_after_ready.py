"""No compilation after ready: start a server with its precompile, twice (the second start loads
the first's compilation cache), then send it a mixed workload and read its counters.

    python benchmarks/compile_after_ready.py      # tiny-llama, TP 8 / DCP 2, 8 fake CPU devices
    python benchmarks/compile_after_ready.py --model smollm2-135m-instruct --num-cpu-devices 9 \\
        --tensor-parallel-size 9 --decode-context-parallel-size 3 --max-model-len 1024 --max-num-seqs 8

Each start is `python -m dcpjax.serve ... --no-enforce-eager --compilation-cache-dir DIR` (one
fresh DIR for both); its time to /health and `dcpjax:compilations_total` at ready are printed.
The workload (against the last start): prompts of 1 to --max-prompt-chars characters and
prompts sharing prefixes (prefix-cache hits), completions and chat, streamed and not, n 1 to 3,
logprobs 0 to 5, echo with logprobs (prompt logprobs, max_tokens 0 too), greedy and sampled
(top_k, top_p, min_p, penalties, logit_bias, seeds), --concurrency at a time. Every request must
answer 200; then `dcpjax:compilations_total` must not have moved and
`dcpjax:step_compilations_after_ready_total` must be 0 (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import httpx

from dcpjax.bench.client import WORDS
from dcpjax.engine.args import EngineArgs
from dcpjax.serve.process.launch import start_server

COUNTERS = ("dcpjax:compilations_total", "dcpjax:step_compilations_after_ready_total")


def counters(base_url: str) -> dict[str, float]:
    """The compile counters of the server's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0]
        if name in COUNTERS:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def _text(rng: random.Random, chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[: max(1, chars)]


def workload(num: int, max_chars: int, seed: int = 0) -> list[tuple[str, dict]]:
    """(endpoint, body) of `num` mixed requests (see the module docstring)."""
    rng = random.Random(seed)
    prefixes = [_text(rng, max_chars // 2) for _ in range(3)]
    requests = []
    for i in range(num):
        prompt = (rng.choice(prefixes) + " " + _text(rng, rng.randint(1, max_chars // 2)) if i % 3 == 0
                  else _text(rng, rng.randint(1, max_chars)))
        body: dict = {"max_tokens": rng.choice([1, 4, 9, 16, 33]), "stream": rng.random() < 0.5,
                      "n": rng.choice([1, 1, 2, 3])}
        if rng.random() < 0.5:
            body |= {"temperature": rng.choice([0.5, 1.0]), "top_k": rng.choice([-1, 5, 50]),
                     "top_p": rng.choice([1.0, 0.9]), "min_p": rng.choice([0.0, 0.05]), "seed": rng.randint(0, 99)}
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body |= {"presence_penalty": 0.5, "frequency_penalty": 0.2, "logit_bias": {"65": 1.5}}
        if rng.random() < 0.3:  # a chat request
            body["messages"] = [{"role": "user", "content": prompt}]
            if rng.random() < 0.5:
                body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
            requests.append(("/v1/chat/completions", body))
            continue
        body["prompt"] = prompt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.15:  # lm-eval's loglikelihood: the prompt's own logprobs
            body |= {"echo": True, "logprobs": 1, "max_tokens": rng.choice([0, 1]), "temperature": 0, "n": 1}
            body.pop("stream", None)
        requests.append(("/v1/completions", body))
    return requests


async def send_all(base_url: str, model: str, requests: list[tuple[str, dict]], concurrency: int) -> list[str]:
    """Send every request, `concurrency` at a time; the failures' descriptions."""
    failures, gate = [], asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        async def one(path: str, body: dict):
            async with gate:
                response = await client.post(f"{base_url}{path}", json={"model": model, **body})
                text = await response.aread()
                if response.status_code != 200 or (body.get("stream") and b"[DONE]" not in text):
                    failures.append(f"{path} {json.dumps(body)[:200]} -> HTTP {response.status_code} {text[:200]!r}")

        await asyncio.gather(*(one(path, body) for path, body in requests))
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=120)
    p.add_argument("--starts", type=int, default=2, help="server starts sharing one compilation cache folder")
    p.add_argument("--start-timeout", type=float, default=3600)
    EngineArgs.add_cli_args(p, defaults={"model": "tiny-llama", "tensor_parallel_size": 8,
                                         "decode_context_parallel_size": 2, "num_cpu_devices": 8})
    args = p.parse_args(argv)
    engine = EngineArgs.from_cli_args(args, enforce_eager=False)
    print(f"{engine.model}, TP {engine.tensor_parallel_size}, DCP {engine.decode_context_parallel_size}, "
          f"{time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory(prefix="dcpjax-cache-") as cache:
        server_args = [*engine.to_cli_args(), "--compilation-cache-dir", cache]
        for start in range(1, args.starts + 1):
            began = time.perf_counter()
            server = start_server(server_args, timeout=args.start_timeout)
            ready_s = time.perf_counter() - began
            at_ready = counters(server.base_url)
            precompiled = [line.split("] ")[-1] for line in server.log_tail(20000).splitlines()
                           if "step shapes in" in line]
            print(f"start {start}: ready in {ready_s:.1f} s, {at_ready.get(COUNTERS[0], 0):.0f} XLA compiles "
                  f"({precompiled[-1] if precompiled else 'no precompile logged'})")
            if start < args.starts:
                server.stop()
        with server:
            model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            requests = workload(args.requests, args.max_prompt_chars)
            began = time.perf_counter()
            failures = asyncio.run(send_all(server.base_url, model, requests, args.concurrency))
            after = counters(server.base_url)
    compiled = after.get(COUNTERS[0], 0) - at_ready.get(COUNTERS[0], 0)
    after_ready = after.get(COUNTERS[1], 0)
    print(f"workload: {len(requests)} requests in {time.perf_counter() - began:.1f} s, {len(failures)} failed; "
          f"XLA compiles while serving: {compiled:.0f}; step compilations after ready: {after_ready:.0f}")
    for failure in failures[:5]:
        print("  ", failure)
    return 0 if not failures and compiled == 0 and after_ready == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
