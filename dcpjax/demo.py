"""The main job on the embedded default: DCP decode attention on fake CPU devices.

    python -m dcpjax.demo --num-cpu-devices 8

For a GQA layout and an MLA layout at TP 8 it shards one layer's KV cache at
DCP 1/2/4/8, runs one decode step, and prints the KV bytes each device holds
next to the largest difference from no DCP and from the float64 numpy oracle.
A DCP size the model's rules forbid is printed with the rule it breaks.
"""

from __future__ import annotations

import argparse
import sys

# name: (q_heads, kv_heads, dk, dv, latent)
LAYOUTS = {
    "GQA (32 q heads, 4 KV heads, head_dim 64)": (32, 4, 64, 64, False),
    "MLA (16 heads, latent 64 + rope 16)": (16, 1, 80, 64, True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dcpjax.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-cpu-devices", type=int, default=8, help="fake CPU devices (0: use the real ones)")
    p.add_argument("--tensor-parallel-size", type=int, default=8)
    p.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    p.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    p.add_argument("--attention-backend", choices=["auto", "pallas", "reference"], default="auto")
    p.add_argument("--context-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.num_cpu_devices:
        from dcpjax.devices import use_cpu_devices

        use_cpu_devices(args.num_cpu_devices)

    import jax
    import numpy as np

    import dcpjax
    from dcpjax.testing import attention_f64

    tp = args.tensor_parallel_size
    print(f"jax {jax.__version__} on {len(jax.devices())} {jax.devices()[0].platform} device(s); "
          f"TP {tp}, context {args.context_len}, batch {args.batch}, float32, one layer")
    rng = np.random.default_rng(0)
    lengths = np.linspace(args.context_len, max(args.context_len // 3, 1), args.batch).astype(np.int32)
    header = f"{'DCP':>4} {'mesh (tp, dcp)':>15} {'KV bytes/device':>16} {'KV tokens/device':>17} {'max|DCP - noDCP|':>17} {'max|DCP - f64|':>15}"
    for name, (q_heads, kv_heads, dk, dv, latent) in LAYOUTS.items():
        print(f"\n{name}")
        print(header)
        q = rng.standard_normal((args.batch, q_heads, dk)).astype(np.float32)
        k = rng.standard_normal((args.batch, args.context_len, kv_heads, dk)).astype(np.float32)
        v = None if latent else rng.standard_normal((args.batch, args.context_len, kv_heads, dv)).astype(np.float32)
        want, _ = attention_f64(q, k, k[..., :dv] if latent else v, lengths)
        baseline = None
        for dcp in (1, 2, 4, 8):
            try:
                pc = dcpjax.ParallelConfig(tp, dcp, args.cp_kv_cache_interleave_size,
                                           args.dcp_comm_backend if dcp > 1 else "ag_rs")
                pc.validate(q_heads, kv_heads, use_mla=latent)
            except ValueError as err:
                print(f"{dcp:>4}  not valid: {str(err).split(': rule ')[-1]}")
                continue
            mesh = dcpjax.make_mesh(pc)
            cache = dcpjax.shard_kv_cache(k, v, mesh, pc, v_head_dim=dv if latent else None)
            out = np.asarray(dcpjax.dcp_decode_attention(q, cache, lengths, mesh, pc,
                                                          attention_backend=args.attention_backend))
            baseline = out if baseline is None else baseline
            tokens = cache.k.addressable_shards[0].data.shape[1]
            print(f"{dcp:>4} {str(tuple(mesh.devices.shape)):>15} {cache.bytes_per_device():>16,} {tokens:>17,} "
                  f"{np.abs(out - baseline).max():>17.2e} {np.abs(out - want).max():>15.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
