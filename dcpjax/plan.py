"""Memory plan of a deployment: weights and KV cache per device, and the KV capacity.

    python -m dcpjax.plan configs/qwen3-235b-a22b-tp8-dcp2.json [...]

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
from dcpjax.models.config import ModelConfig
from dcpjax.runner import build_model, kv_cache_layout
from dcpjax.sharding.mesh import LOGICAL_AXIS_RULES

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


def _ways(logical_axis, pc: ParallelConfig) -> int:
    sizes = {"tp": pc.kv_head_groups, "dcp": pc.dcp}
    return math.prod(sizes[a] for a in LOGICAL_AXIS_RULES.get(logical_axis) or ()) if logical_axis else 1


def weight_bytes_per_device(cfg: ModelConfig, pc: ParallelConfig, dtype) -> int:
    """Bytes of this device's shard of every parameter (float32 routers stay float32)."""
    _, state = build_model(cfg, pc, jnp.dtype(dtype))
    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = math.prod(n // _ways(a, pc) for n, a in zip(value.shape, var.logical_axes))
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcpjax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", help="deployment JSON files (see configs/)")
    args = p.parse_args(argv)
    print("\n".join(markdown_rows(args.configs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
