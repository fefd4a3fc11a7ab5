"""`bench serve` against a prefill/decode pair behind the router vs one engine, same devices in total.

    # tiny-llama on 8 fake CPU devices: TP 8 / DCP 2 vs prefill TP 4 + decode TP 4 / DCP 2 (under a minute)
    python benchmarks/disaggregation.py
    python benchmarks/disaggregation.py --model tiny-llama --num-devices 8 --single-tp 8 --single-dcp 2 \
        --prefill-tp 4 --prefill-dcp 1 --decode-tp 4 --decode-dcp 2 --decode-interleave 1 \
        --input-len 128 --output-len 32 --num-prompts 64 --max-concurrency 16 --json disaggregation.json
    # smoke (about half a minute)
    python benchmarks/disaggregation.py --num-prompts 4 --input-len 32 --output-len 8 --no-progress

First one engine on all N devices (`python -m dcpjax.serve`, TP `--single-tp`, DCP `--single-dcp`)
serves `python -m dcpjax.bench serve`'s workload (`dcpjax.bench.serving.bench_server`: the same
warm-up, then the measured run; the same workload flags). It stops; then a prefill server
(kv_producer, `--prefill-tp` devices), a decode server (kv_consumer, `--decode-tp` devices at DCP
`--decode-dcp`) and `python -m dcpjax.serve.router` in front serve the same workload. The table
puts the two side by side with the pair's KV transfers from the servers' /metrics: how many, the
bytes per request (next to the prompt's analytic KV size,
`dcpjax.plan.disaggregation.bytes_per_request`) and the mean seconds per transfer. The transfer
rows count the warm-up's requests too (bench_server runs warm-up and measured run in one call).
The servers run as users run them: on CPU without the start-up precompile (the warm-up compiles
the shapes); `--server-args=--no-enforce-eager` precompiles (minutes per server on a few cores).
The warm-up is sized for one engine: the decode server's requests arrive in the bursts the prefill
server releases them in, so on a cold compilation cache a small run's P/D TTFT can include a
decode batch size compiled on first use; raise --num-warmups then.

What it shows on fake CPU devices, and what it does not: every "device" of the three processes
shares this host's few cores, so the pair's two engines compete for the CPUs one engine has to
itself, the KV moves over loopback TCP, and none of the wall-clock numbers (throughput, TTFT,
TPOT, transfer seconds) says anything about GPUs or whether disaggregation pays on them
(`python -m dcpjax.plan --prefill-tp N` estimates that). What it does show: the P/D path holds
under concurrent load (every request completes, each one's KV arrives), each request moves
exactly its prompt's analytic KV bytes, and how long a transfer takes next to a decode step
(mean TPOT) of the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families

from dcpjax.bench.__main__ import add_workload_arguments, workload
from dcpjax.bench.serving import bench_server, served_model, warmup_count
from dcpjax.entrypoints import cli
from dcpjax.loader.model_source import load_model_config
from dcpjax.plan.disaggregation import bytes_per_request
from dcpjax.serve.process.launch import ServerProcess, free_port, server_env, start_server
from dcpjax.sharding.config import ParallelConfig

STARTUP_TIMEOUT = 300.0  # seconds for a server's /health on a loaded 2-core host
METRICS_SETTLE = 10.0  # an idle server refreshes /metrics every half second; allow a few refreshes


def build_parser() -> argparse.ArgumentParser:
    """`bench serve`'s workload flags (its defaults scaled to a short CPU run) and the two layouts."""
    p = cli.ArgumentParser(prog="python benchmarks/disaggregation.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts (as bench serve's --seed)")
    p.add_argument("--num-devices", type=int, default=8, help="devices in total, for each of the two setups")
    p.add_argument("--single-tp", type=int, help="the one engine's TP (default: --num-devices)")
    p.add_argument("--single-dcp", type=int, default=2)
    p.add_argument("--prefill-tp", type=int, help="the prefill server's TP (default: half of --num-devices)")
    p.add_argument("--prefill-dcp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, help="the decode server's TP (default: the devices left)")
    p.add_argument("--decode-dcp", type=int, default=2)
    p.add_argument("--decode-interleave", type=int, default=1, help="the decode server's "
                   "--cp-kv-cache-interleave-size")
    p.add_argument("--max-model-len", type=int, help="every server's (default: the workload's longest request, "
                   "rounded up to 256)")
    p.add_argument("--server-args", default="", help="more flags for all three servers, with '=' as they start "
                   "with '--': --server-args='--no-enforce-eager --max-num-seqs 16'")
    add_workload_arguments(p)
    p.set_defaults(input_len=128, output_len=32, num_prompts=64, max_concurrency=16)
    cli.add_debug_flag(p)
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with the layouts' defaults filled in and P + D = N checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    n = args.num_devices
    args.single_tp = args.single_tp or n
    args.prefill_tp = args.prefill_tp or n // 2
    args.decode_tp = args.decode_tp or n - args.prefill_tp
    if args.single_tp != n or args.prefill_tp + args.decode_tp != n:
        parser.error(f"the same devices in total: --single-tp ({args.single_tp}) and --prefill-tp + --decode-tp "
                     f"({args.prefill_tp} + {args.decode_tp}) must both be --num-devices ({n})")
    if problems := layout_problems(args):
        parser.error("; ".join(problems))
    prompt = args.prefix_len + args.suffix_len if args.dataset == "prefix_repetition" else args.input_len
    args.max_model_len = args.max_model_len or 256 * math.ceil((prompt + args.output_len + 1) / 256)
    return args


def layout_problems(args: argparse.Namespace) -> list[str]:
    """The TP / DCP rules against the model's heads for the three layouts, before any server starts
    (the pair's mistake would otherwise surface only after the one engine's run)."""
    cfg = load_model_config(args.model)
    problems = []
    for name, tp, dcp in (("single", args.single_tp, args.single_dcp), ("prefill", args.prefill_tp, args.prefill_dcp),
                          ("decode", args.decode_tp, args.decode_dcp)):
        for rule in ParallelConfig(tp, dcp).model_rule_violations(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                                  use_mla=cfg.use_mla):
            problems.append(f"--{name}-tp {tp} --{name}-dcp {dcp}: {rule}")
    return problems


def server_args(args: argparse.Namespace, tp: int, dcp: int, interleave: int = 1,
                role: str | None = None) -> list[str]:
    """`python -m dcpjax.serve`'s arguments for one server on `tp` fake CPU devices."""
    out = [args.model, "--num-cpu-devices", str(tp), "-tp", str(tp), "-dcp", str(dcp),
           "--max-model-len", str(args.max_model_len), *shlex.split(args.server_args)]
    if interleave != 1:
        out += ["--cp-kv-cache-interleave-size", str(interleave)]
    if role is not None:  # port 0: the producer's transfer port is picked by the system, and advertised
        config = {"kv_role": role, "kv_port": 0} if role == "kv_producer" else {"kv_role": role}
        out += ["--kv-transfer-config", json.dumps(config)]
    return out + (["--api-key", args.api_key] if args.api_key else [])


def router_args(prefill: str, decode: str, port: int, api_key: str | None) -> list[str]:
    return ["--prefill", prefill, "--decode", decode, "--port", str(port)] + (["--api-key", api_key] if api_key
                                                                              else [])


@contextmanager
def start_router(args: list[str], port: int) -> Iterator[ServerProcess]:
    """`python -m dcpjax.serve.router ARGS` on `port`, healthy (its /health asks both backends)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 (ServerProcess.stop closes it)
    proc = subprocess.Popen([sys.executable, "-m", "dcpjax.serve.router", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=server_env())
    router = ServerProcess([proc], [log], f"http://127.0.0.1:{port}")  # its /health, its failure tail, its stop
    try:
        router.wait_healthy(60.0)
        yield router
    finally:
        router.stop()


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of `base_url`/metrics by name (`name[outcome]` for labelled outcomes), summed
    over the other labels (the model name)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['outcome']}]" if "outcome" in s.labels else "")
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def mean_of(samples: dict[str, float], histogram: str) -> float | None:
    count = samples.get(f"{histogram}_count", 0.0)
    return samples[f"{histogram}_sum"] / count if count else None


def count(samples: dict[str, float], outcome: str) -> int:
    return int(samples.get(f"dcpjax:kv_transfers_total[{outcome}]", 0))


def transfers(prefill: str, decode: str, router: str, expected: int) -> dict:
    """The pair's transfer counters once the decode server has counted every request (received,
    released: a first token that ended it, or failed) and the prefill server every pull it served
    (the servers refresh /metrics on their own schedule), or after METRICS_SETTLE seconds."""
    deadline = time.monotonic() + METRICS_SETTLE
    while True:
        p, d = scrape(prefill), scrape(decode)
        settled = sum(count(d, o) for o in ("received", "released", "failed")) >= expected \
            and count(p, "sent") >= count(d, "received")
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    r = scrape(router)
    outcomes = {f"{side}_{o}": count(s, o) for side, s, names in
                (("prefill", p, ("sent", "expired")), ("decode", d, ("received", "released", "failed")))
                for o in names}
    return {**outcomes, "expected": expected,
            "prefill_bytes": p.get("dcpjax:kv_transfer_bytes_total", 0.0),
            "decode_bytes": d.get("dcpjax:kv_transfer_bytes_total", 0.0),
            "decode_mean_s": mean_of(d, "dcpjax:kv_transfer_seconds"),
            "prefill_mean_s": mean_of(p, "dcpjax:kv_transfer_seconds"),
            "router_prefill_hop_mean_s": mean_of(r, "dcpjax_router_prefill_seconds"),
            "router_ok": int(r.get("dcpjax_router_requests_total[ok]", 0))}


def measure(base_url: str, args: argparse.Namespace) -> dict:
    """`bench serve` against `base_url`: its warm-up, then the measured run."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return bench_server(base_url, served_model(base_url, headers)["id"], args)


