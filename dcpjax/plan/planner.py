"""Which DCP size to run: every size's rule verdict, capacity, per-step traffic, a roofline
estimate of the decode step (one model of a step: the experts section shows the same rows), and
a recommendation along the article's three axes
(workload, model, interconnect); when no size fits, what would; and the plan as a table
with a legend of its columns.

Everything model-specific comes from the library: the rules from `ParallelConfig`, the
KV bytes from the runner's own `kv_cache_layout`, the weights from the model it would
build, the collective bytes from `sharding.traffic` (held to compiled HLO by the tests).
Device and link figures are data, in `DEVICES` and `LINKS`, each with its source.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.models.registry import layout_problems
from dcpjax.plan import experts
from dcpjax.plan.kv_capacity import kv_capacity
from dcpjax.plan.step_bytes import collective_bytes, dense_read_bytes, kv_read_bytes, top_k_merges
from dcpjax.plan.units import FP8, GB
from dcpjax.runner.kv_layout import kv_block_layout, kv_cache_layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.traffic import COLLECTIVES_PER_LAYER


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float
    hbm_tbps: float  # HBM bandwidth, TB/s
    source: str
    link: str  # the LINKS preset its devices talk over by default


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # GB/s one device receives (one direction)
    latency_us: float  # per collective
    source: str


DEVICES = {d.name: d for d in (
    Device("h200", 141, 4.8, "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s", "nvlink"),
    Device("b200", 180, 8.0, "NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s over 8 GPUs", "nvlink"),
    Device("tpu-v5e", 16, 0.819, "Google Cloud TPU v5e documentation: 16 GB HBM2, 819 GB/s", "ici"),
    Device("tpu-v6e", 32, 1.64, "Google Cloud TPU v6e (Trillium) documentation: 32 GB HBM, 1,640 GB/s", "ici"),
    Device("cpu", 64, 0.02, "a fake CPU device: 64 GB nominal; measure memcpy and pass --hbm-tbps", "cpu"),
)}
LINKS = {link.name: link for link in (
    Link("nvlink", 450, 5, "NVLink 4 (H100/H200): 900 GB/s per GPU both ways; a few us per NCCL collective"),
    Link("pcie", 32, 15, "PCIe Gen5 x16: 64 GB/s per direction, about half reached by NCCL over the host"),
    Link("ici", 100, 10, "TPU v5e ICI: 1,600 Gbps per chip over 4 links"),
    Link("dcn", 25, 30, "data-center network between hosts: 200 Gb/s NIC per host"),
    Link("cpu", 0.29, 367, "fake CPU devices of one host, measured by benchmarks/roofline_check.py on a 2-core "
                           "host (benchmarks/RESULTS.md): one all_gather over 8 devices 367 us + 0.29 GB/s"),
)}


@dataclasses.dataclass(frozen=True)
class Workload:
    input_len: int = 8192
    output_len: int = 512
    concurrency: int = 32


def _rejected(row: dict, kind: str, why: list[str]) -> dict:
    # the config's rule sentences end in "."; they are joined with "; " downstream
    return row | {"valid": False, "rejected_by": kind, "rules_broken": [s.rstrip(".") for s in why]}


def memory_held(weight_bytes: float, sequences: int, state_bytes_per_sequence: float) -> str:
    """What fills a device before its KV blocks, for a "no room" verdict: the weights, and a hybrid's
    per-sequence linear-attention state when it has one."""
    held = f"weights ({weight_bytes / GB:.4g} GB per device)"
    if state_bytes_per_sequence:
        held += (f" and {sequences} sequences' linear-attention state "
                 f"({sequences * state_bytes_per_sequence / GB:.4g} GB)")
    return held


def plan_size(cfg: ModelConfig, pc: ParallelConfig, *, device: Device, link: Link, workload: Workload,
              weight_bytes: float, kv_dtype, block_size: int = 16, q_bytes: int = 2,
              utilization: float = 0.9, problems: list[str] | None = None, weight_dtype: str | None = None) -> dict:
    """One DCP size of the plan: verdict, capacity, traffic and roofline step time (seconds).

    The step: the weights it reads (an MoE's routed experts only as its batch activates them,
    `experts.routed_bytes`, when `weight_dtype` is given; else every weight), KV and a hybrid's
    state over HBM, then an MoE's expert combine and DCP's collectives over the link.

    `valid`: this size runs at least one sequence of the workload; otherwise `rejected_by` is
    "rules" (a ParallelConfig or layout rule), "weights" (no KV block left) or "context" (not
    one sequence fits) and `rules_broken` says why. `problems`: `layout_problems(cfg, pc)` if
    the caller has them (building the abstract model again is the slow part)."""
    broken = layout_problems(cfg, pc) if problems is None else problems
    row = {"tp": pc.tp, "dcp": pc.dcp, "valid": True, "rejected_by": None, "rules_broken": []}
    if broken:
        return _rejected(row, "rules", broken)
    # a hybrid's linear-attention layers keep a fixed state per sequence, one per engine slot: running
    # --concurrency sequences needs max_num_seqs >= concurrency, so that many states come before the KV blocks
    state = cfg.linear_state_bytes(pc.tp)
    budget = device.memory_gb * GB * utilization - weight_bytes - workload.concurrency * state
    blocks = kv_block_layout(cfg, pc, block_size=block_size, dtype=kv_dtype)
    per_block = blocks.bytes_per_block_per_device(KVCacheGroups.of(cfg).size, pc.kv_head_groups)  # one group's layers
    if budget < per_block:
        why = f"{memory_held(weight_bytes, workload.concurrency, state)} leave no room for KV in {utilization:.0%} of "
        return _rejected(row | {"weight_bytes_per_device": weight_bytes}, "weights", [f"{why}{device.memory_gb:g} GB"])
    kv = kv_cache_layout(cfg, pc, block_size=block_size, bytes_per_device=budget, dtype=kv_dtype)
    per_seq = workload.input_len + workload.output_len
    capacity = kv_capacity(cfg, kv.num_blocks, per_block, block_size, pc.dcp, per_seq)
    tokens, fit = capacity.tokens, capacity.fit
    row |= {"kv_cache_size_tokens": tokens, "kv_bytes_per_token_per_device": capacity.bytes_per_token,
            "sequences_that_fit": fit, "weight_bytes_per_device": weight_bytes,
            "state_bytes_per_sequence_per_device": state}
    if fit == 0:
        why = f"one sequence of {per_seq:,} tokens (input + output) needs more than the {tokens:,} tokens the KV cache"
        return _rejected(row, "context", [f"{why} holds"])
    batch = min(workload.concurrency, fit)
    context = workload.input_len + workload.output_len / 2  # the mean over the decode
    index_share = blocks.share_of("index_k")
    kv_read = kv_read_bytes(cfg, capacity, batch, context, index_share)
    if cfg.use_sparse_attention:  # against dense MLA's read of the same cache
        row["dense_kv_read_bytes_per_step"] = dense_read_bytes(cfg, capacity, batch, context, index_share)
    traffic = collective_bytes(cfg, pc, batch, q_bytes, context)
    state_traffic = 2 * batch * state  # each decoding sequence's state read and written back
    held, expert_read = experts.routed_bytes(cfg, pc, batch=batch, weight_dtype=weight_dtype)
    weight_read = weight_bytes - held + expert_read  # a grouped matmul skips the experts no token picked
    moe = experts.combine_bytes(cfg, pc.tp, batch=batch, act_bytes=q_bytes)
    hbm = (weight_read + kv_read + state_traffic) / (device.hbm_tbps * 1e12)
    moe_seconds = moe / (link.gbps * GB)
    merges = top_k_merges(cfg, context)  # sparse attention: one more all_gather per indexed layer
    dcp_seconds = {comm: traffic[comm] / (link.gbps * GB) + (cfg.num_kv_layers * n + merges) * link.latency_us
                   * 1e-6 if pc.dcp > 1 else 0.0 for comm, n in COLLECTIVES_PER_LAYER.items()}
    steps = {comm: hbm + moe_seconds + seconds for comm, seconds in dcp_seconds.items()}
    return row | {"batch": batch, "kv_read_bytes_per_step": kv_read, "state_bytes_per_step": state_traffic,
                  "weight_read_bytes_per_step": weight_read, "expert_read_bytes_per_step": expert_read,
                  "collective_bytes_per_step": traffic, "moe_collective_bytes_per_step": moe,
                  "step_seconds": steps, "hbm_seconds": hbm, "moe_collective_seconds": moe_seconds,
                  "dcp_collective_seconds": dcp_seconds,
                  "tokens_per_second": {comm: batch / s for comm, s in steps.items()}}


def fastest_backend(row: dict) -> str:
    """The merge backend with the shortest step of a valid row (DCP 1 has only ag_rs)."""
    return "ag_rs" if row["dcp"] == 1 else min(row["step_seconds"], key=row["step_seconds"].get)


def _sizes(rows: list[dict]) -> str:
    return ", ".join(str(r["dcp"]) for r in rows)


def rejections(rows: list[dict]) -> list[str]:
    """Why each rejected DCP size of `rows` does not run, one clause per distinct reason: each size
    named with its own first reason and its own numbers (sizes share a clause only when the words
    are the same, e.g. a TP the query heads do not allow)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if not r["valid"]:
            groups.setdefault((r["rejected_by"], r["rules_broken"][0]), []).append(r)
    clauses = []
    for (kind, first), group in groups.items():
        if kind == "rules":
            verb = "breaks" if len(group) == 1 else "break"
            clauses.append(f"DCP {_sizes(group)} {verb} the model's rules ({first})")
        else:
            clauses.append(f"DCP {_sizes(group)}: {first}")
    return clauses


