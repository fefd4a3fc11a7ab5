"""Expert parallelism vs tensor-parallel experts: one routed-expert layer of a Qwen3-MoE shape
(Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert FFW 768) compiled on 8 fake CPU devices,
side by side: the HLO's collective bytes per device (with `sharding.traffic`'s formula) and the
FLOPs per device, from the compiled program and from the routing.

Nothing runs: the layer is compiled from shapes only. Wall time on fake CPU devices is not
meaningful for this comparison (8 "devices" share 2 cores, and XLA:CPU lowers the grouped matmul
to a dense product per group), so none is reported.

    python benchmarks/expert_parallel.py [--tokens 64 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dcpjax.models.layers import routed_experts
from dcpjax.plan.experts import expected_busiest
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import MODEL_AXES, make_mesh, reduce_model
from dcpjax.sharding.traffic import ep_all_to_all_bytes, hlo_collective_bytes, moe_collective_bytes

EXPERTS, TOP_K, HIDDEN, FFW, TP = 128, 8, 2048, 768, 8


def compiled_layer(tokens: int, expert_parallel: bool):
    """The layer (routing given, weights sharded as the model shards them), compiled from shapes."""
    pc = ParallelConfig(TP, 2, enable_expert_parallel=expert_parallel)
    mesh = make_mesh(pc)
    up_spec = P(MODEL_AXES, None, None) if expert_parallel else P(None, None, MODEL_AXES)
    down_spec = P(MODEL_AXES, None, None) if expert_parallel else P(None, MODEL_AXES, None)

    def body(x, experts, weights, gate, up, down):
        return reduce_model(routed_experts(x, experts, weights, gate, up, down, expert_parallel))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), up_spec, up_spec, down_spec),
                              out_specs=P()))
    shape = jax.ShapeDtypeStruct
    args = (shape((tokens, HIDDEN), jnp.bfloat16), shape((tokens, TOP_K), jnp.int32),
            shape((tokens, TOP_K), jnp.float32), shape((EXPERTS, HIDDEN, FFW), jnp.bfloat16),
            shape((EXPERTS, HIDDEN, FFW), jnp.bfloat16), shape((EXPERTS, FFW, HIDDEN), jnp.bfloat16))
    return f.lower(*args).compile()


def routed_flops(tokens: int, expert_parallel: bool) -> float:
    """FLOPs of the expert matmuls per device as a grouped-matmul kernel does them (rows routed to
    the device's experts only): TP experts, every token copy through 1/TP of its expert; EP, the
    busiest device's copies (uniform routing) through whole experts."""
    per_row = 2 * 3 * HIDDEN * FFW
    if not expert_parallel:
        return tokens * TOP_K * per_row / TP
    # each copy lands on a device with probability 1/TP; the busiest of TP binomials of tokens x top_k
    return expected_busiest(tokens * TOP_K, TP, 1 / TP) * per_row


def measure(tokens: int) -> list[dict]:
    rows = []
    for ep in (False, True):
        compiled = compiled_layer(tokens, ep)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        moved = sum(b for _, b in hlo_collective_bytes(compiled.as_text(), TP))
        rows.append({"experts": "EP" if ep else "tensor-parallel", "tokens": tokens, "hlo_collective_bytes": moved,
                     # XLA:CPU reduces bf16 in float32 (the HLO's all-reduce is f32): the formula at 4 bytes
                     "formula_bytes": moe_collective_bytes(tokens=tokens, hidden=HIDDEN, tp=TP, act_bytes=4),
                     "all_to_all_dispatch_bytes": ep_all_to_all_bytes(tokens=tokens, hidden=HIDDEN, top_k=TOP_K,
                                                                      ep=TP, act_bytes=4) if ep else None,
                     "hlo_flops_per_device": cost.get("flops"), "routed_flops_per_device": routed_flops(tokens, ep)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256], help="tokens in the step (decode rows or a "
                   "packed prefill chunk)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [r for t in args.tokens for r in measure(t)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"one routed-expert layer: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert FFW {FFW}, bf16, "
          f"TP {TP} (DCP 2), {len(jax.devices())} fake CPU devices; compiled, not run. XLA:CPU reduces the bf16 "
          "partial sums in float32 (the formula column counts 4 bytes; bf16 on GPU / TPU halves both), and lowers "
          "the grouped matmul to a dense product per group (its FLOPs column); a grouped kernel does the last column")
    print("| tokens | experts | HLO collective bytes / device | formula | all_to_all dispatch instead | "
          "HLO FLOPs / device (XLA:CPU) | routed FLOPs / device (grouped kernel) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        a2a = f"{r['all_to_all_dispatch_bytes'] / 1e6:.3f} MB" if r["all_to_all_dispatch_bytes"] else "-"
        flops = f"{r['hlo_flops_per_device'] / 1e9:.2f} G" if r["hlo_flops_per_device"] else "-"
        print(f"| {r['tokens']} | {r['experts']} | {r['hlo_collective_bytes'] / 1e6:.3f} MB | "
              f"{r['formula_bytes'] / 1e6:.3f} MB | {a2a} | {flops} | {r['routed_flops_per_device'] / 1e9:.2f} G |")


if __name__ == "__main__":
    main()
