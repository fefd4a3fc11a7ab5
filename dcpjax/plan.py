"""Memory plan of a deployment: weights and KV cache per device, and the KV capacity; or, with
--model, every DCP size of a model at a TP with its traffic, a roofline and a recommendation.

    python -m dcpjax.plan configs/qwen3-235b-a22b-tp8-dcp2.json [...]
    python -m dcpjax.plan --model FOLDER_OR_CONFIG -tp 8 --device h200 --interconnect nvlink \\
        --input-len 32768 --output-len 1024 --concurrency 64 [--json]

A deployment file names a model (its Hugging Face config.json fields), the
parallel configuration, and the device (memory in bytes, utilisation). The plan
is computed by the library from the model it would build: every parameter's
per-device shard from its logical axes, and the KV bytes per block from the same
layout the runner allocates. Nothing is typed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import jax.numpy as jnp
from flax import nnx

from dcpjax.config import ParallelConfig
from dcpjax.model_source import load_model_config
from dcpjax.models.config import ModelConfig
from dcpjax.runner import build_model, kv_cache_layout, layout_problems
from dcpjax.sharding.mesh import mesh_ways

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str
    model: ModelConfig
    parallel: ParallelConfig
    device_memory_bytes: float
    memory_utilization: float = 0.9
    weight_dtype: str = "bfloat16"  # as the checkpoint ships (DeepSeek-V3 / Kimi-K2: float8_e4m3fn)
    kv_cache_dtype: str = "bfloat16"
    block_size: int = 16
    hosts: int = 1

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> Deployment:
        data = json.loads(pathlib.Path(path).read_text())
        return cls(
            name=data["name"], model=ModelConfig.from_hf(data["model"]),
            parallel=ParallelConfig(**data["parallel"]), device_memory_bytes=float(data["device_memory_bytes"]),
            memory_utilization=data.get("memory_utilization", 0.9), weight_dtype=data.get("weight_dtype", "bfloat16"),
            kv_cache_dtype=data.get("kv_cache_dtype", "bfloat16"), block_size=data.get("block_size", 16),
            hosts=data.get("hosts", 1),
        )


def weight_bytes_per_device(cfg: ModelConfig, pc: ParallelConfig, dtype) -> int:
    """Bytes of this device's shard of every parameter (float32 routers stay float32)."""
    _, state = build_model(cfg, pc, jnp.dtype(dtype))
    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = math.prod(n // mesh_ways(a, pc) for n, a in zip(value.shape, var.logical_axes))
        total += shard * jnp.dtype(value.dtype).itemsize
    return total


def memory_plan(d: Deployment) -> dict:
    cfg, pc = d.model, d.parallel
    pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    weights = weight_bytes_per_device(cfg, pc, d.weight_dtype)
    budget = d.device_memory_bytes * d.memory_utilization - weights
    if budget <= 0:
        raise ValueError(f"{d.name}: weights ({weights / GB:.1f} GB per device) exceed "
                         f"{d.memory_utilization:.0%} of {d.device_memory_bytes / GB:.0f} GB")
    kv = kv_cache_layout(cfg, pc, block_size=d.block_size, bytes_per_device=budget, dtype=d.kv_cache_dtype)
    per_block = kv.bytes_per_block_per_device(cfg.num_hidden_layers, pc.kv_head_groups)
    return dict(
        name=d.name, tp=pc.tp, dcp=pc.dcp, hosts=d.hosts,
        weight_gb_per_device=weights / GB,
        kv_budget_gb_per_device=budget / GB,
        kv_bytes_per_token_per_device=per_block / d.block_size / pc.dcp,
        kv_cache_size_tokens=kv.num_blocks * d.block_size * pc.dcp,
    )


def compare_with_dcp1(d: Deployment) -> tuple[dict, dict]:
    """The plan, and the same deployment at DCP 1 (same TP, same memory)."""
    base = dataclasses.replace(d, parallel=dataclasses.replace(d.parallel, decode_context_parallel_size=1,
                                                               cp_kv_cache_interleave_size=1, dcp_comm_backend="ag_rs"))
    return memory_plan(d), memory_plan(base)


def markdown_rows(paths) -> list[str]:
    rows = [
        (
            "| deployment | TP x DCP | weights GB / device | KV GB / device | KV bytes / token / device | "
            "KV cache size (tokens) | at DCP 1 | gain |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        plan, base = compare_with_dcp1(Deployment.from_file(path))
        rows.append(
            f"| {plan['name']} | {plan['tp']} x {plan['dcp']}{' (' + str(plan['hosts']) + ' hosts)' if plan['hosts'] > 1 else ''} "
            f"| {plan['weight_gb_per_device']:.1f} | {plan['kv_budget_gb_per_device']:.1f} "
            f"| {plan['kv_bytes_per_token_per_device']:,.0f} | {plan['kv_cache_size_tokens']:,} "
            f"| {base['kv_cache_size_tokens']:,} | {plan['kv_cache_size_tokens'] / base['kv_cache_size_tokens']:.2f}x |"
        )
    return rows


def plan_model(args) -> dict:
    """Every DCP size of --model at --tensor-parallel-size, and the recommendation."""
    from dcpjax import planner

    try:
        cfg = load_model_config(args.model)
    except ValueError as err:
        raise SystemExit(f"--model: {err}") from None
    device = planner.DEVICES[args.device]
    device = dataclasses.replace(device, memory_gb=args.memory_gb or device.memory_gb,
                                 hbm_tbps=args.hbm_tbps or device.hbm_tbps)
    link = planner.LINKS[args.interconnect]
    link = dataclasses.replace(link, gbps=args.link_gbps or link.gbps, latency_us=args.link_latency_us or link.latency_us)
    workload = planner.Workload(args.input_len, args.output_len, args.concurrency)
    kv_dtype = jnp.float8_e4m3fn if args.kv_cache_dtype == "fp8" else jnp.dtype(args.kv_cache_dtype)
    rows = []
    for dcp in [d for d in range(1, args.tensor_parallel_size + 1) if args.tensor_parallel_size % d == 0]:
        pc = ParallelConfig(args.tensor_parallel_size, dcp)
        weights = weight_bytes_per_device(cfg, pc, args.weight_dtype or args.dtype) if not layout_problems(
            cfg, pc) else 0
        rows.append(planner.plan_size(cfg, pc, device=device, link=link, workload=workload, weight_bytes=weights,
                                      kv_dtype=kv_dtype, block_size=args.block_size,
                                      q_bytes=jnp.dtype(args.dtype).itemsize))
    choice, reasons = planner.recommend(cfg, rows, link, workload)
    return {"model": args.model, "tp": args.tensor_parallel_size, "device": dataclasses.asdict(device),
            "link": dataclasses.asdict(link), "workload": dataclasses.asdict(workload), "sizes": rows,
            "recommended_dcp": choice, "reasons": reasons}


def plan_table(plan: dict) -> str:
    header = ("| DCP | verdict | KV tokens | fit | KV read / step | collectives / step (ag_rs, a2a) "
              "| step ms (ag_rs, a2a) | tok/s (best) |")
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in plan["sizes"]:
        if not r["valid"]:
            lines.append(f"| {r['dcp']} | rejected: {'; '.join(r['rules_broken'])} | - | - | - | - | - | - |")
            continue
        c, t = r["collective_bytes_per_step"], r["step_seconds"]
        lines.append(f"| {r['dcp']} | valid | {r['kv_cache_size_tokens']:,} | {r['sequences_that_fit']:,} | "
                     f"{r['kv_read_bytes_per_step'] / 1e6:,.1f} MB | {c['ag_rs'] / 1e6:,.2f} / {c['a2a'] / 1e6:,.2f} MB "
                     f"| {t['ag_rs'] * 1e3:.2f} / {t['a2a'] * 1e3:.2f} | {max(r['tokens_per_second'].values()):,.0f} |")
    lines += ["", f"Recommended: DCP {plan['recommended_dcp']}", *(f"- {reason}" for reason in plan["reasons"])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from dcpjax import planner

    p = argparse.ArgumentParser(prog="python -m dcpjax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", help="deployment JSON files (see configs/)")
    p.add_argument("--model", help="a Hugging Face folder, a config.json or a built-in model: plan every DCP size")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=8)
    p.add_argument("--device", choices=sorted(planner.DEVICES), default="h200")
    p.add_argument("--memory-gb", type=float, help="device memory (overrides the preset)")
    p.add_argument("--hbm-tbps", type=float, help="memory bandwidth in TB/s (overrides the preset)")
    p.add_argument("--interconnect", choices=sorted(planner.LINKS), default="nvlink")
    p.add_argument("--link-gbps", type=float, help="GB/s a device receives (overrides the preset)")
    p.add_argument("--link-latency-us", type=float, help="us per collective (overrides the preset)")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="activations (queries on the wire)")
    p.add_argument("--weight-dtype", choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
                   help="weights as the checkpoint ships them (default: --dtype)")
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "fp8"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is None and not args.configs:
        p.error("give deployment files, or --model to plan every DCP size")
    for name in ("tensor_parallel_size", "input_len", "output_len", "concurrency", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.configs:
        print("\n".join(markdown_rows(args.configs)))
    if args.model is not None:
        plan = plan_model(args)
        print(json.dumps(plan, indent=1, default=str) if args.json else plan_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