def nothing_fits(rows: list[dict]) -> str:
    """Why no DCP size runs, one clause per size (or per sizes with the same reason)."""
    return f"nothing fits at TP {rows[0]['tp']}: " + "; ".join(rejections(rows))


def _step(row: dict) -> float:
    """A valid row's step (seconds) with its faster backend."""
    return row["step_seconds"][fastest_backend(row)]


def recommend(cfg: ModelConfig, rows: list[dict], link: Link, workload: Workload) -> tuple[int | None, list[str]]:
    """The DCP size to run (None: no size fits) and the reasons for it, along the three axes (each
    other size's own reason: `not_recommended`)."""
    valid = [r for r in rows if r["valid"]]
    if not valid:
        return None, [nothing_fits(rows)]
    if len(valid) == 1:
        only = valid[0]
        if only["dcp"] == 1 and not cfg.use_mla and only["tp"] <= cfg.num_key_value_heads:
            kind = "MHA" if cfg.num_key_value_heads == cfg.num_attention_heads else "this model"
            return 1, [(f"model: {kind}: TP already splits every KV head, so there is no duplicate KV for DCP to "
                        "remove; DCP > 1 rejected")]
        of = f" of DCP {_sizes(rows)}" if len(rows) > 1 else ""
        return only["dcp"], [f"model: only DCP {only['dcp']}{of} fits"]
    base = valid[0]
    best = max(valid, key=lambda r: max(r["tokens_per_second"].values()))  # ties: the smaller DCP
    attention = "MLA (one latent per token)" if cfg.use_mla else f"{cfg.num_key_value_heads} KV heads"
    if cfg.use_sparse_attention:
        attention = f"MLA over the top {cfg.index_topk:,} positions (one latent and one indexer key per token)"
    if cfg.is_hybrid:
        attention += f" in {cfg.num_kv_layers} of {cfg.num_hidden_layers} layers (the others keep a fixed state)"
    held = f"DCP {best['dcp']} holds {best['kv_cache_size_tokens']:,} tokens"
    if best is not base:
        held += f", {best['kv_cache_size_tokens'] / base['kv_cache_size_tokens']:.1f}x DCP {base['dcp']}'s"
    shape = f"{workload.concurrency} x ({workload.input_len} in + {workload.output_len} out)"
    if "dense_kv_read_bytes_per_step" in best:
        held += (f"; its step reads {best['kv_read_bytes_per_step'] / 1e9:,.2f} GB of KV per device where dense MLA "
                 f"would read {best['dense_kv_read_bytes_per_step'] / 1e9:,.2f} GB")
    reasons = [f"model: {attention}: {held}",
               f"workload: {shape}: {best['sequences_that_fit']:,} fit at DCP {best['dcp']}, a batch of {best['batch']}"
               + (f" ({base['sequences_that_fit']:,} at DCP {base['dcp']})" if best is not base else "")]
    if best["dcp"] > 1:
        comm = fastest_backend(best)
        share = best["dcp_collective_seconds"][comm] / best["step_seconds"][comm]
        reasons.append(f"interconnect: {link.name}: DCP's collectives {share:.0%} of the DCP {best['dcp']} step "
                       f"({comm})")
    else:
        reasons.append(f"interconnect: {link.name}: DCP's collectives cost more than its smaller KV reads save here")
    return best["dcp"], reasons


