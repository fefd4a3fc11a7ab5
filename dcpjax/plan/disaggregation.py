"""Prefill/decode disaggregation in the plan: one engine that prefills and decodes on the same TP
devices, against a P/D pair (a prefill instance with its own TP / DCP, the decode instance at the
recommended DCP row), at the workload: output tokens per second per device, the bytes each request
moves between the two, and the decode side's KV capacity.

Why it can pay: on one engine every prompt's prefill stops the batch's decode steps for as long as
it runs, and a long prompt's prefill is compute-bound (2 FLOPs per active parameter per token, and
a causal attention that grows with the square of the prompt); a pair decodes undisturbed but pays
for the prefill instance's devices and moves every prompt's KV over a network.

The model: prefill seconds = (2 x active parameters x input + layers x heads x (dk + dv) x input^2)
FLOPs / (TP x peak TFLOP/s x PREFILL_UTILIZATION). Active parameters are the matmuls a token goes
through: every weight but the embedding table and the LM head (a prompt's logits are its last
token's), the routed experts at top_k / E. The attention is dcpjax's own (MLA absorbed: dk = the
latent, dv = kv_lora_rank); a hybrid's linear-attention layers count by their weights only. One
engine charges a request's prefill fully against decode (vLLM's chunked prefill interleaves them,
hiding some): batch requests take output x step + batch x prefill seconds. The pair runs at the
lowest of its decode rate (batch / (output x step) requests/s), its prefill instance's
(1 / prefill seconds) and its link's (1 / transfer seconds: the transfer overlaps other requests'
decode and adds to the first token's time). So the pair does the same work as one engine on more
devices: at best, its prefill devices keeping up exactly with its decode, as many tokens per device,
never more; what it buys is a decode that prefill never stops (ms / output token) and the freedom to
size each side. Within 1 % of one engine per device the verdict is P/D; below, it says how many
prefill devices would keep up. Bytes moved: `kv_transfer.layout.KVLayout.kv_bytes`, the
producer's own count, of the layout its cache would have, plus the linear state it sends.
"""

from __future__ import annotations

import numpy as np

from dcpjax.kv_transfer.layout import KVLayout
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import layout_problems
from dcpjax.plan.deployment import weight_bytes_per_device
from dcpjax.plan.planner import GB, Workload, allowed_tps, fastest_backend
from dcpjax.runner.kv_layout import kv_block_layout
from dcpjax.sharding.config import ParallelConfig

PREFILL_UTILIZATION = 0.5  # of peak FLOP/s a long prefill reaches (model FLOPs utilisation)
DEFAULT_KV_LINK_GBPS = 25  # a 200 Gb/s NIC between the two instances
TIE = 1.01  # P/D within 1 % of one engine per device: a tie, which its undisturbed decode wins
# dense bf16 tensor FLOP/s per device, with their sources
PEAK_TFLOPS = {
    "h200": (989, "NVIDIA H200 datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)"),
    "b200": (2250, "NVIDIA HGX B200 datasheet: 36 PFLOPS BF16 with sparsity over 8 GPUs, 2,250 dense each"),
    "tpu-v5e": (197, "Google Cloud TPU v5e documentation: 197 TFLOPS bf16"),
    "tpu-v6e": (918, "Google Cloud TPU v6e (Trillium) documentation: 918 TFLOPS bf16"),
    "cpu": (0.1, "a fake CPU device: a nominal 0.1; measure a matmul and pass --prefill-tflops"),
}


def prefill_config(cfg: ModelConfig, tp: int, dcp: int, expert_parallel: bool = False) -> ParallelConfig:
    """The prefill instance's parallel config; ValueError (one line) if the model's heads or
    weights do not allow it."""
    allowed = allowed_tps(cfg)
    if tp not in allowed:
        raise ValueError(f"--prefill-tp {tp}: the model's {cfg.num_attention_heads} query heads and "
                         f"{cfg.num_key_value_heads} KV heads allow TP {', '.join(map(str, allowed))}")
    pc = ParallelConfig(tp, dcp, enable_expert_parallel=expert_parallel)
    if broken := layout_problems(cfg, pc):
        valid = ParallelConfig(tp).valid_dcp_sizes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.use_mla)
        raise ValueError(f"--prefill-dcp {dcp} at --prefill-tp {tp}: {broken[0].rstrip('.')} (valid: "
                         f"{', '.join(map(str, valid))})")
    return pc


