"""`python -m dcpjax.bench throughput|serve|compare`: offline and serving benchmarks.

    # offline generation speed, with a per-step breakdown of host work (vLLM's bench throughput)
    python -m dcpjax.bench throughput --model tiny-llama --num-prompts 32 --input-len 64 --output-len 128

    # against a running server
    python -m dcpjax.bench serve --base-url http://127.0.0.1:8000 --input-len 1024 --output-len 64 \\
        --num-prompts 64 --max-concurrency 32

    # start the server at DCP 1 and DCP k (same TP, same workload) and compare side by side
    python -m dcpjax.bench compare --tensor-parallel-size 8 --decode-context-parallel-size 2 \\
        --num-cpu-devices 8 --input-len 1024 --output-len 64 --num-prompts 64 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from dcpjax.bench.client import run_benchmark
from dcpjax.bench.throughput import add_arguments as add_throughput_arguments


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--num-warmups", type=int, help="unmeasured requests first, to compile every shape "
                   "(default: max-concurrency)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dcpjax.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    throughput = sub.add_parser("throughput", help="offline generation speed and where each step's time goes")
    add_throughput_arguments(throughput)
    serve = sub.add_parser("serve", help="benchmark a running server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", help="served model name (default: the server's only model)")
    _workload_args(serve)
    compare = sub.add_parser("compare", help="DCP 1 vs DCP k at the same TP, same workload")
    compare.add_argument("--model", default="tiny-llama")
    compare.add_argument("--tensor-parallel-size", "-tp", type=int, default=8)
    compare.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=2)
    compare.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    compare.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    compare.add_argument("--kv-cache-memory-bytes", type=int)
    compare.add_argument("--max-model-len", type=int)
    compare.add_argument("--max-num-seqs", type=int, default=64)
    compare.add_argument("--max-num-batched-tokens", type=int, default=512)
    compare.add_argument("--num-cpu-devices", type=int, default=0)
    _workload_args(compare)
    return p.parse_args(argv)


def _model_name(base_url: str, headers: dict) -> str:
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _bench(base_url: str, model: str, args) -> dict:
    warmups = args.max_concurrency if args.num_warmups is None else args.num_warmups
    if warmups:
        asyncio.run(run_benchmark(
            base_url, model, input_len=args.input_len, output_len=min(args.output_len, 4), num_prompts=warmups,
            max_concurrency=args.max_concurrency, api_key=args.api_key, progress=False, seed=1,
        ))
    return asyncio.run(run_benchmark(
        base_url, model, input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate, api_key=args.api_key,
        progress=not args.no_progress,
    ))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args, dcp: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "dcpjax.serve", "--model", args.model, "--port", str(port),
               "-tp", str(args.tensor_parallel_size), "-dcp", str(dcp), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if dcp > 1:
        command += ["--cp-kv-cache-interleave-size", str(args.cp_kv_cache_interleave_size),
                    "--dcp-comm-backend", args.dcp_comm_backend]
    for flag, value in (("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
                        ("--max-model-len", args.max_model_len), ("--num-cpu-devices", args.num_cpu_devices or None),
                        ("--api-key", args.api_key)):
        if value is not None:
            command += [flag, str(value)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=1)
            return proc, base
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"server (DCP {dcp}) exited:\n{proc.stderr.read()[-3000:]}")
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server (DCP {dcp}) did not start in 300 s")


def _row(name, get, runs, fmt="{:.1f}"):
    cells = [fmt.format(get(r)) if get(r) is not None else "-" for r in runs]
    return f"| {name} | " + " | ".join(cells) + " |"


def table(results: dict) -> str:
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
            lines.append(_row(f"{metric.upper()} {stat.replace('_ms', '')} (ms)", lambda r, m=metric, s=stat: r[m][s], runs))
    lines.append(_row("peak KV usage", lambda r: 100 * r["peak_kv_cache_usage"], runs, "{:.0f}%"))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "throughput":
        from dcpjax.bench import throughput

        return throughput.main(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.command == "serve":
        result = _bench(args.base_url, args.model or _model_name(args.base_url, headers), args)
        print(json.dumps(result, indent=1))
        results = {"server": result}
    else:
        results = {}
        for dcp in (1, args.decode_context_parallel_size):
            proc, base = _start_server(args, dcp)
            try:
                name = _model_name(base, headers)
                result = _bench(base, name, args)
                result["kv_cache_size_tokens"] = _kv_cache_tokens(base, headers)
                results[f"TP {args.tensor_parallel_size} DCP {dcp}"] = result
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        print(f"\n{args.model}: input {args.input_len}, output {args.output_len}, {args.num_prompts} prompts, "
              f"concurrency {args.max_concurrency}, request rate {args.request_rate}\n")
        print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


def _kv_cache_tokens(base: str, headers: dict) -> int | None:
    request = urllib.request.Request(f"{base}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        data = json.loads(response.read())["data"][0]
    return data.get("kv_cache_size_tokens")


if __name__ == "__main__":
    sys.exit(main())