def _slower(row: dict, best: dict) -> str:
    """Why a valid size lost to `best`: its step against best's at the same batch, else its tok/s."""
    ms, best_ms = _step(row) * 1e3, _step(best) * 1e3
    if row["batch"] == best["batch"]:  # the same sequences a step: the step time decides
        return (f"{ms:.2f} ms per step ({fastest_backend(row)}), {ms - best_ms:.2f} ms ({ms / best_ms - 1:,.1%}) "
                f"slower than DCP {best['dcp']}'s {best_ms:.2f}")
    tps, best_tps = row["batch"] / ms * 1e3, best["batch"] / best_ms * 1e3
    return (f"{tps:,.0f} tok/s ({row['batch']} sequences in {ms:.2f} ms steps), {1 - tps / best_tps:.1%} fewer "
            f"than DCP {best['dcp']}'s {best_tps:,.0f} ({best['batch']} in {best_ms:.2f} ms)")


def not_recommended(rows: list[dict], choice: int | None) -> list[dict]:
    """Each DCP size but `choice`, with its own one-line reason: its rule or memory verdict, or its
    step against the recommended one's. Each: dcp, step_ms (None: rejected), tokens_per_second,
    reason."""
    best = next((r for r in rows if r["dcp"] == choice), None)
    out = []
    for r in (r for r in rows if r is not best):
        if not r["valid"]:
            out.append({"dcp": r["dcp"], "step_ms": None, "tokens_per_second": None,
                        "reason": f"rejected: {'; '.join(r['rules_broken'])}"})
            continue
        out.append({"dcp": r["dcp"], "step_ms": _step(r) * 1e3, "tokens_per_second": r["batch"] / _step(r),
                    "reason": _slower(r, best)})
    return out


