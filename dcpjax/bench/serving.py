"""What the serving benchmarks share: the workload's prompts, one measured run against a
server (after unmeasured warm-ups), the server's model card and counters, and starting a
server for a benchmark."""

from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.error
import urllib.parse
import urllib.request

from dcpjax.bench.client import make_prefix_repetition_prompts, make_prompts, run_benchmark
from dcpjax.engine.args import EngineArgs
from dcpjax.serve.process.launch import ServerProcess, start_server


def _start_hint(base_url: str) -> str:
    port = urllib.parse.urlsplit(base_url).port or 8000
    return (f"start one with `python -m dcpjax.serve --port {port}` (on CPU add --num-cpu-devices 8 -tp 8 -dcp 2), "
            "or pass the address of one with --base-url")


def served_model(base_url: str, headers: dict) -> dict:
    """The server's (only) model from /v1/models: its "id" and "kv_cache_size_tokens".

    A server that does not answer is an OSError saying so and how to start one (one line, not
    urllib's traceback)."""
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())["data"][0]
    except urllib.error.HTTPError as err:  # it answered, with an error
        hint = "pass its key with --api-key" if err.code == 401 else "is --base-url an OpenAI-compatible server?"
        raise OSError(f"the server at {base_url} answered GET /v1/models with HTTP {err.code} — {hint}") from err
    except OSError as err:  # refused, no route, timed out (urllib's URLError is an OSError)
        reason = getattr(err, "reason", None) or err
        raise OSError(f"the server at {base_url} does not answer ({reason}) — {_start_hint(base_url)}") from err


def prompts_for(args, num: int, *, warmup: bool = False) -> list[str]:
    """`num` prompts of the workload drawn from --seed; the warm-up's from a stream of their own,
    never a measured prompt of this seed or another (a measured run must not hit the prefix cache
    its warm-up, or a rerun's, filled)."""
    seed = f"warm-up {args.seed}" if warmup else args.seed
    if args.dataset == "prefix_repetition":
        return make_prefix_repetition_prompts(num, args.prefix_len, args.suffix_len, args.num_prefixes, seed)
    return make_prompts(num, args.input_len, seed)


def warmup_count(args) -> int:
    """--num-warmups, or by default two waves of --max-concurrency requests (at most --num-prompts),
    after one request per prefix for prefix_repetition (misses: the hits' shapes come after)."""
    if args.num_warmups is not None:
        return args.num_warmups
    misses = args.num_prefixes if args.dataset == "prefix_repetition" else 0
    return min(args.num_prompts, 2 * args.max_concurrency + misses)


def warmup_output_lens(args, num: int) -> list[int]:
    """The warm-up requests' output lengths: the first wave's the measured --output-len, the next
    ones' drawn from 1..--output-len.

    The server compiles a step per shape (rows and chunk rounded up to powers of two, block-table
    width) the first time it meets it, seconds on CPU: a shape first met in the measured run adds
    that to its TTFT. The first wave ramps up to full concurrency (prefill chunks beside 0..c-1
    decode rows), runs the block tables out to the measured width, and ramps down to one decode row
    as its requests finish. The measured run's later requests arrive as others finish, sometimes
    several in one step, and split a step's chunk budget between them: the warm-up's random
    lengths make its requests finish (and the next ones arrive) in such bursts."""
    rng = random.Random(f"warm-up output lengths {args.seed}")
    return [args.output_len if i < args.max_concurrency else rng.randint(1, args.output_len) for i in range(num)]


def bench_server(base_url: str, model: str, args) -> dict:
    """Warm up (`warmup_count` requests: other prompts of the same lengths, at the same concurrency,
    `warmup_output_lens`), then measure `args.num_prompts` requests."""
    warmups = warmup_count(args)
    if warmups:
        asyncio.run(run_benchmark(
            base_url, model, prompts=prompts_for(args, warmups, warmup=True),
            output_len=warmup_output_lens(args, warmups),
            max_concurrency=args.max_concurrency, api_key=args.api_key, progress=not args.no_progress,
            desc="warm-up",
        ))
    result = asyncio.run(run_benchmark(
        base_url, model, prompts=prompts_for(args, args.num_prompts), output_len=args.output_len,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate, api_key=args.api_key,
        progress=not args.no_progress, seed=args.seed,
    ))
    result.update(dataset=args.dataset, seed=args.seed, num_warmups=warmups)
    if args.dataset == "prefix_repetition":
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