def run_single(args: argparse.Namespace) -> dict:
    command = server_args(args, args.single_tp, args.single_dcp)
    print(f"one engine: python -m dcpjax.serve {shlex.join(command)}", flush=True)
    with start_server(command, timeout=STARTUP_TIMEOUT) as server:
        return measure(server.base_url, args)


def run_pair(args: argparse.Namespace) -> dict:
    """The same workload through the router; the transfers of warm-up and measured requests."""
    prefill = server_args(args, args.prefill_tp, args.prefill_dcp, role="kv_producer")
    decode = server_args(args, args.decode_tp, args.decode_dcp, args.decode_interleave, role="kv_consumer")
    print(f"prefill:    python -m dcpjax.serve {shlex.join(prefill)}", flush=True)
    print(f"decode:     python -m dcpjax.serve {shlex.join(decode)}", flush=True)
    with start_server(prefill, timeout=STARTUP_TIMEOUT) as p, start_server(decode, timeout=STARTUP_TIMEOUT) as d:
        port = free_port()
        router = router_args(p.base_url, d.base_url, port, args.api_key)
        print(f"router:     python -m dcpjax.serve.router {shlex.join(router)}", flush=True)
        with start_router(router, port) as r:
            result = measure(r.base_url, args)
            ok = result["completed"] + (warmup_count(args) if result["failed"] == 0 else 0)
            result["transfers"] = transfers(p.base_url, d.base_url, r.base_url, ok)
    return result


