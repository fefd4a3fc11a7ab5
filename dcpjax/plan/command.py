"""Memory plan of a deployment: weights and KV cache per device, and the KV capacity; or, with
--model, every DCP size of a model at a TP with its traffic, a roofline and a recommendation.

    python -m dcpjax.plan configs/qwen3-235b-a22b-tp8-dcp2.json [...]
    python -m dcpjax.plan --model FOLDER_OR_CONFIG -tp 8 --device h200 --interconnect nvlink \\
        --input-len 32768 --output-len 1024 --concurrency 64 [--json]

A deployment file names a model (its Hugging Face config.json fields), the
parallel configuration, and the device (memory in bytes, utilisation). The plan
is computed by the library from the model it would build: every parameter's
per-device shard from its logical axes, and the KV bytes per block from the same
layout the runner allocates. Nothing is typed in. Given to --model, a deployment
file's tensor_parallel_size, weight_dtype, kv_cache_dtype, block_size, device memory
and memory_utilization are the defaults; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import jax.numpy as jnp

from dcpjax.engine.preflight import expert_parallel_problem, max_model_len_problem
from dcpjax.entrypoints import cli
from dcpjax.loader.model_source import load_model_config, resolve
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import layout_problems
from dcpjax.plan import disaggregation, experts, planner
from dcpjax.plan.deployment import (
    DTYPES,
    GB,
    KV_DTYPES,
    WEIGHT_DTYPES,
    check_deployment,
    deployment_model,
    deployment_parallel,
    kv_dtype,
    load_json,
    markdown_rows,
    weight_bytes_per_device,
)
from dcpjax.sharding.config import ParallelConfig

DEFAULT_TP, DEFAULT_DEVICE, DEFAULT_INPUT_LEN = 8, "h200", 8192


def model_and_defaults(name: str) -> tuple[ModelConfig, dict]:
    """--model's config, and the settings its deployment file sets ({} for any other model): of
    tensor_parallel_size, enable_expert_parallel, weight_dtype, kv_cache_dtype, block_size, memory_gb,
    memory_utilization."""
    kind, path = resolve(name)
    data = load_json(path) if kind == "json" else None
    if kind != "json" or isinstance(data, dict) and "architectures" in data:  # a model's own config
        try:
            return load_model_config(name), {}
        except KeyError as err:
            raise ValueError(f"{name}: the config has no {err.args[0]!r} field") from None
    data = check_deployment(data, path, required=("model",))
    defaults = {key: data[key] for key in ("weight_dtype", "kv_cache_dtype", "block_size", "memory_utilization")
                if key in data}
    if "parallel" in data:
        parallel = deployment_parallel(data, path)
        defaults["tensor_parallel_size"] = parallel.tp
        if parallel.enable_expert_parallel:  # off is the default anyway: not named as the file's
            defaults["enable_expert_parallel"] = True
    if "device_memory_bytes" in data:
        defaults["memory_gb"] = data["device_memory_bytes"] / GB
    return deployment_model(data, path), defaults


def plan_row(cfg: ModelConfig, pc: ParallelConfig, weight_dtype: str, setup: dict) -> dict:
    """`planner.plan_size` of one parallel configuration; `setup`: its other arguments."""
    problems = layout_problems(cfg, pc)
    weights = 0 if problems else weight_bytes_per_device(cfg, pc, weight_dtype)
    return planner.plan_size(cfg, pc, weight_bytes=weights, problems=problems, weight_dtype=weight_dtype, **setup)


def plan_rows(cfg: ModelConfig, tp: int, weight_dtype: str, setup: dict, expert_parallel: bool = False) -> list[dict]:
    """`plan_row` of every DCP size (each divisor of `tp`)."""
    return [plan_row(cfg, ParallelConfig(tp, dcp, enable_expert_parallel=expert_parallel), weight_dtype, setup)
            for dcp in range(1, tp + 1) if tp % dcp == 0]


def default_tp(cfg: ModelConfig) -> tuple[int, str | None]:
    """The TP when neither -tp nor a deployment file gives one: DEFAULT_TP if the model's heads
    allow it, else the allowed TP nearest to it (ties: the smaller), with why (None: DEFAULT_TP)."""
    allowed = planner.allowed_tps(cfg)
    if DEFAULT_TP in allowed or not allowed:  # no TP at all: DEFAULT_TP's rows say why
        return DEFAULT_TP, None
    tp = min(allowed, key=lambda t: (abs(t - DEFAULT_TP), t))
    heads = (f"does not divide the {cfg.num_attention_heads} query heads" if cfg.num_attention_heads % DEFAULT_TP
             else f"does not split the {cfg.num_key_value_heads} KV heads evenly")
    return tp, f"the default {DEFAULT_TP} {heads}; they allow TP {', '.join(map(str, allowed))}"


def longest_sequence(cfg: ModelConfig) -> int:
    """The most tokens (input + output) one sequence may have on this model: the end of the range
    [2, n] of max_model_len the engine accepts, found with the engine's own rule
    (`max_model_len_problem`: the model's positions, or a sliding window dcpjax does not implement)."""
    low, high = 2, cfg.max_position_embeddings
    while low < high:  # the accepted lengths are one range: bisect for its end
        mid = (low + high + 1) // 2
        low, high = (low, mid - 1) if max_model_len_problem(mid, cfg) else (mid, high)
    return low


def plan_workload(args: argparse.Namespace, cfg: ModelConfig) -> tuple[planner.Workload, str | None]:
    """The workload to plan and, when the default --input-len was lowered to fit the model, why.
    ValueError: a sequence longer than the engine runs this model at (it would refuse max_model_len)."""
    longest, note = longest_sequence(cfg), None
    input_len = args.input_len
    if input_len is None:
        input_len = max(1, min(DEFAULT_INPUT_LEN, longest - args.output_len))
        if input_len < DEFAULT_INPUT_LEN:
            note = f"the default input {DEFAULT_INPUT_LEN} lowered so a sequence fits the model's {longest:,} tokens"
    total = input_len + args.output_len
    if problem := max_model_len_problem(total, cfg):
        raise ValueError(f"a sequence of {input_len} in + {args.output_len} out = {total:,} tokens is more than the "
                         f"engine runs this model at ({problem}): lower --input-len or --output-len so they add up "
                         f"to at most {longest:,}")
    return planner.Workload(input_len, args.output_len, args.concurrency), note


def _setting(args: argparse.Namespace, file: dict, key: str, default: object) -> object:
    """The flag if given, else the deployment file's value, else `default`."""
    flag = getattr(args, key)
    return flag if flag is not None else file.get(key, default)


def _from_file(args: argparse.Namespace, file: dict) -> list[str]:
    """The deployment file's settings no flag overrode (its memory: neither --memory-gb nor --device)."""
    overridden = {k: getattr(args, k, None) is not None for k in file} | {
        "memory_gb": args.memory_gb is not None or args.device is not None}
    return sorted(k for k in file if not overridden[k])


def plan_model(args: argparse.Namespace) -> dict:
    """Every DCP size of --model at its TP, the recommendation, and what would fit if nothing does."""
    try:
        cfg, file = model_and_defaults(args.model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    tp, tp_note = _setting(args, file, "tensor_parallel_size", None), None
    if tp is None:
        tp, tp_note = default_tp(cfg)
    work, input_note = plan_workload(args, cfg)
    weight_dtype = _setting(args, file, "weight_dtype", "float8_e4m3fn" if cfg.quantization else args.dtype)
    kv_name = _setting(args, file, "kv_cache_dtype", "bfloat16")
    device = planner.DEVICES[args.device or DEFAULT_DEVICE]
    memory = args.memory_gb or (file.get("memory_gb") if args.device is None else None)  # --device: its preset
    device = dataclasses.replace(device, memory_gb=memory or device.memory_gb,
                                 hbm_tbps=args.hbm_tbps or device.hbm_tbps)
    link = planner.LINKS[args.interconnect or device.link]
    link = dataclasses.replace(link, gbps=args.link_gbps or link.gbps,
                               latency_us=args.link_latency_us or link.latency_us)
    setup = dict(device=device, link=link, workload=work, kv_dtype=kv_dtype(kv_name),
                 block_size=_setting(args, file, "block_size", 16), q_bytes=jnp.dtype(args.dtype).itemsize,
                 utilization=_setting(args, file, "memory_utilization", 0.9))
    ep = _setting(args, file, "enable_expert_parallel", False)
    if problem := expert_parallel_problem(ParallelConfig(tp, enable_expert_parallel=ep), cfg):
        raise ValueError(problem)
    prefill_pc = args.prefill_tp and disaggregation.prefill_config(cfg, args.prefill_tp, args.prefill_dcp, ep)
    rows = plan_rows(cfg, tp, weight_dtype, setup, ep)
    choice, reasons = planner.recommend(cfg, rows, link, work)
    alternatives = [] if choice is not None else planner.what_would_fit(
        cfg, rows, weight_dtype=weight_dtype, workload=work,
        rows_at=lambda t, w: plan_rows(cfg, t, w, setup, ep))
    chosen = next((r for r in rows if r["dcp"] == choice), None)
    expert_plan = plan_experts(cfg, chosen, tp, weight_dtype, setup, ep) if chosen and cfg.sparse_layers else None
    pd_plan = plan_disaggregation(args, cfg, chosen, prefill_pc, weight_dtype, setup) if chosen and prefill_pc else None
    reasons = [*reasons, *(section["reason"] for section in (expert_plan, pd_plan) if section)]
    return {"model": args.model, "tp": tp, "weight_dtype": weight_dtype, "kv_cache_dtype": kv_name,
            "block_size": setup["block_size"], "memory_utilization": setup["utilization"],
            "from_file": _from_file(args, file), "enable_expert_parallel": ep,
            "adjusted_defaults": {key: note for key, note in (("tensor_parallel_size", tp_note),
                                                              ("input_len", input_note)) if note},
            "device": dataclasses.asdict(device), "link": dataclasses.asdict(link),
            "workload": dataclasses.asdict(work), "sizes": rows, "recommended_dcp": choice,
            "recommended_comm_backend": planner.fastest_backend(chosen) if chosen else None, "reasons": reasons,
            "not_recommended": planner.not_recommended(rows, choice),
            "what_would_fit": alternatives, "experts": expert_plan, "disaggregation": pd_plan}


def plan_disaggregation(args: argparse.Namespace, cfg: ModelConfig, row: dict, pc: ParallelConfig, weight_dtype: str,
                        setup: dict) -> dict:
    """One engine against a P/D pair at the recommended row (`plan.disaggregation`): the prefill
    instance planned like a table row, holding one prompt."""
    work = setup["workload"]
    prefill_row = plan_row(cfg, pc, weight_dtype, setup | {"workload": planner.Workload(work.input_len, 1, 1)})
    return disaggregation.plan(cfg, row, prefill_row, work=work, kv_dtype=setup["kv_dtype"],
                               device=args.device or DEFAULT_DEVICE, tflops=args.prefill_tflops,
                               link_gbps=args.kv_link_gbps, max_tpot_ms=args.max_tpot_ms)


def plan_experts(cfg: ModelConfig, row: dict, tp: int, weight_dtype: str, setup: dict, planned: bool) -> dict:
    """Tensor-parallel experts against EP at the recommended row (`plan.experts`), each planned as
    a table row (the layout the table was `planned` with is `row` itself), the choice, and by how
    much the table's layout lost when it is not the choice."""
    other = plan_row(cfg, ParallelConfig(tp, row["dcp"], enable_expert_parallel=not planned), weight_dtype, setup)
    by_layout = {planned: row, not planned: other}
    rows = experts.compare(cfg, [by_layout[False], by_layout[True]], tp=tp, act_bytes=setup["q_bytes"])
    recommended, reason = experts.choose(rows)
    lost = experts.overruled(rows, planned, recommended)
    return {"batch": row["batch"], "rows": rows, "planned_expert_parallel": planned,
            "recommended_expert_parallel": recommended, "overruled": lost,
            "reason": f"{reason}; {lost['text']}" if lost else reason}


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m dcpjax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", help="deployment JSON files (see configs/)")
    p.add_argument("--model", help="a Hugging Face folder, a config.json, a deployment file or a built-in model: "
                                   "plan every DCP size (default: none, plan the deployment files given)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int,
                   help=f"devices of one replica (default: a deployment file's, else {DEFAULT_TP}, or the TP "
                        f"nearest {DEFAULT_TP} that the model's heads allow when they do not allow {DEFAULT_TP})")
    p.add_argument("--device", choices=sorted(planner.DEVICES),
                   help=f"device preset (default: {DEFAULT_DEVICE}, with a deployment file's memory)")
    p.add_argument("--memory-gb", type=float, help="device memory (default: a deployment file's, else the preset's)")
    p.add_argument("--memory-utilization", type=float,
                   help="share of device memory for weights and KV (default: a deployment file's, else 0.9)")
    p.add_argument("--hbm-tbps", type=float, help="memory bandwidth in TB/s (default: the preset's)")
    links = ", ".join(f"{name} {d.link}" for name, d in sorted(planner.DEVICES.items()))
    p.add_argument("--interconnect", choices=sorted(planner.LINKS),
                   help=f"link preset (default: the device's: {links})")
    p.add_argument("--link-gbps", type=float, help="GB/s a device receives (default: the preset's)")
    p.add_argument("--link-latency-us", type=float, help="us per collective (default: the preset's)")
    p.add_argument("--input-len", type=int,
                   help=f"prompt tokens per sequence (default: {DEFAULT_INPUT_LEN}, or less so that input + output "
                        "fit the model's max_position_embeddings)")
    p.add_argument("--output-len", type=int, default=512, help="generated tokens per sequence (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="sequences decoded at once (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="activations, queries on the wire (default: %(default)s)")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES,
                   help="weights as the engine holds them, float8_e4m3fn: fp8 block-scaled (--quantization fp8) "
                   "(default: a deployment file's, else float8_e4m3fn for a model whose config ships fp8, "
                   "else --dtype)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES,
                   help="KV cache entries (default: a deployment file's, else bfloat16)")
    p.add_argument("--block-size", type=int, help="KV tokens per block (default: a deployment file's, else 16)")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="plan the table with routed experts whole over the TP devices (MoE models; default: a "
                        "deployment file's; the experts section compares both either way)")
    p.add_argument("--prefill-tp", type=int, help="compare one engine with a prefill/decode pair whose prefill "
                   "instance runs at this TP (default: none, no comparison)")
    p.add_argument("--prefill-dcp", type=int, default=1, help="the prefill instance's DCP (default: %(default)s)")
    p.add_argument("--kv-link-gbps", type=float, default=disaggregation.DEFAULT_KV_LINK_GBPS,
                   help="GB/s between the prefill and decode instances for the KV, 25: a 200 Gb/s NIC "
                        "(default: %(default)s)")
    tflops = ", ".join(f"{name} {peak:g}" for name, (peak, _) in sorted(disaggregation.PEAK_TFLOPS.items()))
    p.add_argument("--prefill-tflops", type=float, help=f"dense bf16 TFLOP/s per device for prefill (default: the "
                   f"device's peak: {tflops})")
    p.add_argument("--max-tpot-ms", type=float, help="with --prefill-tp: a target ms per output token (an SLO): "
                   "the set-up that alone meets it is picked (default: none, tokens/s per device decides)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: a table)")
    cli.add_debug_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is None and not args.configs:
        p.error("give deployment files, or --model to plan every DCP size")
    for name in ("tensor_parallel_size", "input_len", "output_len", "concurrency", "block_size", "prefill_tp",
                 "prefill_dcp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.memory_utilization is not None and not 0 < args.memory_utilization <= 1:
        p.error("--memory-utilization must be in (0, 1]")
    if args.kv_link_gbps <= 0 or any(v is not None and v <= 0 for v in (args.prefill_tflops, args.max_tpot_ms)):
        p.error("--kv-link-gbps, --prefill-tflops and --max-tpot-ms must be > 0")
    if args.configs:
        print("\n".join(markdown_rows(args.configs)))
    if args.model is not None:
        plan = plan_model(args)
        print(json.dumps(plan, indent=1, default=str) if args.json else
              planner.plan_table(plan, sections=[*experts.table_lines(plan), *disaggregation.table_lines(plan)]))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