def allowed_tps(cfg: ModelConfig) -> list[int]:
    """The TPs the model's heads allow (at DCP 1; the DCP sizes of each are its rows)."""
    return ParallelConfig.valid_tp_sizes(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)


def _devices(tp: int) -> str:
    return f"{tp} device" if tp == 1 else f"{tp} devices"


def _out_of_memory(rows: list[dict]) -> bool:
    """No size runs and memory is why: a smaller TP, with more weights and KV per device, cannot help."""
    return not any(r["valid"] for r in rows) and any(r["rejected_by"] != "rules" for r in rows)


def _tps_that_fit(cfg: ModelConfig, tp: int, memory_bound: bool, planned: Callable[[int], list[dict]]) -> list[dict]:
    """The TPs other than `tp` that the heads allow and that fit, smallest first, each planned with
    `planned(tp)`: the smallest larger one, and, unless `tp` ran out of memory, every smaller one
    down to the first that does (planning builds the model once per DCP size: plan few TPs)."""
    allowed, found = allowed_tps(cfg), []
    for t in [] if memory_bound else sorted((t for t in allowed if t < tp), reverse=True):
        rows = planned(t)
        if fitting := [r for r in rows if r["valid"]]:
            found.insert(0, (t, fitting))
        elif _out_of_memory(rows):
            break
    for t in (t for t in allowed if t > tp):
        if fitting := [r for r in planned(t) if r["valid"]]:
            found.append((t, fitting))
            break
    return [{"change": "tensor_parallel_size", "value": t, "dcp": [r["dcp"] for r in fitting],
             "text": f"devices: TP {t} ({_devices(t)}) fits, at DCP {_sizes(fitting)}"} for t, fitting in found]