def analytic_bytes(args: argparse.Namespace, result: dict) -> float | None:
    """The prompt's KV as the producer sends it (float32: the 'auto' KV dtype on CPU), per request."""
    if not result["completed"] or args.dataset != "random":
        return None
    tokens = result["prompt_tokens"] / result["completed"]  # every random prompt has the same length
    return bytes_per_request(load_model_config(args.model), "float32", round(tokens))


# label, summary key, format, whether the P/D / one ratio means something
ROWS = [
    ("completed / failed", "completed", "{}", False),
    ("duration (s)", "duration_s", "{:.1f}", True),
    ("request throughput (req/s)", "request_throughput", "{:.2f}", True),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}", True),
    ("TTFT mean (ms)", "ttft_mean", "{:.1f}", True),
    ("TTFT median (ms)", "ttft_median", "{:.1f}", True),
    ("TTFT p99 (ms)", "ttft_p99", "{:.1f}", True),
    ("TPOT mean (ms)", "tpot_mean", "{:.1f}", True),
    ("TPOT median (ms)", "tpot_median", "{:.1f}", True),
    ("KV transfers sent / received / released (warm-ups incl.)", "transfers", "{}", False),
    ("KV bytes per request", "bytes_per_request", "{:,.0f}", False),
    ("KV bytes per request, analytic", "analytic_bytes", "{:,.0f}", False),
    ("transfer mean, decode side: pull + re-shard (ms)", "decode_transfer_ms", "{:.2f}", False),
    ("transfer mean, prefill side: send to ack (ms)", "prefill_transfer_ms", "{:.2f}", False),
    ("router prefill hop mean (ms)", "router_prefill_ms", "{:.1f}", False),
    ("decode-side transfer / TPOT mean", "transfer_per_step", "{:.2f}", False),
]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def summary(args: argparse.Namespace, result: dict) -> dict[str, float | str | None]:
    """One setup's values of the table (the transfer rows: None for the one engine)."""
    out = {"completed": f"{result['completed']} / {result['failed']}", "duration_s": result["duration_s"],
           "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
           "ttft_mean": result["ttft"]["mean_ms"], "ttft_median": result["ttft"]["median_ms"],
           "ttft_p99": result["ttft"]["p99_ms"], "tpot_mean": result["tpot"]["mean_ms"],
           "tpot_median": result["tpot"]["median_ms"]}
    t = result.get("transfers")
    if t is None:
        return out
    step = result["tpot"]["mean_ms"]
    decode_ms = _ms(t["decode_mean_s"])
    return out | {
        "transfers": f"{t['prefill_sent']} / {t['decode_received']} / {t['decode_released']}",
        "bytes_per_request": t["decode_bytes"] / t["decode_received"] if t["decode_received"] else None,
        "analytic_bytes": analytic_bytes(args, result), "decode_transfer_ms": decode_ms,
        "prefill_transfer_ms": _ms(t["prefill_mean_s"]), "router_prefill_ms": _ms(t["router_prefill_hop_mean_s"]),
        "transfer_per_step": decode_ms / step if decode_ms is not None and step else None}


