"""Expert parallelism in the plan: how a decode step reads the routed experts (`routed_bytes`,
which the planner's roofline counts in every row), and tensor-parallel experts against experts
placed whole (EP) at the recommended DCP size, side by side: weights per device, the combine's
collective bytes, the routed-expert bytes the busiest device reads in a decode step, and the
step, each layout planned as a row of the main table (so the layout the table was planned with
shows the table's own step).

Why the reads differ: a decode step of B tokens activates some experts (each token picks top-k of
E; uniform routing assumed, p = 1 - (1 - k/E)^B of them). Tensor-parallel experts read 1/TP of
every activated expert on every device; EP reads its own activated experts whole, so the device
holding the most of them sets the pace (the expected maximum over the devices of a binomial).
At small batches EP reads more on its busiest device; at large ones every expert is active and
both read the same. The collectives are the same: one reduction either way
(`sharding.traffic.moe_collective_bytes`). A dispatch by all_to_all (`ep_all_to_all_bytes`, not
built) would move instead of that reduction two all_to_alls of top_k / EP of the tokens (there
and back) and the all-gather that gives every device every token again: more bytes when
2 top_k > EP (DeepSeek-V3, Kimi K2, Qwen3 at EP 8: 1.5x), fewer when few experts per token meet
many devices; the table shows both.

Approximations: routing is uniform and the devices independent (real routers skew, which EP
feels and tensor-parallel experts do not); EP's padded experts count in the busiest device's
binomial as if they could be routed (slightly high when E does not divide TP); an fp8 expert's
scales are counted at DeepSeek's 128 x 128 blocks (`FP8_SCALE_OVERHEAD`, 0.02 %). What the roofline leaves out is EP's
reason to be: whole experts make larger matmuls, and an fp8 block is never cut by a device boundary.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from dcpjax.models.config import ModelConfig
from dcpjax.plan.units import FP8, GB
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.traffic import ep_all_to_all_bytes, moe_collective_bytes

FP8_SCALE_OVERHEAD = 1 + 4 / (128 * 128)  # a float32 scale per 128 x 128 block


def expert_bytes(cfg: ModelConfig, weight_dtype: str) -> float:
    """Bytes of one routed expert's three matrices (gate, up, down), as held."""
    per_element = FP8_SCALE_OVERHEAD if weight_dtype == FP8 else jnp.dtype(weight_dtype).itemsize
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * per_element


def activated_share(cfg: ModelConfig, batch: int) -> float:
    """The expected share of experts a step of `batch` tokens activates (uniform top-k routing)."""
    return 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch


def expected_busiest(experts_per_device: int, devices: int, p: float) -> float:
    """E[max over `devices` of Binomial(experts_per_device, p)]: the activated experts of the device
    holding the most (independent devices assumed), sum over m of P(max >= m)."""
    n = experts_per_device
    if p <= 0 or p >= 1:
        return float(n) if p >= 1 else 0.0
    cdf, total, below = 0.0, 0.0, []
    for m in range(n + 1):  # the pmf in logs: comb(n, m) overflows a float for a few thousand
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)
                        + m * math.log(p) + (n - m) * math.log1p(-p))
        below.append(min(cdf, 1.0))
    for m in range(1, n + 1):
        total += 1 - below[m - 1] ** devices
    return total