def what_would_fit(cfg: ModelConfig, rows: list[dict], *, weight_dtype: str, workload: Workload,
                   rows_at: Callable[[int, str], list[dict]]) -> list[dict]:
    """When no DCP size fits (`rows`, one TP): each change that alone makes one fit, found by
    planning it with `rows_at(tp, weight_dtype)`: the TPs the heads allow that fit (see
    `_tps_that_fit`), fp8 weights, and the longest input + output that fits.
    Each entry: change, value, dcp (the sizes that then fit) and text."""
    tp, memory_bound = rows[0]["tp"], _out_of_memory(rows)
    found = _tps_that_fit(cfg, tp, memory_bound, lambda t: rows_at(t, weight_dtype))
    if memory_bound and weight_dtype != FP8 and (fitting := [r for r in rows_at(tp, FP8) if r["valid"]]):
        found.append({"change": "weight_dtype", "value": FP8, "dcp": [r["dcp"] for r in fitting],
                      "text": f"weights: {FP8} weights fit at TP {tp}, at DCP {_sizes(fitting)}"})
    if room := [r for r in rows if r["rejected_by"] == "context"]:
        longest = max(r["kv_cache_size_tokens"] for r in room)
        at = [r for r in room if r["kv_cache_size_tokens"] == longest]
        many = longest // workload.concurrency
        text = f"context: one sequence of up to {longest:,} tokens (input + output) fits at DCP {_sizes(at)}"
        if workload.concurrency > 1 and many:
            text += f"; all {workload.concurrency} at once at up to {many:,} tokens each"
        found.append({"change": "context", "value": longest, "dcp": [r["dcp"] for r in at], "text": text})
    return found


LEGEND = (
    "DCP: decode context parallel size; DCP re-uses the TP ranks, so every size runs on the same TP devices",
    ("verdict: valid, or why not: a ParallelConfig / layout rule, no room for KV after the weights, or not one "
     "sequence fits"),
    ("KV tokens: tokens the KV cache holds, all DCP ranks together, in the memory the weights (and a hybrid "
     "model's fixed state per sequence, --concurrency of them) leave; a linear-attention layer has no KV, a "
     "sliding-window layer keeps its window only (then: the longest one sequence the cache holds)"),
    "fit: sequences of input + output tokens the cache holds at once",
    "batch: sequences decoded in one step, the fewer of --concurrency and fit",
    ("KV read / step / device: KV bytes one device reads in one decode step, batch x mean context "
     "(input + output / 2; a sliding layer: its window) x KV bytes per token per device; DCP d: 1/d of each"),
    ("collectives / step / device: bytes one device receives to merge DCP's partial attention, all layers, with "
     "the ag_rs and a2a backends (none at DCP 1)"),
    ("step ms: roofline of one decode step, (weights read + KV read + a hybrid's state read and written) / HBM "
     "bandwidth, plus collective bytes / link bandwidth and the link's latency per collective; an MoE reads only the "
     "routed experts its batch activates and adds its expert combine's bytes (the experts section's step ms is this "
     "column's, at the recommended size)"),
    "tok/s (best): output tokens per second of the replica, batch / step time, with the faster backend",
)


def kv_read_notes(rows: list[dict]) -> list[str]:
    """Why KV read / step / device rises from one valid DCP size to the next (the batch grows)."""
    valid, notes = [r for r in rows if r["valid"]], []
    for a, b in itertools.pairwise(valid):
        if b["kv_read_bytes_per_step"] > a["kv_read_bytes_per_step"]:
            notes.append(f"KV read / step / device rises from DCP {a['dcp']} to DCP {b['dcp']}: DCP {b['dcp']} decodes "
                         f"{b['batch']} sequences a step where DCP {a['dcp']} holds only {a['batch']}, so each device "
                         f"reads {a['dcp']}/{b['dcp']} as much per sequence for {b['batch'] / a['batch']:.2f}x the "
                         "sequences")
    return notes


