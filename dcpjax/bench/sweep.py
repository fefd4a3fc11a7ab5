"""`python -m dcpjax.bench sweep`: the article's staged verification, DCP 1 against DCP k.

Start where a configuration must work (short context, low concurrency), then raise context
and concurrency in stages; at each stage compare DCP 1 with DCP k at the same TP, the same
lengths and concurrency: TTFT (must not get worse), TPOT, ITL, output throughput, KV cache
size and peak usage, preemptions, prefix-cache hits. A stage with failed requests stops
that server's sweep with a message saying which stage and why. Writes sweep.json,
sweep.csv and, with matplotlib (`pip install -e ".[notebook]"`), the plots of
`dcpjax.bench.plots`.

    python -m dcpjax.bench sweep --num-cpu-devices 8 -tp 8 -dcp 2 \\
        --input-len 256,1024 --concurrency 1,4,16 --output-len 32 --output-dir sweep-out
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import pathlib

from dcpjax.bench.serving import bench_server, metric_value, served_model, start_bench_server
from dcpjax.engine.args import EngineArgs

CSV_FIELDS = ("server", "dcp", "input_len", "concurrency", "completed", "failed", "ttft_p50_ms", "ttft_p99_ms",
              "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_throughput", "kv_cache_size_tokens",
              "peak_kv_cache_usage", "preemptions", "prefix_cache_hit_rate", "error")


def _sizes(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser, compare_defaults: dict) -> None:
    EngineArgs.add_cli_args(p, defaults=compare_defaults)
    p.add_argument("--base-url", help="sweep this running server only (default: start DCP 1 and DCP k servers)")
    p.add_argument("--input-len", type=_sizes, default=[256, 1024], help="contexts, comma-separated (stages)")
    p.add_argument("--concurrency", type=_sizes, default=[1, 4, 16], help="concurrencies, comma-separated (stages)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-stage", type=int, help="requests per stage (default: 2 x concurrency, >= 4)")
    p.add_argument("--output-dir", default="sweep-out", help="sweep.json, sweep.csv and the PNGs go here")
    p.add_argument("--api-key")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")


def _stage_args(args, input_len: int, concurrency: int, index: int) -> argparse.Namespace:
    """Stage `index`'s workload: prompts of its own (seed --seed + index), the same at both servers;
    an earlier stage's prompts would be prefix-cache hits (98-99.8 %), which distorts its numbers."""
    stage = copy.copy(args)
    stage.seed = args.seed + index
    stage.dataset, stage.input_len, stage.max_concurrency = "random", input_len, concurrency
    stage.num_prompts = args.prompts_per_stage or max(4, 2 * concurrency)
    # serving.warmup_count's warm-up
    stage.num_warmups, stage.no_progress, stage.request_rate = None, True, float("inf")
    return stage


def sweep_server(base_url: str, label: str, dcp: int, args, headers: dict) -> list[dict]:
    """Every stage against one server, smallest first; stops at the first stage that fails."""
    card = served_model(base_url, headers)
    stages = []
    for input_len in args.input_len:
        for concurrency in args.concurrency:
            row = {"server": label, "dcp": dcp, "input_len": input_len, "concurrency": concurrency,
                   "kv_cache_size_tokens": card.get("kv_cache_size_tokens")}
            before = metric_value(base_url, "num_preemptions")
            try:
                result = bench_server(base_url, card["id"], _stage_args(args, input_len, concurrency, len(stages)))
            except Exception as err:  # noqa: BLE001 - reported as the stage's failure, the sweep stops
                result = {"failed": -1, "errors": [f"{type(err).__name__}: {err}"]}
            row |= result
            row["preemptions"] = metric_value(base_url, "num_preemptions") - before
            stages.append(row)
            if result.get("failed"):
                row["error"] = "; ".join(result.get("errors") or ["requests failed"])
                print(f"{label}: stage (context {input_len}, concurrency {concurrency}) failed: {row['error']}; "
                      "stopping this server's sweep (later stages are larger)")
                return stages
            print(f"{label}: context {input_len}, concurrency {concurrency}: "
                  f"TTFT p50 {row['ttft']['median_ms']:.1f} ms, "
                  f"TPOT p50 {row['tpot']['median_ms'] or 0:.2f} ms, {row['output_throughput']:.1f} tok/s")
    return stages


