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
import math
import pathlib
import sys
from collections.abc import Iterable, Sequence

import jax.numpy as jnp
from flax import nnx

from dcpjax import cli
from dcpjax.config import ParallelConfig
from dcpjax.engine_args import EngineArgs
from dcpjax.loader.model_source import load_model_config, resolve
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import build_model, layout_problems
from dcpjax.runner.kv_layout import kv_cache_layout
from dcpjax.sharding.mesh import RULES

GB = 1e9
DEFAULT_TP, DEFAULT_DEVICE = 8, "h200"
DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_DTYPES = (*DTYPES, "float8_e4m3fn")
KV_DTYPES = (*DTYPES, "fp8")
REQUIRED = ("name", "model", "parallel", "device_memory_bytes")
# a deployment file's fields: (JSON type, test, what the value must be)
FIELDS = {
    "name": (str, lambda v: bool(v), "a non-empty string"),
    "model": (dict, lambda v: True, "an object of Hugging Face config.json fields"),
    "parallel": (dict, lambda v: True, "an object of ParallelConfig fields"),
    "device_memory_bytes": ((int, float), lambda v: v > 0, "a number of bytes > 0"),
    "memory_utilization": ((int, float), lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "weight_dtype": (str, WEIGHT_DTYPES.__contains__, f"one of {', '.join(WEIGHT_DTYPES)}"),
    "kv_cache_dtype": (str, (*KV_DTYPES, "float8_e4m3fn").__contains__, f"one of {', '.join(KV_DTYPES)}"),
    "block_size": (int, lambda v: v >= 1, "an integer >= 1"),
    "hosts": (int, lambda v: v >= 1, "an integer >= 1"),
    "max_num_seqs": (int, lambda v: v >= 1, "an integer >= 1"),  # a hybrid model's state slots
}


def load_json(path: str | pathlib.Path) -> object:
    """The parsed file; OSError if unreadable, ValueError if not JSON."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a JSON file: {err}") from None


def check_deployment(data: object, path: str | pathlib.Path, required: tuple[str, ...] = REQUIRED) -> dict:
    """`data` if it is a deployment file's content; ValueError naming the file and the field."""
    if not isinstance(data, dict):
        kind = type(data).__name__  # ValueError, not TypeError: a user's file, reported by the CLI as one line
        raise ValueError(f"{path}: a deployment file is a JSON object, not {kind} (see configs/)")  # noqa: TRY004
    if missing := [key for key in required if key not in data]:
        raise ValueError(f"{path}: no field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}; a deployment "
                         f"file has {', '.join(REQUIRED)} (see configs/*.json)")
    for key, (kind, ok, what) in FIELDS.items():
        value = data.get(key)
        if key in data and (not isinstance(value, kind) or isinstance(value, bool) or not ok(value)):
            raise ValueError(f"{path}: {key!r} must be {what}, got {value!r}")
    return data


def deployment_parallel(data: dict, path: str | pathlib.Path) -> ParallelConfig:
    """The file's "parallel" object as a ParallelConfig; ValueError naming the file."""
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    if unknown := sorted(set(data["parallel"]) - known):
        raise ValueError(f"{path}: 'parallel' has unknown fields {unknown}; known: {', '.join(sorted(known))}")
    try:
        return ParallelConfig(**data["parallel"])
    except ValueError as err:
        raise ValueError(f"{path}: 'parallel': {err}") from None


def deployment_model(data: dict, path: str | pathlib.Path) -> ModelConfig:
    """The file's "model" object as a ModelConfig; ValueError naming the file and the field."""
    try:
        return ModelConfig.from_hf(data["model"])
    except KeyError as err:
        raise ValueError(f"{path}: 'model' has no {err.args[0]!r} field (copy it from the model's "
                         "config.json)") from None
    except ValueError as err:
        raise ValueError(f"{path}: 'model': {err}") from None


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
    max_num_seqs: int = EngineArgs.max_num_seqs  # the engine's default; a hybrid keeps a fixed state for each

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> Deployment:
        """OSError if `path` cannot be read; ValueError naming the field that is missing or wrong."""
        data = check_deployment(load_json(path), path)
        return cls(
            name=data["name"], model=deployment_model(data, path), parallel=deployment_parallel(data, path),
            device_memory_bytes=float(data["device_memory_bytes"]),
            memory_utilization=data.get("memory_utilization", 0.9), weight_dtype=data.get("weight_dtype", "bfloat16"),
            kv_cache_dtype=data.get("kv_cache_dtype", "bfloat16"), block_size=data.get("block_size", 16),
            hosts=data.get("hosts", 1), max_num_seqs=data.get("max_num_seqs", EngineArgs.max_num_seqs),
        )


def kv_dtype(name: str) -> jnp.dtype:
    """The dtype of a --kv-cache-dtype / kv_cache_dtype name ("fp8": float8_e4m3fn)."""
    return jnp.dtype("float8_e4m3fn" if name == "fp8" else name)


def weight_bytes_per_device(cfg: ModelConfig, pc: ParallelConfig, dtype) -> int:
    """Bytes of this device's shard of every parameter (float32 routers stay float32)."""
    _, state = build_model(cfg, pc, jnp.dtype(dtype))
    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = math.prod(n // RULES.ways(a, pc) for n, a in zip(value.shape, var.logical_axes))
        total += shard * jnp.dtype(value.dtype).itemsize
    return total


def memory_plan(d: Deployment) -> dict:
    cfg, pc = d.model, d.parallel
    try:
        pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    except ValueError as err:
        raise ValueError(f"{d.name}: {err}") from None
    weights = weight_bytes_per_device(cfg, pc, d.weight_dtype)
    state_each = cfg.linear_state_bytes(pc.tp)  # a hybrid's fixed state, one per slot (0 without linear layers)
    state = d.max_num_seqs * state_each
    budget = d.device_memory_bytes * d.memory_utilization - weights - state
    if budget <= 0:
        from dcpjax.planner import memory_held

        held = memory_held(weights, d.max_num_seqs, state_each)
        fix = "raise tensor_parallel_size or use float8_e4m3fn weights" + (", or lower max_num_seqs" if state else "")
        raise ValueError(f"{d.name}: {held} exceed {d.memory_utilization:.0%} of {d.device_memory_bytes / GB:.0f} GB; "
                         f"{fix} (python -m dcpjax.plan --model FILE says what fits)")
    kv = kv_cache_layout(cfg, pc, block_size=d.block_size, bytes_per_device=budget, dtype=kv_dtype(d.kv_cache_dtype))
    per_block = kv.bytes_per_block_per_device(cfg.num_kv_layers, pc.kv_head_groups)
    return dict(
        name=d.name, tp=pc.tp, dcp=pc.dcp, hosts=d.hosts,
        weight_gb_per_device=weights / GB,
        state_gb_per_device=state / GB,
        kv_budget_gb_per_device=budget / GB,
        kv_bytes_per_token_per_device=per_block / d.block_size / pc.dcp,
        kv_cache_size_tokens=kv.num_blocks * d.block_size * pc.dcp,
    )


def compare_with_dcp1(d: Deployment) -> tuple[dict, dict]:
    """The plan, and the same deployment at DCP 1 (same TP, same memory)."""
    base = dataclasses.replace(d, parallel=dataclasses.replace(d.parallel, decode_context_parallel_size=1,
                                                               cp_kv_cache_interleave_size=1, dcp_comm_backend="ag_rs"))
    return memory_plan(d), memory_plan(base)


def markdown_rows(paths: Iterable[str | pathlib.Path]) -> list[str]:
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


def model_and_defaults(name: str) -> tuple[ModelConfig, dict]:
    """--model's config, and the settings its deployment file sets ({} for any other model): of
    tensor_parallel_size, weight_dtype, kv_cache_dtype, block_size, memory_gb, memory_utilization."""
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
        defaults["tensor_parallel_size"] = deployment_parallel(data, path).tp
    if "device_memory_bytes" in data:
        defaults["memory_gb"] = data["device_memory_bytes"] / GB
    return deployment_model(data, path), defaults


def plan_rows(cfg: ModelConfig, tp: int, weight_dtype: str, setup: dict) -> list[dict]:
    """`planner.plan_size` of every DCP size (each divisor of `tp`); `setup`: its other arguments."""
    from dcpjax import planner

    rows = []
    for dcp in [d for d in range(1, tp + 1) if tp % d == 0]:
        pc = ParallelConfig(tp, dcp)
        problems = layout_problems(cfg, pc)
        weights = 0 if problems else weight_bytes_per_device(cfg, pc, weight_dtype)
        rows.append(planner.plan_size(cfg, pc, weight_bytes=weights, problems=problems, **setup))
    return rows


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
    from dcpjax import planner

    try:
        cfg, file = model_and_defaults(args.model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    tp = _setting(args, file, "tensor_parallel_size", DEFAULT_TP)
    weight_dtype = _setting(args, file, "weight_dtype", args.dtype)
    kv_name = _setting(args, file, "kv_cache_dtype", "bfloat16")
    device = planner.DEVICES[args.device or DEFAULT_DEVICE]
    memory = args.memory_gb or (file.get("memory_gb") if args.device is None else None)  # --device: its preset
    device = dataclasses.replace(device, memory_gb=memory or device.memory_gb,
                                 hbm_tbps=args.hbm_tbps or device.hbm_tbps)
    link = planner.LINKS[args.interconnect or device.link]
    link = dataclasses.replace(link, gbps=args.link_gbps or link.gbps,
                               latency_us=args.link_latency_us or link.latency_us)
    workload = planner.Workload(args.input_len, args.output_len, args.concurrency)
    setup = dict(device=device, link=link, workload=workload, kv_dtype=kv_dtype(kv_name),
                 block_size=_setting(args, file, "block_size", 16), q_bytes=jnp.dtype(args.dtype).itemsize,
                 utilization=_setting(args, file, "memory_utilization", 0.9))
    rows = plan_rows(cfg, tp, weight_dtype, setup)
    choice, reasons = planner.recommend(cfg, rows, link, workload)
    alternatives = [] if choice is not None else planner.what_would_fit(
        cfg, rows, weight_dtype=weight_dtype, workload=workload,
        rows_at=lambda t, w: plan_rows(cfg, t, w, setup))
    chosen = next((r for r in rows if r["dcp"] == choice), None)
    return {"model": args.model, "tp": tp, "weight_dtype": weight_dtype, "kv_cache_dtype": kv_name,
            "block_size": setup["block_size"], "memory_utilization": setup["utilization"],
            "from_file": _from_file(args, file),
            "device": dataclasses.asdict(device), "link": dataclasses.asdict(link),
            "workload": dataclasses.asdict(workload), "sizes": rows, "recommended_dcp": choice,
            "recommended_comm_backend": planner.fastest_backend(chosen) if chosen else None, "reasons": reasons,
            "what_would_fit": alternatives}


def build_parser() -> argparse.ArgumentParser:
    from dcpjax import planner

    p = argparse.ArgumentParser(prog="python -m dcpjax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", help="deployment JSON files (see configs/)")
    p.add_argument("--model", help="a Hugging Face folder, a config.json, a deployment file or a built-in model: "
                                   "plan every DCP size (default: none, plan the deployment files given)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int,
                   help=f"devices of one replica (default: a deployment file's, else {DEFAULT_TP})")
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
    p.add_argument("--input-len", type=int, default=8192, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=512, help="generated tokens per sequence (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="sequences decoded at once (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="activations, queries on the wire (default: %(default)s)")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES,
                   help="weights as the checkpoint ships them (default: a deployment file's, else --dtype)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES,
                   help="KV cache entries (default: a deployment file's, else bfloat16)")
    p.add_argument("--block-size", type=int, help="KV tokens per block (default: a deployment file's, else 16)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: a table)")
    cli.add_debug_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is None and not args.configs:
        p.error("give deployment files, or --model to plan every DCP size")
    for name in ("tensor_parallel_size", "input_len", "output_len", "concurrency", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.memory_utilization is not None and not 0 < args.memory_utilization <= 1:
        p.error("--memory-utilization must be in (0, 1]")
    if args.configs:
        print("\n".join(markdown_rows(args.configs)))
    if args.model is not None:
        from dcpjax import planner

        plan = plan_model(args)
        print(json.dumps(plan, indent=1, default=str) if args.json else planner.plan_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