def _setup_line(plan: dict) -> str:
    d, link, w = plan["device"], plan["link"], plan["workload"]
    # a default the model does not allow was changed: say why beside the value used
    why = plan.get("adjusted_defaults", {})
    tp_why, input_why = (f" ({why['tensor_parallel_size']})" if "tensor_parallel_size" in why else "",
                         f"; {why['input_len']}" if "input_len" in why else "")
    experts = " with expert parallelism" if plan.get("enable_expert_parallel") else ""
    line = (f"{plan['model']}: TP {plan['tp']}{tp_why}{experts} on {d['name']} ({d['memory_gb']:g} GB, "
            f"{plan['memory_utilization']:.0%} usable, {d['hbm_tbps']:g} TB/s), {link['name']} ({link['gbps']:g} "
            f"GB/s, {link['latency_us']:g} us); weights {plan['weight_dtype']}, KV {plan['kv_cache_dtype']}; "
            f"{w['concurrency']} x ({w['input_len']} in + {w['output_len']} out{input_why})")
    return line + (f"; from the file: {', '.join(plan['from_file'])}" if plan["from_file"] else "")


def alternative_lines(alternatives: list[dict]) -> list[str]:
    """`what_would_fit`'s entries, one line each, but the TPs that fit together on one line."""
    tps = [alt["text"].removeprefix("devices: ") for alt in alternatives if alt["change"] == "tensor_parallel_size"]
    others = [alt["text"] for alt in alternatives if alt["change"] != "tensor_parallel_size"]
    return [f"- {text}" for text in ([f"devices: {'; '.join(tps)}"] if tps else []) + others]


def recommendation_lines(plan: dict) -> list[str]:
    """`Recommended: ...`, its reasons, each other size's, and, when nothing fits, what would."""
    choice, comm = plan["recommended_dcp"], plan["recommended_comm_backend"]
    if choice is None:
        lines = ["Recommended: nothing fits", *(f"- {reason}" for reason in plan["reasons"]),
                 "What would fit (each change alone, planned):"]
        return lines + (alternative_lines(plan["what_would_fit"]) or [
            ("- no TP the heads allow, fp8 weights or shorter context: a device with more memory "
             "(--memory-gb)")])
    backend = f" with dcp_comm_backend={comm}" if choice > 1 else ""
    others = [f"- DCP {r['dcp']}: {r['reason']}" for r in plan.get("not_recommended", [])]
    return [f"Recommended: DCP {choice}{backend}", *(f"- {reason}" for reason in plan["reasons"]),
            *(["Not recommended:", *others] if others else [])]


def plan_table(plan: dict, sections: list[str] = ()) -> str:
    """The plan as text: the setup, the table and its legend, `sections` (e.g. the experts'), then
    the recommendation."""
    header = ("| DCP | verdict | KV tokens | fit | batch | KV read / step / device "
              "| collectives / step / device (ag_rs, a2a) | step ms (ag_rs, a2a) | tok/s (best) |")
    lines = [_setup_line(plan), "", header, "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in plan["sizes"]:
        if not r["valid"]:
            lines.append(f"| {r['dcp']} | rejected: {'; '.join(r['rules_broken'])} | - | - | - | - | - | - | - |")
            continue
        c, t = r["collective_bytes_per_step"], r["step_seconds"]
        lines.append(f"| {r['dcp']} | valid | {r['kv_cache_size_tokens']:,} | {r['sequences_that_fit']:,} "
                     f"| {r['batch']:,} | {r['kv_read_bytes_per_step'] / 1e6:,.1f} MB "
                     f"| {c['ag_rs'] / 1e6:,.2f} / {c['a2a'] / 1e6:,.2f} MB "
                     f"| {t['ag_rs'] * 1e3:.2f} / {t['a2a'] * 1e3:.2f} | {max(r['tokens_per_second'].values()):,.0f} |")
    lines += ["", *(f"  {entry}" for entry in LEGEND), *(f"  {note}" for note in kv_read_notes(plan["sizes"]))]
    if state := next((r["state_bytes_per_sequence_per_device"] for r in plan["sizes"]
                      if r.get("state_bytes_per_sequence_per_device")), 0):
        lines.append(f"  linear-attention state: {state / 1e6:,.2f} MB per sequence per device at every DCP size "
                     f"({plan['workload']['concurrency']} sequences: "
                     f"{plan['workload']['concurrency'] * state / GB:,.2f}"
                     " GB), beside the KV")
    return "\n".join([*lines, "", *([*sections, ""] if sections else []), *recommendation_lines(plan)])
