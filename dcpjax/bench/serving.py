"""What the serving benchmarks share: the workload's prompts, one measured run against a
server (after unmeasured warm-ups), the server's model card and counters, and starting a
server for a benchmark."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

from dcpjax.bench.client import make_prefix_repetition_prompts, make_prompts, run_benchmark
from dcpjax.engine_args import EngineArgs
from dcpjax.serve.launch import ServerProcess, start_server


def served_model(base_url: str, headers: dict) -> dict:
    """The server's (only) model from /v1/models: its "id" and "kv_cache_size_tokens"."""
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"][0]


def prompts_for(args, num: int, seed: int) -> list[str]:
    if args.dataset == "prefix-repetition":
        return make_prefix_repetition_prompts(num, args.prefix_len, args.suffix_len, args.num_prefixes, seed)
    return make_prompts(num, args.input_len, seed)


def bench_server(base_url: str, model: str, args) -> dict:
    warmups = args.max_concurrency if args.num_warmups is None else args.num_warmups
    if warmups:  # other prompts (seed 1): they compile the shapes without warming the measured prefixes
        asyncio.run(run_benchmark(
            base_url, model, prompts=prompts_for(args, warmups, seed=1), output_len=min(args.output_len, 4),
            max_concurrency=args.max_concurrency, api_key=args.api_key, progress=False, seed=1,
        ))
    result = asyncio.run(run_benchmark(
        base_url, model, prompts=prompts_for(args, args.num_prompts, seed=0), output_len=args.output_len,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate, api_key=args.api_key,
        progress=not args.no_progress,
    ))
    result["dataset"] = args.dataset
    if args.dataset == "prefix-repetition":
        result.update(prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes)
    else:
        result["input_len"] = args.input_len
    return result


def start_bench_server(engine_args: EngineArgs, api_key: str | None) -> ServerProcess:
    return start_server(engine_args.to_cli_args() + (["--api-key", api_key] if api_key else []))


def metric_value(base_url: str, name: str) -> float:
    """A counter or gauge of the server's /metrics (`dcpjax:NAME`, `_total` for counters); 0 if absent."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^dcpjax:{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