def sender_layout(cfg: ModelConfig, kv_dtype) -> KVLayout:
    """The `KVLayout` of a producer's cache from the config alone, at TP 1 (each KV head once, as
    the producer sends them whatever its TP): layer kinds, widths and dtype."""
    kv = kv_block_layout(cfg, ParallelConfig(1), block_size=1, dtype=kv_dtype)
    return KVLayout(architecture=cfg.architecture,
                    layers=tuple("linear" if cfg.is_linear(i) else "kv" for i in range(cfg.num_hidden_layers)),
                    kv_heads=kv.kv_slots, pool_dims=tuple(kv.pool_dims), pool_names=tuple(kv.pool_names),
                    kv_dtype=np.dtype(kv.dtype).name, tp=1, dcp=1, interleave=1, block_size=1)


def bytes_per_request(cfg: ModelConfig, kv_dtype, input_len: int) -> int:
    """Bytes a prompt of `input_len` tokens moves from producer to consumer: its KV, and a hybrid's
    linear state of every head (float32, `linear_state_bytes` over one device)."""
    return sender_layout(cfg, kv_dtype).kv_bytes(input_len) + cfg.linear_state_bytes(1)


def active_parameters(cfg: ModelConfig) -> float:
    """The weights one token's matmuls read: all of them (counted as the engine holds them, float32
    at TP 1) but the embedding table and the LM head, the routed experts at top_k / E."""
    total = weight_bytes_per_device(cfg, ParallelConfig(1), "float32") / 4
    vocab = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    routed = len(cfg.sparse_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    unused = routed * (1 - cfg.num_experts_per_tok / cfg.num_experts) if cfg.num_experts else 0
    return total - vocab - unused


def prefill_flops(cfg: ModelConfig, input_len: int, parameters: float) -> float:
    """FLOPs of one prompt: 2 per active parameter per token, plus the causal attention's two matmuls
    (2 FLOPs per multiply-add over input^2 / 2 pairs each) in every full-attention layer."""
    dk, dv = (cfg.latent_dim, cfg.kv_lora_rank) if cfg.use_mla else (cfg.head_dim, cfg.head_dim)
    return 2 * parameters * input_len + cfg.num_kv_layers * cfg.num_attention_heads * (dk + dv) * input_len ** 2


def _one_engine(row: dict, work: Workload, prefill_s: float) -> dict:
    """Batch requests each prefilled between decode steps: output x step + batch x prefill seconds."""
    step = row["step_seconds"][fastest_backend(row)]
    cycle = work.output_len * step + row["batch"] * prefill_s
    tps = row["batch"] * work.output_len / cycle
    return {"name": "one engine", "tp": row["tp"], "dcp": row["dcp"], "devices": row["tp"],
            "kv_cache_size_tokens": row["kv_cache_size_tokens"], "bytes_per_request": 0, "transfer_seconds": 0.0,
            "prefill_seconds": prefill_s, "prefill_share": row["batch"] * prefill_s / cycle,
            "seconds_per_output_token": cycle / work.output_len, "requests_per_second": row["batch"] / cycle,
            "limited_by": "decode and prefill in turn", "tokens_per_second": tps,
            "tokens_per_second_per_device": tps / row["tp"]}


def _pair(row: dict, prefill_row: dict, work: Workload, prefill_s: float, moved: int, link_gbps: float) -> dict:
    """The decode row undisturbed, fed by the prefill instance over the link: the slowest of the three.
    `prefill_devices_to_keep_up`: the prefill devices (at the same FLOP/s per device) whose rate
    matches the decode side's: there the pair does as much per device as one engine."""
    step = row["step_seconds"][fastest_backend(row)]
    transfer = moved / (link_gbps * GB)
    rates = {"decode": row["batch"] / (work.output_len * step), "prefill instance": 1 / prefill_s,
             "KV link": 1 / transfer if transfer else float("inf")}
    limit = min(rates, key=rates.get)
    devices = prefill_row["tp"] + row["tp"]
    tps = rates[limit] * work.output_len
    return {"name": "P/D pair", "tp": row["tp"], "dcp": row["dcp"], "prefill_tp": prefill_row["tp"],
            "prefill_dcp": prefill_row["dcp"], "devices": devices, "kv_cache_size_tokens": row["kv_cache_size_tokens"],
            "prefill_kv_cache_size_tokens": prefill_row["kv_cache_size_tokens"], "bytes_per_request": moved,
            "transfer_seconds": transfer, "prefill_seconds": prefill_s, "prefill_share": 0.0,
            "seconds_per_output_token": step, "prefill_instance_busy": rates[limit] * prefill_s,
            "prefill_devices_to_keep_up": prefill_row["tp"] * prefill_s * rates["decode"],
            "requests_per_second": rates[limit], "limited_by": limit, "tokens_per_second": tps,
            "tokens_per_second_per_device": tps / devices}


def compare(cfg: ModelConfig, row: dict, prefill_row: dict, *, work: Workload, kv_dtype, tflops: float,
            link_gbps: float, parameters: float | None = None) -> list[dict]:
    """One engine at the plan row `row` against the P/D pair of `prefill_row` (a `planner.plan_size`
    row of the prefill instance, holding one prompt) feeding `row`; `tflops`: peak per device."""
    parameters = active_parameters(cfg) if parameters is None else parameters
    flops = prefill_flops(cfg, work.input_len, parameters)
    seconds = lambda tp: flops / (tp * tflops * 1e12 * PREFILL_UTILIZATION)
    moved = bytes_per_request(cfg, kv_dtype, work.input_len)
    return [_one_engine(row, work, seconds(row["tp"])),
            _pair(row, prefill_row, work, seconds(prefill_row["tp"]), moved, link_gbps)]


def _cost(pair: dict, one: dict) -> str:
    """Why the pair falls short, by what limits it, and what it would buy."""
    need, tpot = pair["prefill_devices_to_keep_up"], one["seconds_per_output_token"] * 1e3
    buys = f"its decode would give a token every {pair['seconds_per_output_token'] * 1e3:,.1f} ms, not {tpot:,.1f}"
    if pair["limited_by"] == "decode":
        return (f"the pair's {pair['prefill_tp']} prefill devices idle {1 - pair['prefill_instance_busy']:.0%} of the "
                f"time, {need:.3g} would keep up ({buys})")
    if pair["limited_by"] == "prefill instance":
        return (f"the pair's prefill instance (TP {pair['prefill_tp']}) keeps up with only "
                f"{pair['requests_per_second']:.3g} requests/s, {need:.3g} prefill devices would ({buys})")
    return f"the KV link moves only {pair['requests_per_second']:.3g} requests/s"


def choose(rows: list[dict], work: Workload, max_tpot_ms: float | None = None) -> tuple[str, str]:
    """"one engine" or "P/D", and why. With a target time per output token (`max_tpot_ms`, an SLO):
    the one that meets it, if only one does. Else on tokens/s per device: charging prefill fully,
    the pair does the same work on more devices, at best (its prefill devices keeping up exactly) as
    much per device as one engine, never more; within 1 % of it, P/D: the same throughput, with its
    decode undisturbed."""
    one, pair = rows
    if max_tpot_ms is not None and (verdict := _by_latency(one, pair, max_tpot_ms)):
        return verdict
    a, b = one["tokens_per_second_per_device"], pair["tokens_per_second_per_device"]
    shape, share = f"{work.concurrency} x ({work.input_len} in + {work.output_len} out)", one["prefill_share"]
    if b * TIE >= a:
        return "P/D", (f"disaggregation: P/D (prefill TP {pair['prefill_tp']}, DCP {pair['prefill_dcp']} + decode TP "
                       f"{pair['tp']}, DCP {pair['dcp']}), {b:,.1f} tok/s per device against {a:,.1f}, a token every "
                       f"{pair['seconds_per_output_token'] * 1e3:,.1f} ms, not "
                       f"{one['seconds_per_output_token'] * 1e3:,.1f}: at {shape} prefill would take {share:.0%} of "
                       f"the one engine's time; {pair['bytes_per_request'] / GB:,.3g} GB moved per request "
                       f"({pair['transfer_seconds'] * 1e3:,.1f} ms, added to the first token)")
    return "one engine", (f"disaggregation: one engine, {a:,.1f} tok/s per device against the P/D pair's {b:,.1f}: "
                          f"at {shape} prefill takes {share:.0%} of its time; {_cost(pair, one)}")


def _by_latency(one: dict, pair: dict, max_tpot_ms: float) -> tuple[str, str] | None:
    """The verdict when exactly one of the two gives a token every `max_tpot_ms` or sooner (None: both
    or neither do; throughput decides)."""
    ms = {name: r["seconds_per_output_token"] * 1e3 for name, r in (("one engine", one), ("P/D", pair))}
    meets = [name for name, value in ms.items() if value <= max_tpot_ms]
    if len(meets) != 1:
        return None
    other = "P/D" if meets[0] == "one engine" else "one engine"
    return meets[0], (f"disaggregation: {meets[0]}, the only one within --max-tpot-ms {max_tpot_ms:g}: a token every "
                      f"{ms[meets[0]]:,.1f} ms against {other}'s {ms[other]:,.1f}; tok/s per device "
                      f"{(one if meets[0] == 'one engine' else pair)['tokens_per_second_per_device']:,.1f} against "
                      f"{(pair if meets[0] == 'one engine' else one)['tokens_per_second_per_device']:,.1f}")


def plan(cfg: ModelConfig, row: dict, prefill_row: dict, *, work: Workload, kv_dtype, device: str,
         tflops: float | None, link_gbps: float, max_tpot_ms: float | None = None) -> dict:
    """The plan's "disaggregation" entry; ValueError if the prefill instance cannot hold one prompt."""
    if not prefill_row["valid"]:
        raise ValueError(f"--prefill-tp {prefill_row['tp']} --prefill-dcp {prefill_row['dcp']}: the prefill instance "
                         f"cannot hold one prompt: {prefill_row['rules_broken'][0]}")
    peak, source = (tflops, "--prefill-tflops") if tflops else PEAK_TFLOPS[device]
    rows = compare(cfg, row, prefill_row, work=work, kv_dtype=kv_dtype, tflops=peak, link_gbps=link_gbps)
    recommended, reason = choose(rows, work, max_tpot_ms)
    return {"prefill_tp": prefill_row["tp"], "prefill_dcp": prefill_row["dcp"], "kv_link_gbps": link_gbps,
            "max_tpot_ms": max_tpot_ms,
            "prefill_tflops": peak, "tflops_source": source, "prefill_utilization": PREFILL_UTILIZATION,
            "batch": row["batch"], "rows": rows, "recommended": recommended, "reason": reason}


def _row_line(r: dict) -> str:
    if r["name"] == "one engine":
        name, moved, ms, share = f"one engine (TP {r['tp']}, DCP {r['dcp']})", "-", "-", f"{r['prefill_share']:.0%}"
    else:
        name = f"P/D pair (prefill TP {r['prefill_tp']}, DCP {r['prefill_dcp']} + decode TP {r['tp']}, DCP {r['dcp']})"
        moved, ms = f"{r['bytes_per_request'] / 1e6:,.2f} MB", f"{r['transfer_seconds'] * 1e3:,.2f}"
        share = f"0% (prefill instance busy {r['prefill_instance_busy']:.0%}; limited by {r['limited_by']})"
    return (f"| {name} | {r['devices']} | {r['kv_cache_size_tokens']:,} | {moved} | {ms} | "
            f"{r['prefill_seconds'] * 1e3:,.2f} | {share} | {r['seconds_per_output_token'] * 1e3:,.2f} | "
            f"{r['tokens_per_second']:,.0f} | {r['tokens_per_second_per_device']:,.1f} |")


def table_lines(plan: dict) -> list[str]:
    """The rows of `plan["disaggregation"]` (empty without --prefill-tp), after the experts' if any."""
    pd = plan.get("disaggregation")
    if not pd:
        return []
    header = ("| engine | devices | KV tokens (decode side) | bytes moved / request | transfer ms "
              "| prefill ms / request | prefill share of time | ms / output token | tok/s | tok/s / device |")
    title = (f"Prefill/decode disaggregation at DCP {plan['recommended_dcp']} (batch {pd['batch']}; prefill at "
             f"{pd['prefill_tflops']:g} TFLOP/s per device x {pd['prefill_utilization']:.0%}, KV link "
             f"{pd['kv_link_gbps']:g} GB/s):")
    lines = [*([""] if plan.get("experts") else []), title, "", header, "|---|" + "---:|" * 5 + "---|" + "---:|" * 3]
    return [*lines, *map(_row_line, pd["rows"]), "", (
        "  prefill: (2 x active parameters x input + layers x heads x (dk + dv) x input^2) FLOPs at the stated "
        "share of peak, charged fully against one engine's decode (chunked prefill would hide some); the pair: "
        "the slowest of its decode, its prefill instance and the KV link (the transfer overlaps decode and adds "
        "to the first token); ms / output token: the mean time between a request's tokens, one engine's step "
        "plus its share of the batch's prefills; KV tokens: the same decode row either way "
        "(max_num_batched_tokens reserves none of the cache for prefill chunks); "
        f"TFLOP/s: {pd['tflops_source']}")]
