"""Expert parallelism in the plan: tensor-parallel experts against experts placed whole (EP), at
the recommended DCP size, side by side: weights per device, the combine's collective bytes, the
routed-expert bytes the busiest device reads in a decode step, and a roofline step.

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

from dcpjax.models.config import ModelConfig
from dcpjax.plan.planner import FP8, GB
from dcpjax.sharding.traffic import ep_all_to_all_bytes, moe_collective_bytes

FP8_SCALE_OVERHEAD = 1 + 4 / (128 * 128)  # a float32 scale per 128 x 128 block


def expert_bytes(cfg: ModelConfig, weight_dtype: str, dtype_bytes: int) -> float:
    """Bytes of one routed expert's three matrices (gate, up, down), as held."""
    per_element = 1 * FP8_SCALE_OVERHEAD if weight_dtype == FP8 else dtype_bytes
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


def compare(cfg: ModelConfig, row: dict, *, tp: int, weights: dict[bool, float], weight_dtype: str,
            dtype_bytes: int, act_bytes: int, hbm_tbps: float, link_gbps: float, comm: str) -> list[dict]:
    """TP experts and EP at one valid plan row (its batch, KV reads and DCP collectives): one dict
    each with weight_bytes_per_device, moe_collective_bytes_per_step, expert_read_bytes_per_step
    (the busiest device's), step_seconds and tokens_per_second. `weights`: bytes per device with EP
    off (False) and on (True), as the engine holds them; `dtype_bytes`: a weight element's (fp8: 1);
    `act_bytes`: an activation's."""
    layers, batch = len(cfg.sparse_layers), row["batch"]
    one = expert_bytes(cfg, weight_dtype, dtype_bytes)
    p = activated_share(cfg, batch)
    per_device = -(-cfg.num_experts // tp)  # EP: whole experts, padded to a multiple of the devices
    reads = {False: cfg.num_experts * p * one / tp, True: expected_busiest(per_device, tp, p) * one}
    held = {False: cfg.num_experts * one / tp, True: per_device * one}  # routed experts per device per layer
    moe = layers * moe_collective_bytes(tokens=batch, hidden=cfg.hidden_size, tp=tp, act_bytes=act_bytes)
    out = []
    for ep in (False, True):
        # the step's other reads as the main table counts them, the routed experts as this step activates them
        rest = weights[ep] - layers * held[ep] + row["kv_read_bytes_per_step"] + row["state_bytes_per_step"]
        expert_reads = layers * reads[ep]
        dcp_seconds = row["step_seconds"][comm] - row["hbm_seconds"]
        step = (rest + expert_reads) / (hbm_tbps * 1e12) + dcp_seconds + moe / (link_gbps * GB)
        out.append({"expert_parallel": ep, "weight_bytes_per_device": weights[ep], "moe_collective_bytes_per_step": moe,
                    "all_to_all_bytes_per_step": layers * ep_all_to_all_bytes(
                        tokens=batch, hidden=cfg.hidden_size, top_k=cfg.num_experts_per_tok, ep=tp,
                        act_bytes=act_bytes) if ep else 0.0,
                    "expert_read_bytes_per_step": expert_reads, "step_seconds": step,
                    "tokens_per_second": batch / step})
    return out


def choose(rows: list[dict]) -> tuple[bool, str]:
    """Whether to run EP, and why (a tie within 1 %: EP, for its whole-expert matmuls)."""
    tp_row, ep_row = rows
    ratio = ep_row["step_seconds"] / tp_row["step_seconds"]
    if ratio <= 1.01:
        return True, (f"experts: EP, a step {ratio:.2f}x the TP experts' (the batch activates nearly every expert); "
                      "whole experts make larger matmuls and keep fp8 blocks whole")
    busiest, spread = ep_row["expert_read_bytes_per_step"] / GB, tp_row["expert_read_bytes_per_step"] / GB
    return False, (f"experts: tensor-parallel, EP's busiest device reads {busiest:,.2f} GB of experts a step "
                   f"against {spread:,.2f} GB (a step "
                   f"{ratio:.2f}x): at this batch few experts are active and EP's land unevenly")


def table_lines(plan: dict) -> list[str]:
    """The side-by-side rows of `plan["experts"]` (empty for a dense model)."""
    experts = plan.get("experts")
    if not experts:
        return []
    header = ("| experts | weights / device | MoE collectives / step / device | all_to_all instead | "
              "expert reads / step (busiest device) | step ms | tok/s |")
    lines = [f"Experts at DCP {plan['recommended_dcp']} (batch {experts['batch']}):", "", header,
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in experts["rows"]:
        name = "EP (whole experts)" if r["expert_parallel"] else "tensor-parallel"
        a2a = f"{r['all_to_all_bytes_per_step'] / 1e6:,.2f} MB" if r["expert_parallel"] else "-"
        lines.append(f"| {name} | {r['weight_bytes_per_device'] / GB:,.2f} GB | "
                     f"{r['moe_collective_bytes_per_step'] / 1e6:,.2f} MB | {a2a} | "
                     f"{r['expert_read_bytes_per_step'] / GB:,.2f} GB | {r['step_seconds'] * 1e3:.2f} | "
                     f"{r['tokens_per_second']:,.0f} |")
    return [*lines, "", ("  EP: routed experts whole over the TP devices (--enable-expert-parallel); MoE "
                         "collectives: the one reduction that combines experts either way; all_to_all instead: "
                         "what a dispatch by all_to_all would move instead of that reduction (two all_to_alls "
                         "and an all-gather; not built); expert reads: uniform routing, the busiest device's")]
