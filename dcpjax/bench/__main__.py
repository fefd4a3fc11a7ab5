"""`python -m dcpjax.bench throughput|serve|compare|sweep`: offline and serving benchmarks.

    # offline generation speed, with a per-step breakdown of host work (vLLM's bench throughput)
    python -m dcpjax.bench throughput --model tiny-llama --num-prompts 32 --input-len 64 --output-len 128

    # against a running server (vLLM's flag names; --input-len, --output-len, ... also work):
    # a warm-up of other prompts first, then a table (--json FILE for the numbers)
    python -m dcpjax.bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 64 --num-prompts 64 --max-concurrency 32 --seed 0

    # start the server at DCP 1 and DCP k (same TP, same workload) and compare side by side
    python -m dcpjax.bench compare --tensor-parallel-size 8 --decode-context-parallel-size 2 \\
        --num-cpu-devices 8 --input-len 1024 --output-len 64 --num-prompts 64 --max-concurrency 64

    # shared prefixes: TTFT of prefix cache hits and misses, and the hit rate (vLLM's prefix_repetition)
    python -m dcpjax.bench serve --dataset-name prefix_repetition --prefix-repetition-prefix-len 4096 \\
        --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 8 \\
        --num-prompts 32 --max-concurrency 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from dcpjax.bench.serving import bench_server, served_model, start_bench_server
from dcpjax.bench.sweep import add_arguments as add_sweep_arguments
from dcpjax.bench.throughput import add_arguments as add_throughput_arguments
from dcpjax.bench.throughput import positive_int
from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli

# compare's engine defaults: a mesh where DCP 2 is valid for tiny-llama, room for prefill chunks
COMPARE_DEFAULTS = {"tensor_parallel_size": 8, "decode_context_parallel_size": 2, "max_num_batched_tokens": 512}
DATASETS = ("random", "prefix_repetition")


def _dataset(text: str) -> str:
    """vLLM's dataset names; "prefix-repetition" (this CLI's first spelling) is prefix_repetition."""
    name = text.replace("-", "_")
    if name not in DATASETS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DATASETS)})")
    return name


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags, in vLLM's spelling (`vllm bench serve`) and this CLI's shorter first one."""
    p.add_argument("--dataset-name", "--dataset", dest="dataset", type=_dataset, default="random",
                   metavar="{random,prefix_repetition}",
                   help="random: prompts of --random-input-len tokens; prefix_repetition: --prefix-repetition-num-"
                   "prefixes shared prefixes of --prefix-repetition-prefix-len tokens, each prompt one of them (round "
                   "robin) + --prefix-repetition-suffix-len tokens of its own")
    p.add_argument("--random-input-len", "--input-len", dest="input_len", metavar="N", type=positive_int, default=256)
    p.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len", metavar="N", type=positive_int,
                   default=1024)
    p.add_argument("--prefix-repetition-suffix-len", "--suffix-len", dest="suffix_len", metavar="N", type=positive_int,
                   default=64)
    p.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes", dest="num_prefixes", metavar="N",
                   type=positive_int, default=4)
    p.add_argument("--random-output-len", "--prefix-repetition-output-len", "--output-len", dest="output_len",
                   metavar="N", type=positive_int, default=32, help="tokens each request generates (EOS ignored)")
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--max-concurrency", type=positive_int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--num-warmups", type=_count, help="unmeasured requests first, to compile every shape the "
                   "measured run meets: other prompts of the same lengths at the same concurrency, the first wave at "
                   "the measured output length, later ones at random lengths up to it (default: 2 x --max-concurrency, "
                   "+ --prefix-repetition-num-prefixes for prefix_repetition, at most --num-prompts)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the subcommands (engine flags from `EngineArgs`); each takes --debug."""
    p = cli.ArgumentParser(prog="python -m dcpjax.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    throughput = sub.add_parser("throughput", help="offline generation speed and where each step's time goes")
    add_throughput_arguments(throughput)
    serve = sub.add_parser("serve", help="benchmark a running server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", help="served model name (default: the server's only model)")
    serve.add_argument("--seed", type=int, default=0, help="draws the prompts (the warm-up's from a stream of "
                       "their own) and the Poisson arrivals: another seed, other prompts (default: %(default)s)")
    add_workload_arguments(serve)
    compare = sub.add_parser("compare", help="DCP 1 vs DCP k at the same TP, same workload")
    EngineArgs.add_cli_args(compare, defaults=COMPARE_DEFAULTS)  # its --seed also draws the prompts
    add_workload_arguments(compare)
    sweep = sub.add_parser("sweep", help="staged DCP 1 vs DCP k over contexts and concurrencies: JSON, CSV, plots")
    add_sweep_arguments(sweep, COMPARE_DEFAULTS)
    for command in (throughput, serve, compare, sweep):
        cli.add_debug_flag(command)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, parsed."""
    return build_parser().parse_args(argv)


def _row(name: str, get: Callable[[dict], object], runs: list[dict], fmt: str = "{:.1f}") -> str:
    cells = [fmt.format(get(r)) if get(r) is not None else "-" for r in runs]
    return f"| {name} | " + " | ".join(cells) + " |"


def table(results: dict[str, dict]) -> str:
    """A Markdown table of `bench_server` results, one column per server."""
    runs = list(results.values())
    lines = ["| metric | " + " | ".join(results) + " |", "|---|" + "---:|" * len(runs)]
    lines += [
        _row("completed / failed", lambda r: f"{r['completed']} / {r['failed']}", runs, "{}"),
        _row("KV cache size (tokens)", lambda r: r.get("kv_cache_size_tokens"), runs, "{:,}"),
        _row("output throughput (tok/s)", lambda r: r["output_throughput"], runs),
        _row("request throughput (req/s)", lambda r: r["request_throughput"], runs, "{:.2f}"),
    ]
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("mean_ms", "median_ms", "p99_ms"):
            lines.append(_row(f"{metric.upper()} {stat.replace('_ms', '')} (ms)", lambda r, m=metric, s=stat: r[m][s],
                              runs))
    lines.append(_row("peak KV usage", lambda r: 100 * r["peak_kv_cache_usage"], runs, "{:.0f}%"))
    lines.append(_row("prefix cache hit rate", lambda r: 100 * r["prefix_cache_hit_rate"], runs, "{:.0f}%"))
    for kind in ("hit", "miss"):
        lines.append(_row(f"TTFT median, prefix {kind} (ms)", lambda r, k=kind: r[f"ttft_{k}"]["median_ms"], runs))
    return "\n".join(lines)


def workload(args: argparse.Namespace, model: str) -> str:
    """One line naming the model and the workload above a table."""
    lengths = (f"prefix {args.prefix_len} x {args.num_prefixes} + suffix {args.suffix_len}"
               if args.dataset == "prefix_repetition" else f"input {args.input_len}")
    return (f"{model}: {lengths}, output {args.output_len}, {args.num_prompts} prompts, concurrency "
            f"{args.max_concurrency}, request rate {args.request_rate}, seed {args.seed}")


def _compare(args: argparse.Namespace, headers: dict) -> dict[str, dict]:
    results = {}
    engine_args = EngineArgs.from_cli_args(args)
    for dcp in (1, args.decode_context_parallel_size):
        with start_bench_server(engine_args.with_dcp(dcp), args.api_key) as server:
            model = served_model(server.base_url, headers)
            result = bench_server(server.base_url, model["id"], args)
            result["kv_cache_size_tokens"] = model.get("kv_cache_size_tokens")
            results[f"TP {args.tensor_parallel_size} DCP {dcp}"] = result
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; exit status 1 if a request failed."""
    args = parse_args(argv)
    if args.command == "throughput":
        from dcpjax.bench import throughput

        return throughput.main(args)
    if args.command == "sweep":
        from dcpjax.bench import sweep

        return sweep.main(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.command == "serve":
        card = served_model(args.base_url, headers)  # a server that does not answer: one line, at once
        model = args.model or card["id"]
        result = bench_server(args.base_url, model, args)
        result["kv_cache_size_tokens"] = card.get("kv_cache_size_tokens")
        results = {"server": result}
    else:
        results, model = _compare(args, headers), args.model
    print(f"\n{workload(args, model)}\n")
    print(table(results))
    for name, result in results.items():
        for error in result["errors"]:
            print(f"{name}: failed request: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
