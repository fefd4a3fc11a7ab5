"""KV bytes one device's Pallas kernel reads for a prefill chunk: per query (before) vs per tile (now).

    python benchmarks/prefill_kv_reads.py                 # 512-token chunk after a 4,096-token prefix
    python benchmarks/prefill_kv_reads.py --chunk 512 --prefix 0 --json

An analytic count from the kernels' own tiling rules (`rows_per_program` for the
GPU kernel, `tpu_block_rows` for the TPU kernel), not a timing. Query t of the chunk
sees prefix + t + 1 tokens. Before, the wrapper made each of the T queries a sequence
of its own (`jnp.repeat(block_tables, T)`), so every query walked its own pages; now the
T x G (query, head) rows of a KV head are tiles of the kernel, and a tile walks the
pages up to its longest row once. Pages are block_size tokens of one KV head.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dcpjax.kernels.pallas import padded_rows
from dcpjax.kernels.pallas_gpu import rows_per_program
from dcpjax.kernels.pallas_tpu import tpu_block_rows

# one device's share at TP 8, DCP 1: (query heads per KV head, KV heads, dk, dv, bytes/element, latent)
LAYOUTS = {
    "Qwen3-235B-like GQA (64 q / 4 KV heads, d 128), bf16": (8, 1, 128, 128, 2, False),
    "DeepSeek-V3-like MLA (128 heads, latent 512 + rope 64), bf16": (16, 1, 576, 512, 2, True),
}


def pages_for(bound: int, block_size: int) -> int:
    return -(-bound // block_size)


def kv_reads(group: int, dk: int, dv: int, itemsize: int, latent: bool, *, chunk: int, prefix: int,
             block_size: int, target: str) -> tuple[int, int]:
    """(bytes before, bytes now) one KV head's pages cost for the chunk on `target`."""
    page_bytes = block_size * (dk if latent else dk + dv) * itemsize  # MLA: V is K's latent, read once
    bounds = [prefix + t + 1 for t in range(chunk)]
    before = sum(pages_for(b, block_size) for b in bounds) * page_bytes
    rows = padded_rows(chunk * group, target)
    block = rows_per_program(rows, dk, dv) if target == "gpu" else tpu_block_rows(rows, dk, dv)
    row_bounds = [bounds[r // group] if r < chunk * group else 0 for r in range(rows)]
    tiles = [row_bounds[i : i + block] for i in range(0, rows, block)]
    now = sum(pages_for(max(tile), block_size) for tile in tiles) * page_bytes
    return before, now


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk length T")
    p.add_argument("--prefix", type=int, default=4096, help="tokens already cached before the chunk")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for name, (group, kv_heads, dk, dv, itemsize, latent) in LAYOUTS.items():
        for target in ("gpu", "tpu"):
            before, now = kv_reads(group, dk, dv, itemsize, latent, chunk=args.chunk, prefix=args.prefix,
                                   block_size=args.block_size, target=target)
            rows.append(dict(layout=name, target=target, chunk=args.chunk, prefix=args.prefix,
                             before_mib=kv_heads * before / 2**20, now_mib=kv_heads * now / 2**20,
                             fewer=before / now))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"KV bytes read per device for a {args.chunk}-token chunk after {args.prefix:,} cached tokens "
          f"(block_size {args.block_size})\n")
    print("| layout | kernel | before (MiB) | now (MiB) | fewer |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['target']} | {r['before_mib']:,.1f} | {r['now_mib']:,.1f} | {r['fewer']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