def csv_row(row: dict) -> dict:
    get = lambda metric, stat: (row.get(metric) or {}).get(stat)
    return {"server": row["server"], "dcp": row["dcp"], "input_len": row["input_len"],
            "concurrency": row["concurrency"], "completed": row.get("completed"), "failed": row.get("failed"),
            "ttft_p50_ms": get("ttft", "median_ms"), "ttft_p99_ms": get("ttft", "p99_ms"),
            "tpot_p50_ms": get("tpot", "median_ms"), "tpot_p99_ms": get("tpot", "p99_ms"),
            "itl_p50_ms": get("itl", "median_ms"), "itl_p99_ms": get("itl", "p99_ms"),
            "output_throughput": row.get("output_throughput"), "kv_cache_size_tokens": row.get("kv_cache_size_tokens"),
            "peak_kv_cache_usage": row.get("peak_kv_cache_usage"), "preemptions": row.get("preemptions"),
            "prefix_cache_hit_rate": row.get("prefix_cache_hit_rate"), "error": row.get("error", "")}


def kv_capacity(engine_args: EngineArgs) -> dict[int, int]:
    """KV tokens one replica holds at each valid DCP size, same bytes per device (the runner's layout)."""
    import jax.numpy as jnp

    from dcpjax.loader.model_source import load_model_config
    from dcpjax.runner.kv_budget import CPU_DEFAULT_KV_BYTES
    from dcpjax.runner.kv_layout import kv_cache_layout
    from dcpjax.sharding.config import ParallelConfig

    cfg = load_model_config(engine_args.model)
    tp, capacity = engine_args.tensor_parallel_size, {}
    for dcp in ParallelConfig(tp).valid_dcp_sizes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.use_mla):
        layout = kv_cache_layout(cfg, ParallelConfig(tp, dcp), block_size=engine_args.block_size,
                                 bytes_per_device=engine_args.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES,
                                 dtype=jnp.float32)
        capacity[dcp] = layout.num_blocks * engine_args.block_size * dcp
    return capacity


def main(args) -> int:
    """Run the sweep; exit status 1 if a stage failed."""
    if args.output_len < 1 or (args.prompts_per_stage is not None and args.prompts_per_stage < 1):
        raise SystemExit("--output-len and --prompts-per-stage must be >= 1")
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory_bytes is None and engine_args.num_cpu_devices:
        # CPU's default follows the host's free memory, which moves between the two servers:
        # fix the budget, so that both compare at the same KV bytes per device
        from dcpjax.runner.kv_budget import CPU_DEFAULT_KV_BYTES

        engine_args = engine_args.with_kv_bytes(CPU_DEFAULT_KV_BYTES)
    stages, capacity = [], {}
    if args.base_url:
        stages += sweep_server(args.base_url, "server", engine_args.decode_context_parallel_size, args, headers)
    else:
        for dcp in (1, engine_args.decode_context_parallel_size):
            with start_bench_server(engine_args.with_dcp(dcp), args.api_key) as server:
                stages += sweep_server(server.base_url, f"TP {engine_args.tensor_parallel_size} DCP {dcp}", dcp,
                                       args, headers)
        capacity = kv_capacity(engine_args)
    (out / "sweep.json").write_text(json.dumps({"stages": stages, "kv_capacity": capacity}, indent=1))
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(csv_row(row) for row in stages)
    if not args.no_plots:
        from dcpjax.bench.plots import draw_sweep

        for path in draw_sweep(stages, capacity, out):
            print(f"wrote {path}")
    print(f"wrote {out / 'sweep.json'} and {out / 'sweep.csv'}")
    return 1 if any(row.get("error") for row in stages) else 0
