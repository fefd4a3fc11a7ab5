"""Sparse (DSA) against dense MLA decode attention under DCP, on 8 fake CPU devices.

    python benchmarks/sparse_attention.py                      # context 32k, DCP 1 / 2 / 4 / 8, ~5 min on 2 cores
    python benchmarks/sparse_attention.py --context 4096 --repeats 1   # smoke run

A DeepSeek-V3.2-like layer at TP 8 (128 heads over a 512 + 64 latent; an indexer of 64 heads of 128 and
top-k 2,048), one decode query per sequence over the same sharded cache:
  1. dense MLA (`dcp_decode_attention`) and sparse attention (`dcp_sparse_decode_attention`: the
     indexer's scores over every position, the exact global top-k, attention over the selected latents),
     timed side by side in one run at each DCP size (the median of --repeats calls after two warm-ups;
     the jnp reference on CPU: XLA's fused gathers);
  2. the KV bytes each reads per step and device (dense: every latent; sparse: every indexer key and
     k latents), and the collective bytes from the compiled HLO (sparse adds the top-k all_gather).
Prints a markdown table (benchmarks/RESULTS.md) and optionally JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from dcpjax.sharding.devices import use_cpu_devices

use_cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

import dcpjax
from dcpjax.bench.timing import median_seconds
from dcpjax.sharding.attention import dcp_sparse_decode_attention
from dcpjax.sharding.traffic import hlo_collective_bytes

TP, HEADS, LORA, ROPE = 8, 128, 512, 64
INDEX_HEADS, INDEX_DIM, TOP_K = 64, 128, 2048


def run(dcp: int, batch: int, context: int, repeats: int) -> dict:
    pc = dcpjax.ParallelConfig(TP, dcp)
    mesh = dcpjax.make_mesh(pc)
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((batch, context, 1, LORA + ROPE), np.float32)
    keys = rng.standard_normal((batch, context, 1, INDEX_DIM), np.float32)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, LORA + ROPE), np.float32))
    index_q = jnp.asarray(rng.standard_normal((batch, INDEX_HEADS, INDEX_DIM), np.float32))
    weights = jnp.asarray(rng.standard_normal((batch, INDEX_HEADS), np.float32))
    cache = dcpjax.shard_kv_cache(latent, None, mesh, pc, block_size=64, v_head_dim=LORA)
    index_cache = dcpjax.shard_kv_cache(keys, None, mesh, pc, block_size=64, v_head_dim=INDEX_DIM)
    lengths = jnp.full((batch,), context, jnp.int32)
    dense = jax.jit(functools.partial(dcpjax.dcp_decode_attention, mesh=mesh, pc=pc, attention_backend="reference"))
    sparse = jax.jit(functools.partial(dcp_sparse_decode_attention, mesh=mesh, pc=pc, top_k=TOP_K,
                                       index_scale=INDEX_DIM**-0.5, attention_backend="reference"))
    dense_args, sparse_args = (q, cache, lengths), (q, cache, index_q, weights, index_cache, lengths)
    moved = {name: sum(b for _, b in hlo_collective_bytes(fn.lower(*args).compile().as_text(), dcp))
             for name, fn, args in (("dense", dense, dense_args), ("sparse", sparse, sparse_args))}
    per_device = batch * context / dcp * 4  # float32 values per position this device holds, times 4 bytes
    return {"dcp": dcp, "batch": batch, "context": context,
            "dense_ms": 1e3 * median_seconds(lambda: dense(*dense_args), repeats),
            "sparse_ms": 1e3 * median_seconds(lambda: sparse(*sparse_args), repeats),
            "dense_read_mb": per_device * (LORA + ROPE) / 1e6,
            "sparse_read_mb": (per_device * INDEX_DIM + batch * TOP_K / dcp * (LORA + ROPE) * 4) / 1e6,
            "dense_collective_kb": moved["dense"] / 1e3, "sparse_collective_kb": moved["sparse"] / 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = [run(dcp, args.batch, args.context, args.repeats) for dcp in args.dcp]
    print(f"TP {TP}, {HEADS} heads over a {LORA} + {ROPE} latent, indexer {INDEX_HEADS} x {INDEX_DIM}, top-k {TOP_K}; "
          f"batch {args.batch}, context {args.context:,}; float32, jnp reference on {jax.device_count()} CPU devices\n")
    print("| DCP | dense ms | sparse ms | sparse / dense | KV read / device dense | sparse | collectives / device "
          "dense | sparse |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dcp']} | {r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | {r['sparse_ms'] / r['dense_ms']:.2f} | "
              f"{r['dense_read_mb']:.1f} MB | {r['sparse_read_mb']:.1f} MB | {r['dense_collective_kb']:.1f} KB | "
              f"{r['sparse_collective_kb']:.1f} KB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