def routed_bytes(cfg: ModelConfig, pc: ParallelConfig, *, batch: int, weight_dtype: str | None) -> tuple[float, float]:
    """The routed-expert bytes one device holds, and those it reads in a decode step of `batch`
    tokens (the busiest device's with EP), all sparse layers: a grouped matmul (`ragged_dot`)
    reads only the experts the step activates. (0, 0) for a dense model, or an unknown
    `weight_dtype` (then every weight counts as read)."""
    if not cfg.sparse_layers or weight_dtype is None:
        return 0.0, 0.0
    layers, one, p = len(cfg.sparse_layers), expert_bytes(cfg, weight_dtype), activated_share(cfg, batch)
    if pc.enable_expert_parallel:  # whole experts, padded to a multiple of the devices
        per_device = -(-cfg.num_experts // pc.tp)
        return layers * per_device * one, layers * expected_busiest(per_device, pc.tp, p) * one
    return layers * cfg.num_experts * one / pc.tp, layers * cfg.num_experts * p * one / pc.tp


def combine_bytes(cfg: ModelConfig, tp: int, *, batch: int, act_bytes: int) -> float:
    """Bytes one device receives in a decode step to combine the experts' outputs, all sparse
    layers: one reduction either way (0 for a dense model)."""
    return len(cfg.sparse_layers) * moe_collective_bytes(tokens=batch, hidden=cfg.hidden_size, tp=tp,
                                                         act_bytes=act_bytes)


def _name(expert_parallel: bool) -> str:
    return "EP" if expert_parallel else "tensor-parallel"


def compare(cfg: ModelConfig, rows: list[dict], *, tp: int, act_bytes: int) -> list[dict]:
    """TP experts and EP side by side from `rows`, the plan rows (`planner.plan_size`) of each at
    one DCP size, EP off then on: one dict each with valid, batch, weight_bytes_per_device,
    moe_collective_bytes_per_step, all_to_all_bytes_per_step, expert_read_bytes_per_step (the
    busiest device's), step_seconds (the row's, faster backend) and tokens_per_second; a rejected
    row has `rejected` (its rules) instead of the step."""
    out = []
    for ep, row in zip((False, True), rows, strict=True):
        if not row["valid"]:
            out.append({"expert_parallel": ep, "valid": False, "rejected": "; ".join(row["rules_broken"])})
            continue
        step, batch = min(row["step_seconds"].values()), row["batch"]
        out.append({"expert_parallel": ep, "valid": True, "batch": batch,
                    "weight_bytes_per_device": row["weight_bytes_per_device"],
                    "moe_collective_bytes_per_step": row["moe_collective_bytes_per_step"],
                    "all_to_all_bytes_per_step": len(cfg.sparse_layers) * ep_all_to_all_bytes(
                        tokens=batch, hidden=cfg.hidden_size, top_k=cfg.num_experts_per_tok, ep=tp,
                        act_bytes=act_bytes) if ep else 0.0,
                    "expert_read_bytes_per_step": row["expert_read_bytes_per_step"], "step_seconds": step,
                    "tokens_per_second": batch / step})
    return out


def choose(rows: list[dict]) -> tuple[bool, str]:
    """Whether to run EP, and why (a tie within 1 %: EP, for its whole-expert matmuls)."""
    tp_row, ep_row = rows
    if not (tp_row["valid"] and ep_row["valid"]):
        ok, rejected = (tp_row, ep_row) if tp_row["valid"] else (ep_row, tp_row)
        return ok["expert_parallel"], (f"experts: {_name(ok['expert_parallel'])}, "
                                       f"{_name(rejected['expert_parallel'])} rejected: {rejected['rejected']}")
    # time per output token: the step ratio at the same batch, and right when the layouts' batches differ
    ratio = tp_row["tokens_per_second"] / ep_row["tokens_per_second"]
    if ratio <= 1.01:
        return True, (f"experts: EP, a step {ratio:.2f}x the TP experts' (the batch activates nearly every expert); "
                      "whole experts make larger matmuls and keep fp8 blocks whole")
    busiest, spread = ep_row["expert_read_bytes_per_step"] / GB, tp_row["expert_read_bytes_per_step"] / GB
    return False, (f"experts: tensor-parallel, EP's busiest device reads {busiest:,.2f} GB of experts a step "
                   f"against {spread:,.2f} GB (a step "
                   f"{ratio:.2f}x): at this batch few experts are active and EP's land unevenly")


def overruled(rows: list[dict], planned: bool, recommended: bool) -> dict | None:
    """When the recommended layout is not the one the table was planned with (EP: from
    --enable-expert-parallel or the deployment file): the table's layout, its step against the
    recommended one's, by how much it lost, and a sentence saying so. None: they are the same."""
    lost, won = rows[planned], rows[recommended]
    if planned == recommended or not lost["valid"]:  # a rejected layout could not have planned the table
        return None
    ms, best_ms = lost["step_seconds"] * 1e3, won["step_seconds"] * 1e3
    flag = "--enable-expert-parallel" if planned else "tensor-parallel experts (no --enable-expert-parallel)"
    verdict = (f"lost: {_name(planned)}'s step {ms:.2f} ms against {_name(recommended)}'s {best_ms:.2f}, "
               f"{ms - best_ms:.2f} ms ({ms / best_ms - 1:,.1%}) slower" if ms > best_ms else
               f"tied: its step {ms:.2f} ms against EP's {best_ms:.2f}, within 1 %, and a tie goes to EP")
    text = f"{flag}, as the table above is planned, was compared and {verdict}"
    return {"expert_parallel": planned, "step_ms": ms, "recommended_step_ms": best_ms, "slower_ms": ms - best_ms,
            "slower_percent": 100 * (ms / best_ms - 1), "text": text}


def _table_row(r: dict, planned: bool, batch: int) -> str:
    name = "EP (whole experts)" if r["expert_parallel"] else "tensor-parallel"
    name += " (the table's)" if r["expert_parallel"] == planned else ""
    if not r["valid"]:
        return f"| {name} | rejected: {r['rejected']} | - | - | - | - | - |"
    name += f" (batch {r['batch']})" if r["batch"] != batch else ""  # EP's padded experts leave less room for KV
    a2a = f"{r['all_to_all_bytes_per_step'] / 1e6:,.2f} MB" if r["expert_parallel"] else "-"
    return (f"| {name} | {r['weight_bytes_per_device'] / GB:,.2f} GB | "
            f"{r['moe_collective_bytes_per_step'] / 1e6:,.2f} MB | {a2a} | "
            f"{r['expert_read_bytes_per_step'] / GB:,.2f} GB | {r['step_seconds'] * 1e3:.2f} | "
            f"{r['tokens_per_second']:,.0f} |")


def table_lines(plan: dict) -> list[str]:
    """The side-by-side rows of `plan["experts"]` (empty for a dense model)."""
    experts = plan.get("experts")
    if not experts:
        return []
    header = ("| experts | weights / device | MoE collectives / step / device | all_to_all instead | "
              "expert reads / step (busiest device) | step ms | tok/s |")
    lines = [f"Experts at DCP {plan['recommended_dcp']} (batch {experts['batch']}):", "", header,
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [_table_row(r, experts["planned_expert_parallel"], experts["batch"]) for r in experts["rows"]]
    return [*lines, "", ("  EP: routed experts whole over the TP devices (--enable-expert-parallel); the table's: "
                         "the layout the table above is planned with, its step ms that table's at this DCP size; MoE "
                         "collectives: the one reduction that combines experts either way; all_to_all instead: "
                         "what a dispatch by all_to_all would move instead of that reduction (two all_to_alls "
                         "and an all-gather; not built); expert reads: uniform routing, the busiest device's")]
