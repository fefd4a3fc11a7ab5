"""From the producer's layout to the consumer's, on the consumer's host (numpy).

What arrives is each DCP rank's tokens of the producer in that rank's local order
(`runner.kv_io`); token j of rank r sits at position `global_position(j, r, DCP, I)` of the
producer's interleave I. Put back in position order, the KV no longer depends on any layout: the
consumer's `KVMover.scatter` places it by its own (TP, DCP, I, block size). KV heads travel once
each and in head order, so a TP split on either side changes nothing here.

A KV dtype that differs is converted on arrival: fp8 (e4m3 with a float32 scale per token and head,
as the cache stores it) is dequantized, or a float cache quantized the way the cache quantizes
a new token (`kernels.kv_cache.quantize_fp8`: amax / 448 per token and head).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dcpjax.kernels.kv_cache import FP8_MAX
from dcpjax.kv_transfer.wire import resolve_dtype
from dcpjax.runner.kv_io import POOL_FIELDS, STATE_FIELDS, rank_lengths, wire_name
from dcpjax.sharding import layout

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def describe(runner) -> dict:
    """The header's account of one engine's cache: what the other side checks and reads by."""
    cfg, kv = runner.cfg, runner.kv_layout
    return {"architecture": cfg.architecture, "num_hidden_layers": cfg.num_hidden_layers,
            "layers": ["linear" if cfg.is_linear(i) else "kv" for i in range(cfg.num_hidden_layers)],
            "kv_heads": 1 if cfg.use_mla else cfg.num_key_value_heads, "pool_dims": list(kv.pool_dims),
            "kv_dtype": np.dtype(kv.dtype).name, "tp": runner.pc.tp, "dcp": runner.pc.dcp,
            "interleave": runner.pc.interleave, "block_size": kv.block_size}


def compatibility_problems(sender: dict, receiver: dict) -> list[str]:
    """Why a producer's KV cannot serve this consumer (empty: it can): another model."""
    keys = ("architecture", "num_hidden_layers", "layers", "kv_heads", "pool_dims")
    return [f"{key}: the prefill server's {sender.get(key)!r}, this server's {receiver[key]!r}"
            for key in keys if sender.get(key) != receiver[key]]


def position_order(arrays: dict[str, np.ndarray], sender: dict, num_tokens: int,
                   receiver_dtype: np.dtype) -> dict[str, np.ndarray]:
    """The wire's per-rank arrays in position order, in the receiver's KV dtype: "{layer}.{field}"
    [kv_heads, num_tokens, ...] (scales only when the receiver is fp8); state rows as they came."""
    dcp, interleave = sender["dcp"], sender["interleave"]
    lengths = rank_lengths(num_tokens, dcp, interleave)
    positions = [layout.global_position(np.arange(n), r, dcp, interleave) for r, n in enumerate(lengths)]
    receiver_dtype, out = np.dtype(receiver_dtype), {}
    for i, kind in enumerate(sender["layers"]):
        if kind == "linear":
            out |= {wire_name(i, f): arrays[wire_name(i, f)] for f in STATE_FIELDS}
            continue
        fields = {}
        for field in POOL_FIELDS:
            if wire_name(i, field, 0) not in arrays:
                continue
            parts = [arrays[wire_name(i, field, r)] for r in range(dcp)]
            whole = np.empty((parts[0].shape[0], num_tokens, *parts[0].shape[2:]), parts[0].dtype)
            for where, part in zip(positions, parts):
                whole[:, where] = part
            fields[field] = whole
        out |= {wire_name(i, f): a for f, a in convert(fields, receiver_dtype).items()}
    return out


def convert(fields: dict[str, np.ndarray], dtype: np.dtype) -> dict[str, np.ndarray]:
    """One layer's {k, v[, k_scale, v_scale]} in `dtype` (fp8: with scales; else without)."""
    sent_fp8 = "k_scale" in fields
    values = [f for f in ("k", "v") if f in fields]
    if sent_fp8 and dtype == FP8:
        return fields
    if sent_fp8:  # dequantize: the cache's value times its token's scale
        return {f: (fields[f].astype(np.float32) * fields[f"{f}_scale"][..., None]).astype(dtype) for f in values}
    if dtype == FP8:
        out = {}
        for f in values:
            x = fields[f].astype(np.float32)
            scale = np.maximum(np.abs(x).max(axis=-1), 1e-12) / FP8_MAX
            out[f], out[f"{f}_scale"] = (x / scale[..., None]).astype(FP8), scale.astype(np.float32)
        return out
    return {f: fields[f].astype(dtype) for f in values}


def kv_bytes(sender: dict, num_tokens: int, state_bytes: int = 0) -> int:
    """The analytic bytes of a prompt's KV as the producer sends it: every KV layer's tokens
    x heads x (widths x element bytes, + 4 per width for fp8 scales), plus the state rows."""
    dtype = resolve_dtype(sender["kv_dtype"])
    fp8 = dtype == FP8
    per_token_head = sum(sender["pool_dims"]) * dtype.itemsize + \
        (4 * len(sender["pool_dims"]) if fp8 else 0)
    layers = sender["layers"].count("kv")
    return layers * num_tokens * sender["kv_heads"] * per_token_head + state_bytes
