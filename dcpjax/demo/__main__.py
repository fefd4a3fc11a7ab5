"""The main job on the embedded default: DCP decode attention on fake CPU devices.

    python -m dcpjax.demo --num-cpu-devices 8

For a GQA layout and an MLA layout at TP 8 it shards one layer's KV cache at
DCP 1/2/4/8, runs one decode step, and prints the KV bytes and tokens each device
holds next to the largest difference from no DCP and from the float64 numpy oracle.
A DCP size the model's rules forbid is printed with the rule it breaks.
"""

from __future__ import annotations

import argparse
import functools
import sys

from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli

# name: (q_heads, kv_heads, dk, dv, latent)
LAYOUTS = {
    "GQA (32 q heads, 4 KV heads, head_dim 64)": (32, 4, 64, 64, False),
    "MLA (16 heads, latent 64 + rope 16)": (16, 1, 80, 64, True),
}


# flushed: piped output would otherwise land after the log lines that go to stderr unbuffered
say = functools.partial(print, flush=True)

# what the columns mean: "tp: 4" at TP 8 reads like a wrong TP size without it
MESH_NOTE = """\
mesh (tp, dcp): DCP re-uses the TP {tp} ranks, so the mesh's "tp" axis has TP / DCP entries (the
  KV-head groups) and its "dcp" axis DCP entries (the ranks splitting each group's tokens):
  tp x dcp = {tp} devices at every DCP size.
KV tokens/device: the token slots one device holds, for all {batch} sequences together."""

# the engine flags this demo takes (one attention layer: no model, no KV cache sizing)
ENGINE_FLAGS = ("num_cpu_devices", "tensor_parallel_size", "cp_kv_cache_interleave_size", "dcp_comm_backend",
                "attention_backend")


def build_parser() -> argparse.ArgumentParser:
    """The parser: a few engine flags (`EngineArgs`), the context length and batch."""
    p = cli.ArgumentParser(prog="python -m dcpjax.demo", description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(p, include=ENGINE_FLAGS, defaults={"num_cpu_devices": 8, "tensor_parallel_size": 8})
    p.add_argument("--context-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    cli.add_debug_flag(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed."""
    return build_parser().parse_args(argv)


def _print_layout(name, layout, args, engine_args, rng) -> None:
    """One layout's table: a row per DCP size (or the rule it breaks)."""
    import numpy as np

    import dcpjax
    from dcpjax.kernels.oracle import attention_f64

    q_heads, kv_heads, dk, dv, latent = layout
    lengths = np.linspace(args.context_len, max(args.context_len // 3, 1), args.batch).astype(np.int32)
    say(f"\n{name}")
    say(f"{'DCP':>4} {'mesh (tp, dcp)':>15} {'KV bytes/device':>16} {'KV tokens/device':>17} "
        f"{'max|DCP - noDCP|':>17} {'max|DCP - f64|':>15}")
    q = rng.standard_normal((args.batch, q_heads, dk)).astype(np.float32)
    k = rng.standard_normal((args.batch, args.context_len, kv_heads, dk)).astype(np.float32)
    v = None if latent else rng.standard_normal((args.batch, args.context_len, kv_heads, dv)).astype(np.float32)
    want, _ = attention_f64(q, k, k[..., :dv] if latent else v, lengths)
    baseline = None
    for dcp in (1, 2, 4, 8):
        try:
            pc = engine_args.with_dcp(dcp).parallel_config()
            pc.validate(q_heads, kv_heads, use_mla=latent)
        except ValueError as err:
            say(f"{dcp:>4}  not valid: {str(err).split(': rule ')[-1]}")
            continue
        mesh = dcpjax.make_mesh(pc)
        cache = dcpjax.shard_kv_cache(k, v, mesh, pc, v_head_dim=dv if latent else None)
        out = np.asarray(dcpjax.dcp_decode_attention(q, cache, lengths, mesh, pc,
                                                      attention_backend=args.attention_backend))
        baseline = out if baseline is None else baseline
        shard = cache.k.addressable_shards[0].data.shape  # [kv slots, blocks, block_size, dk]
        tokens = shard[1] * shard[2]  # blocks x tokens per block, not the block count alone
        say(f"{dcp:>4} {tuple(mesh.devices.shape)!s:>15} {cache.bytes_per_device():>16,} {tokens:>17,} "
            f"{np.abs(out - baseline).max():>17.2e} {np.abs(out - want).max():>15.2e}")


def main(argv: list[str] | None = None) -> int:
    """Print the table of both layouts."""
    args = parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.use_cpu_devices()

    import jax
    import numpy as np

    tp = args.tensor_parallel_size
    say(f"jax {jax.__version__} on {len(jax.devices())} {jax.devices()[0].platform} device(s); "
        f"TP {tp}, context {args.context_len}, batch {args.batch}, float32, one layer")
    say(MESH_NOTE.format(tp=tp, batch=args.batch))
    rng = np.random.default_rng(0)
    for name, layout in LAYOUTS.items():
        _print_layout(name, layout, args, engine_args, rng)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
