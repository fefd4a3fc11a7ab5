"""DCP decode-attention benchmark on 8 fake CPU devices.

    python benchmarks/attention.py                 # full run (contexts 16k..128k), ~10 min on 2 cores
    python benchmarks/attention.py --contexts 1024 --repeats 1   # smoke run

For a Qwen3-235B-like layout (64 q heads, 4 KV heads, head_dim 128) and a
DeepSeek-V3-like MLA layout (128 heads, latent 512 + rope 64), both at TP 8:
  1. KV bytes per token per device and max KV tokens per device for a fixed
     budget, at DCP 1/2/4/8 (read from the sharded arrays, not computed by hand);
  2. decode-attention time per step, DCP k against DCP 1 in the same run;
  3. collective bytes per step read from the compiled HLO, against the analytic
     minimum of the decode step;
  4. the reference kernel's KV read bandwidth against a numpy memcpy of the same bytes.
Prints markdown tables (paste into benchmarks/RESULTS.md) and optionally JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from dcpjax.sharding.devices import use_cpu_devices

use_cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

import dcpjax
from dcpjax.kernels import AttentionOptions, KVCache, decode_attention
from dcpjax.sharding.traffic import dcp_collective_bytes, hlo_collective_bytes

TP = 8
# name: (q_heads, kv_heads, dk, dv, latent, layers)
LAYOUTS = {
    "Qwen3-235B-like GQA (64 q, 4 KV, d 128)": (64, 4, 128, 128, False, 94),
    "DeepSeek-V3-like MLA (128 h, 512 + 64)": (128, 1, 576, 512, True, 61),
}
BUDGET_GIB = 64  # KV budget per device for the capacity table (an H200 holds 141 GB)


def valid_dcps(q_heads, kv_heads, latent):
    return dcpjax.ParallelConfig(TP).valid_dcp_sizes(q_heads, kv_heads, use_mla=latent)


def make_cache(layout, dcp, batch, seq, dtype, seed=0):
    q_heads, kv_heads, dk, dv, latent, _ = layout
    pc = dcpjax.ParallelConfig(TP, dcp)
    mesh = dcpjax.make_mesh(pc)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, seq, kv_heads, dk), np.float32).astype(dtype)
    v = None if latent else rng.standard_normal((batch, seq, kv_heads, dv), np.float32).astype(dtype)
    q = rng.standard_normal((batch, q_heads, dk), np.float32).astype(dtype)
    cache = dcpjax.shard_kv_cache(k, v, mesh, pc, v_head_dim=dv if latent else None)
    return pc, mesh, q, cache


# -- 1. capacity ------------------------------------------------------------------
def capacity_table(layouts):
    rows = []
    for name, layout in layouts.items():
        q_heads, kv_heads, _, _, latent, layers = layout
        for dcp in (1, 2, 4, 8):
            if dcp not in valid_dcps(q_heads, kv_heads, latent):
                rows.append(dict(layout=name, dcp=dcp, valid=False))
                continue
            tokens = 64 * dcp  # a small bfloat16 cache; bytes scale linearly
            _, _, _, cache = make_cache(layout, dcp, 1, tokens, jnp.bfloat16)
            per_token_layer = cache.bytes_per_device() / tokens
            per_token = per_token_layer * layers
            rows.append(dict(
                layout=name, dcp=dcp, valid=True, bytes_per_token_per_device=per_token,
                max_tokens_per_device=int(BUDGET_GIB * 2**30 // per_token),
            ))
    return rows


# -- 2. decode time, 3. collectives --------------------------------------------------
def _time(fn, repeats):
    jax.block_until_ready(fn())  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def analytic_collective_bytes(layout, dcp, batch, q_bytes, comm):
    """Bytes a device must receive per decode step by ring collectives, from the algorithm alone
    (`dcpjax.sharding.traffic`): Q all_gather, then LSE all_gather + output psum_scatter (ag_rs)
    or one all_to_all (a2a)."""
    q_heads, _, dk, dv, _, _ = layout
    return dcp_collective_bytes(tp=TP, dcp=dcp, q_heads=q_heads, dk=dk, dv=dv, batch=batch, q_bytes=q_bytes,
                                comm=comm)


def step_table(layouts, contexts, repeats, comm, total_tokens):
    rows = []
    for name, layout in layouts.items():
        q_heads, kv_heads, _, _, latent, _ = layout
        for context in contexts:
            batch = max(1, total_tokens // context)  # same total tokens at every context
            base = None
            for dcp in valid_dcps(q_heads, kv_heads, latent):
                _, mesh, q, cache = make_cache(layout, dcp, batch, context, np.float32)
                pc = dcpjax.ParallelConfig(TP, dcp, dcp_comm_backend=comm if dcp > 1 else "ag_rs")
                lengths = jnp.full((batch,), context, jnp.int32)
                step = jax.jit(functools.partial(
                    dcpjax.dcp_decode_attention, mesh=mesh, pc=pc, attention_backend="reference"
                ))
                seconds = _time(functools.partial(step, q, cache, lengths), repeats)
                base = seconds if dcp == 1 else base
                hlo = step.lower(q, cache, lengths).compile().as_text()
                collectives = hlo_collective_bytes(hlo, dcp)
                rows.append(dict(
                    layout=name, context=context, batch=batch, dcp=dcp, comm=pc.dcp_comm_backend,
                    step_ms=seconds * 1e3, ratio_vs_dcp1=base / seconds if base else None,
                    kv_read_per_device=cache.bytes_per_device(),
                    collectives=sorted({kind for kind, _ in collectives}),
                    hlo_collective_bytes=sum(b for _, b in collectives),
                    analytic_collective_bytes=analytic_collective_bytes(layout, dcp, batch, 4, pc.dcp_comm_backend),
                ))
    return rows


# -- 4. bandwidth ------------------------------------------------------------------------
def bandwidth_rows(layouts, context, repeats):
    rows = []
    device = jax.devices()[0]
    for name, (q_heads, kv_heads, dk, dv, latent, _) in layouts.items():
        # one device's share at TP 8, DCP 1: its KV head, its q heads
        heads = max(1, kv_heads // TP)
        group = q_heads // TP
        rng = np.random.default_rng(0)
        k = jax.device_put(rng.standard_normal((1, context, heads, dk), np.float32), device)
        v = None if latent else jax.device_put(rng.standard_normal((1, context, heads, dv), np.float32), device)
        q = jax.device_put(rng.standard_normal((1, group * heads, dk), np.float32), device)
        lengths = jnp.array([context], jnp.int32)
        kv = KVCache.from_sequences(k, v, v_head_dim=dv)
        fn = jax.jit(functools.partial(decode_attention, options=AttentionOptions(backend="reference")))
        kv_bytes = k.nbytes + (0 if v is None else v.nbytes)
        kernel_s = _time(functools.partial(fn, q, kv, lengths), repeats)
        src = np.random.default_rng(1).standard_normal(kv_bytes // 4).astype(np.float32)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        copy_s = min(_timeit(functools.partial(np.copyto, dst, src)) for _ in range(max(repeats, 3)))
        rows.append(dict(
            layout=name, context=context, kv_bytes=kv_bytes,
            kernel_gbps=kv_bytes / kernel_s / 1e9, memcpy_gbps=kv_bytes / copy_s / 1e9,
            ratio=(kv_bytes / kernel_s) / (kv_bytes / copy_s),
        ))
    return rows


def _timeit(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- report ------------------------------------------------------------------------------
def _mib(b):
    return f"{b / 2**20:,.2f} MiB"


def print_report(capacity, steps, bandwidth):
    print(f"\n### KV capacity per device (bfloat16, all layers, {BUDGET_GIB} GiB KV budget per device, TP {TP})\n")
    print("| layout | DCP | KV bytes / token / device | max KV tokens / device | vs DCP 1 |")
    print("|---|---:|---:|---:|---:|")
    base = {}
    for r in capacity:
        if not r["valid"]:
            print(f"| {r['layout']} | {r['dcp']} | rejected by the rules | | |")
            continue
        base.setdefault(r["layout"], r["max_tokens_per_device"])
        print(f"| {r['layout']} | {r['dcp']} | {r['bytes_per_token_per_device']:,.0f} | {r['max_tokens_per_device']:,} "
              f"| {r['max_tokens_per_device'] / base[r['layout']]:.2f}x |")
    print(f"\n### Decode attention per step, one layer, float32, TP {TP}, 8 fake CPU devices (best of repeats)\n")
    print("| layout | context x batch | DCP | backend | step ms | speed-up vs DCP 1 | KV bytes / device | collectives "
          "| HLO collective bytes / device | analytic bytes / device |")
    print("|---|---|---:|---|---:|---:|---:|---|---:|---:|")
    for r in steps:
        print(f"| {r['layout']} | {r['context']:,} x {r['batch']} | {r['dcp']} | {r['comm']} | {r['step_ms']:.1f} | "
              f"{r['ratio_vs_dcp1']:.2f}x | {_mib(r['kv_read_per_device'])} | {', '.join(r['collectives']) or '-'} | "
              f"{r['hlo_collective_bytes']:,.0f} | {r['analytic_collective_bytes']:,.0f} |")
    print("\n### Reference kernel KV read bandwidth vs numpy memcpy (one CPU device, float32)\n")
    print("| layout | context | KV bytes | kernel GB/s | memcpy GB/s | kernel / memcpy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in bandwidth:
        print(f"| {r['layout']} | {r['context']:,} | {_mib(r['kv_bytes'])} | {r['kernel_gbps']:.2f} | "
              f"{r['memcpy_gbps']:.2f} | {r['ratio']:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--total-tokens", type=int, default=131072, help="batch = total_tokens // context")
    p.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {len(jax.devices())} fake CPU devices, {time.strftime('%Y-%m-%d')}")
    capacity = capacity_table(LAYOUTS)
    steps = step_table(LAYOUTS, args.contexts, args.repeats, args.dcp_comm_backend, args.total_tokens)
    bandwidth = bandwidth_rows(LAYOUTS, min(args.contexts[-1], 32768), args.repeats)
    print_report(capacity, steps, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(capacity=capacity, steps=steps, bandwidth=bandwidth), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