def table(args: argparse.Namespace, results: dict[str, dict]) -> str:
    """Markdown: one column per setup, and the pair's value over the one engine's."""
    (single_name, single), (pair_name, pair) = ((name, summary(args, r)) for name, r in results.items())
    lines = [f"| metric | {single_name} | {pair_name} | P/D / one |", "|---|---:|---:|---:|"]
    for label, key, fmt, ratio in ROWS:
        a, b = single.get(key), pair.get(key)
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b)]
        quotient = f"{b / a:.2f}" if ratio and a and b is not None else ""
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {quotient} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Both setups, one after the other; exit status 1 if a request failed."""
    args = parse_args(argv)
    started = time.monotonic()
    given = sys.argv[1:] if argv is None else list(argv)
    print(f"$ {shlex.join(['python', 'benchmarks/disaggregation.py', *given])}\n", flush=True)
    single_name = f"one engine: TP {args.single_tp} DCP {args.single_dcp}"
    pair_name = (f"P/D: TP {args.prefill_tp} DCP {args.prefill_dcp} -> TP {args.decode_tp} DCP {args.decode_dcp}"
                 + (f" I{args.decode_interleave}" if args.decode_interleave != 1 else ""))
    results = {single_name: run_single(args), pair_name: run_pair(args)}
    print(f"\n{workload(args, args.model)}; {args.num_devices} fake CPU devices in each setup, max-model-len "
          f"{args.max_model_len}, {warmup_count(args)} warm-up requests first\n")
    print(table(args, results))
    print(f"\nwall time {time.monotonic() - started:.0f} s (server starts included)")
    for name, result in results.items():
        for error in result["errors"]:
            print(f"{name}: failed request: {error}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "debug")}
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": results}, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
