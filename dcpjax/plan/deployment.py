"""A deployment file (configs/*.json): its checks, and its memory plan: weights and KV cache per
device and the KV capacity, at its DCP size and at DCP 1. `python -m dcpjax.plan` prints it.

A deployment file names a model (its Hugging Face config.json fields), the
parallel configuration, and the device (memory in bytes, utilisation). The plan
is computed by the library from the model it would build: every parameter's
per-device shard from its logical axes, and the KV bytes per block from the same
layout the runner allocates. Nothing is typed in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Iterable

import jax.numpy as jnp

from dcpjax.engine.args import EngineArgs
from dcpjax.engine.preflight import expert_parallel_problem
from dcpjax.loader.model_loader import planned_weight_bytes
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.plan.kv_capacity import kv_capacity
from dcpjax.plan.units import FP8, GB
from dcpjax.runner.kv_layout import kv_cache_layout
from dcpjax.sharding.config import ParallelConfig

DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_DTYPES = (*DTYPES, FP8)
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
        parallel = ParallelConfig(**data["parallel"])
        parallel.check()  # the sizes' own rules; the model's come with the model
        return parallel
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
    # what the engine holds: float8_e4m3fn is fp8 block-scaled weights (`weight_bytes_per_device`);
    # a file's default is as its model's checkpoint ships (quantization_config fp8: float8_e4m3fn)
    weight_dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    block_size: int = 16
    hosts: int = 1
    max_num_seqs: int = EngineArgs.max_num_seqs  # the engine's default; a hybrid keeps a fixed state for each

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> Deployment:
        """OSError if `path` cannot be read; ValueError naming the field that is missing or wrong."""
        data = check_deployment(load_json(path), path)
        model = deployment_model(data, path)
        shipped = "float8_e4m3fn" if model.quantization else "bfloat16"  # as the checkpoint ships
        return cls(
            name=data["name"], model=model, parallel=deployment_parallel(data, path),
            device_memory_bytes=float(data["device_memory_bytes"]),
            memory_utilization=data.get("memory_utilization", 0.9), weight_dtype=data.get("weight_dtype", shipped),
            kv_cache_dtype=data.get("kv_cache_dtype", "bfloat16"), block_size=data.get("block_size", 16),
            hosts=data.get("hosts", 1), max_num_seqs=data.get("max_num_seqs", EngineArgs.max_num_seqs),
        )


def kv_dtype(name: str) -> jnp.dtype:
    """The dtype of a --kv-cache-dtype / kv_cache_dtype name ("fp8": float8_e4m3fn)."""
    return jnp.dtype("float8_e4m3fn" if name == "fp8" else name)


@functools.lru_cache(maxsize=64)  # a plan asks for the same layouts many times; each builds the abstract model
def weight_bytes_per_device(cfg: ModelConfig, pc: ParallelConfig, weight_dtype) -> int:
    """Bytes of weights per device, as the engine holds them (`loader.model_loader.planned_weight_bytes`,
    the count the engine logs): "float8_e4m3fn" is fp8 block-scaled weights (`quantization="fp8"`:
    the linear projections fp8 with their float32 block scales, the rest bfloat16); any other
    dtype holds every weight in it (float32 routers stay float32)."""
    if jnp.dtype(weight_dtype) == jnp.float8_e4m3fn:
        return planned_weight_bytes(cfg, pc, jnp.bfloat16, quantization="fp8")
    return planned_weight_bytes(cfg, pc, jnp.dtype(weight_dtype))


def memory_plan(d: Deployment) -> dict:
    cfg, pc = d.model, d.parallel
    try:
        pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    except ValueError as err:
        raise ValueError(f"{d.name}: {err}") from None
    if problem := expert_parallel_problem(pc, cfg):
        raise ValueError(f"{d.name}: {problem}")
    weights = weight_bytes_per_device(cfg, pc, d.weight_dtype)
    state_each = cfg.linear_state_bytes(pc.tp)  # a hybrid's fixed state, one per slot (0 without linear layers)
    state = d.max_num_seqs * state_each
    budget = d.device_memory_bytes * d.memory_utilization - weights - state
    if budget <= 0:
        from dcpjax.plan.planner import memory_held

        held = memory_held(weights, d.max_num_seqs, state_each)
        fix = "raise tensor_parallel_size or use float8_e4m3fn weights" + (", or lower max_num_seqs" if state else "")
        raise ValueError(f"{d.name}: {held} exceed {d.memory_utilization:.0%} of {d.device_memory_bytes / GB:.0f} GB; "
                         f"{fix} (python -m dcpjax.plan --model FILE says what fits)")
    kv = kv_cache_layout(cfg, pc, block_size=d.block_size, bytes_per_device=budget, dtype=kv_dtype(d.kv_cache_dtype))
    per_block = kv.bytes_per_block_per_device(KVCacheGroups.of(cfg).size, pc.kv_head_groups)  # one group's layers
    capacity = kv_capacity(cfg, kv.num_blocks, per_block, d.block_size, pc.dcp, per_seq=1)
    return dict(
        name=d.name, tp=pc.tp, dcp=pc.dcp, hosts=d.hosts,
        weight_gb_per_device=weights / GB,
        state_gb_per_device=state / GB,
        kv_budget_gb_per_device=budget / GB,
        kv_bytes_per_token_per_device=capacity.bytes_per_token,
        kv_cache_size_tokens=capacity.tokens,
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
            f"| {plan['name']} | {plan['tp']} x {plan['dcp']}"
            f"{' (' + str(plan['hosts']) + ' hosts)' if plan['hosts'] > 1 else ''} "
            f"| {plan['weight_gb_per_device']:.1f} | {plan['kv_budget_gb_per_device']:.1f} "
            f"| {plan['kv_bytes_per_token_per_device']:,.0f} | {plan['kv_cache_size_tokens']:,} "
            f"| {base['kv_cache_size_tokens']:,} | {plan['kv_cache_size_tokens'] / base['kv_cache_size_tokens']:.2f}x |"
        )
    return rows
