"""Which DCP size to run: every size's rule verdict, capacity, per-step traffic, a roofline
estimate of the decode step, and a recommendation along the article's three axes
(workload, model, interconnect).

Everything model-specific comes from the library: the rules from `ParallelConfig`, the
KV bytes from the runner's own `kv_cache_layout`, the weights from the model it would
build, the collective bytes from `sharding.traffic` (held to compiled HLO by the tests).
Device and link figures are data, in `DEVICES` and `LINKS`, each with its source.
"""

from __future__ import annotations

import dataclasses

from dcpjax.config import ParallelConfig
from dcpjax.models.config import ModelConfig
from dcpjax.runner import kv_cache_layout, layout_problems
from dcpjax.sharding.traffic import COLLECTIVES_PER_LAYER, dcp_collective_bytes

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float
    hbm_tbps: float  # HBM bandwidth, TB/s
    source: str


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # GB/s one device receives (one direction)
    latency_us: float  # per collective
    source: str


DEVICES = {d.name: d for d in (
    Device("h200", 141, 4.8, "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s"),
    Device("b200", 180, 8.0, "NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s over 8 GPUs"),
    Device("tpu-v5e", 16, 0.819, "Google Cloud TPU v5e documentation: 16 GB HBM2, 819 GB/s"),
    Device("tpu-v6e", 32, 1.64, "Google Cloud TPU v6e (Trillium) documentation: 32 GB HBM, 1,640 GB/s"),
    Device("cpu", 64, 0.02, "a fake CPU device: 64 GB nominal; measure memcpy and pass --hbm-tbps"),
)}
LINKS = {link.name: link for link in (
    Link("nvlink", 450, 5, "NVLink 4 (H100/H200): 900 GB/s per GPU both ways; a few us per NCCL collective"),
    Link("pcie", 32, 15, "PCIe Gen5 x16: 64 GB/s per direction, about half reached by NCCL over the host"),
    Link("ici", 100, 10, "TPU v5e ICI: 1,600 Gbps per chip over 4 links"),
    Link("dcn", 25, 30, "data-center network between hosts: 200 Gb/s NIC per host"),
)}


@dataclasses.dataclass(frozen=True)
class Workload:
    input_len: int = 8192
    output_len: int = 512
    concurrency: int = 32


def _traffic(cfg: ModelConfig, pc: ParallelConfig, batch: int, q_bytes: int) -> dict[str, float]:
    """DCP collective bytes per decode step per device, all layers, for each merge backend."""
    if cfg.use_mla:
        dk, dv = cfg.latent_dim, cfg.kv_lora_rank
    else:
        dk = dv = cfg.head_dim
    return {comm: cfg.num_hidden_layers * dcp_collective_bytes(tp=pc.tp, dcp=pc.dcp, q_heads=cfg.num_attention_heads,
                                                               dk=dk, dv=dv, batch=batch, q_bytes=q_bytes, comm=comm)
            for comm in COLLECTIVES_PER_LAYER}


def plan_size(cfg: ModelConfig, pc: ParallelConfig, *, device: Device, link: Link, workload: Workload,
              weight_bytes: float, kv_dtype, block_size: int = 16, q_bytes: int = 2,
              utilization: float = 0.9) -> dict:
    """One DCP size of the plan: verdict, capacity, traffic and roofline step time (seconds)."""
    broken = layout_problems(cfg, pc)
    row = {"dcp": pc.dcp, "valid": not broken, "rules_broken": broken}
    budget = device.memory_gb * GB * utilization - weight_bytes
    if broken or budget <= 0:
        row["rules_broken"] = broken or [f"weights ({weight_bytes / GB:.1f} GB) leave no room for KV"]
        row["valid"] = False
        return row
    kv = kv_cache_layout(cfg, pc, block_size=block_size, bytes_per_device=budget, dtype=kv_dtype)
    per_token = kv.bytes_per_block_per_device(cfg.num_hidden_layers, pc.kv_head_groups) / block_size / pc.dcp
    tokens = kv.num_blocks * block_size * pc.dcp
    per_seq = workload.input_len + workload.output_len
    fit = tokens // per_seq
    batch = min(workload.concurrency, fit)
    context = workload.input_len + workload.output_len / 2  # the mean over the decode
    kv_read = batch * context * per_token
    traffic = _traffic(cfg, pc, batch, q_bytes)
    hbm = (weight_bytes + kv_read) / (device.hbm_tbps * 1e12)
    steps = {comm: hbm + (traffic[comm] / (link.gbps * GB) + cfg.num_hidden_layers * n * link.latency_us * 1e-6
                          if pc.dcp > 1 else 0.0) for comm, n in COLLECTIVES_PER_LAYER.items()}
    return row | {"kv_cache_size_tokens": tokens, "kv_bytes_per_token_per_device": per_token,
                  "sequences_that_fit": fit, "batch": batch, "kv_read_bytes_per_step": kv_read,
                  "weight_bytes_per_device": weight_bytes, "collective_bytes_per_step": traffic,
                  "step_seconds": steps, "hbm_seconds": hbm,
                  "tokens_per_second": {comm: batch / s for comm, s in steps.items()}}


def recommend(cfg: ModelConfig, rows: list[dict], link: Link, workload: Workload) -> tuple[int, list[str]]:
    """The DCP size to run and the reasons, along the three axes."""
    valid = [r for r in rows if r["valid"]]
    reasons = []
    if not valid:
        return 1, [f"model: no DCP size runs here: {rows[0]['rules_broken'][0]}"]
    if len(valid) == 1:
        kind = "MHA" if cfg.num_key_value_heads == cfg.num_attention_heads and not cfg.use_mla else "this model"
        reasons.append(f"model: {kind}: TP already splits every KV head, so there is no duplicate KV for DCP to "
                       "remove; DCP > 1 rejected")
        return 1, reasons
    base = valid[0]
    best = max(valid, key=lambda r: min(r["tokens_per_second"].values()))
    attention = "MLA (one latent per token)" if cfg.use_mla else f"{cfg.num_key_value_heads} KV heads"
    reasons.append(f"model: {attention}: DCP {valid[-1]['dcp']} holds {valid[-1]['kv_cache_size_tokens'] / base['kv_cache_size_tokens']:.1f}x "
                   f"the tokens of DCP 1")
    reasons.append(f"workload: {workload.concurrency} x ({workload.input_len} in + {workload.output_len} out): "
                   f"{base['sequences_that_fit']} fit at DCP 1, {best['sequences_that_fit']} at DCP {best['dcp']}")
    if best["dcp"] > 1:
        comm = min(best["step_seconds"], key=best["step_seconds"].get)
        share = 1 - best["hbm_seconds"] / best["step_seconds"][comm]
        reasons.append(f"interconnect: {link.name}: collectives {share:.0%} of the DCP {best['dcp']} step ({comm})")
    else:
        reasons.append(f"interconnect: {link.name}: DCP's collectives cost more than its smaller KV reads save here")
    return best["dcp"], reasons
