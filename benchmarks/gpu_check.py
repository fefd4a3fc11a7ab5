"""One short run on a GPU host: the Pallas decode kernel compiled for the GPU.

    python benchmarks/gpu_check.py                 # on a GPU host; ~2 minutes
    python benchmarks/gpu_check.py --cpu-smoke     # tiny sizes, interpret mode, any host

Checks, for a GQA layout and a DeepSeek-V3-like MLA latent layout, in bfloat16
and float32, paged KV:
  1. correctness: the compiled Pallas kernel against the jnp reference on the
     same GPU (max |out| and |lse| differences, with pass/fail tolerances);
  2. bandwidth: KV bytes the kernel reads per second, against a device-to-device
     copy of the same KV pool (bytes read + written per second), side by side;
  3. the quantized matmul (`benchmarks/quantized_matmul.py`) on Llama-3-8B's shapes in bfloat16: the
     Pallas kernel against XLA's fused dequantize-and-dot, ms and held GB/s, relative difference <= 1e-2;
  4. the whole engine on the GPU: tiny-llama, 32 prompts x 64 tokens, 128 greedy
     tokens each, float32, Pallas attention vs the jnp reference: identical token
     ids, and output tokens/s of each (the loop around the model shows here).
Prints a markdown table and writes it, with JSON, under $OUT if that is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# name: (batch, q_heads, kv_heads, dk, dv, latent, context)
CASES = {
    "GQA 8 KV heads x group 8, d 128": (16, 64, 8, 128, 128, False, 16384),
    "MLA 128 heads, latent 512 + rope 64": (16, 128, 1, 576, 512, True, 16384),
}
SMOKE_CASES = {
    "GQA smoke": (2, 8, 2, 32, 32, False, 64),
    "MLA smoke": (2, 16, 1, 48, 32, True, 64),
}
TOLERANCE = {"bfloat16": 2e-2, "float32": 2e-4}
BLOCK_SIZE = 16
QUANTIZED_TOLERANCE = 1e-2  # relative: bfloat16 products summed in float32, in two orders


def run_case(name, case, dtype_name, interpret, iters):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dcpjax.bench.timing import median_seconds
    from dcpjax.kernels import AttentionOptions, KVCache, attention, attention_pallas

    batch, q_heads, kv_heads, dk, dv, latent, context = case
    dtype = jnp.dtype(dtype_name)
    pages_per_seq = context // BLOCK_SIZE
    num_blocks = batch * pages_per_seq
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, 1, q_heads, dk), dtype)  # decode: one query per sequence
    k = jax.random.normal(keys[1], (kv_heads, num_blocks, BLOCK_SIZE, dk), dtype)  # heads-first pools
    v = None if latent else jax.random.normal(keys[2], (kv_heads, num_blocks, BLOCK_SIZE, dv), dtype)
    tables = jax.random.permutation(keys[3], num_blocks).reshape(batch, pages_per_seq).astype(jnp.int32)
    lengths = jnp.asarray(np.linspace(context, 1, batch).astype(np.int32))[:, None]
    lengths = lengths.at[-1].set(0)  # one empty sequence: out 0, lse -inf
    cache = lambda k, v: KVCache(k, v, block_tables=tables, v_head_dim=dv)

    pallas = jax.jit(lambda q, k, v, n: attention_pallas(q, cache(k, v), n, interpret=interpret))
    reference = jax.jit(lambda q, k, v, n: attention(q, cache(k, v), n, AttentionOptions(backend="reference")))
    out_p, lse_p = pallas(q, k, v, lengths)
    out_r, lse_r = reference(q, k, v, lengths)
    out_err = float(jnp.max(jnp.abs(out_p.astype(jnp.float32) - out_r.astype(jnp.float32))))
    finite = jnp.isfinite(lse_r)
    lse_err = float(jnp.max(jnp.where(finite, jnp.abs(lse_p - lse_r), 0.0)))
    empty_ok = bool(jnp.all(jnp.isneginf(lse_p[-1])) and jnp.all(out_p[-1] == 0))
    nan_free = not bool(jnp.isnan(out_p.astype(jnp.float32)).any() or jnp.isnan(lse_p).any())

    full = jnp.full_like(lengths, context)  # bandwidth: every sequence at full length
    kv_bytes = k.nbytes + (0 if v is None else v.nbytes)
    kernel_s = median_seconds(lambda: pallas(q, k, v, full), iters)
    reference_s = median_seconds(lambda: reference(q, k, v, full), iters)
    copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))  # forces a read and a write of x
    pool = k if v is None else jnp.concatenate([k, v], axis=-1)
    copy_s = median_seconds(lambda: copy(pool), iters)
    tol = TOLERANCE[dtype_name]
    return dict(
        case=name, dtype=dtype_name, context=context, batch=batch, kv_mib=kv_bytes / 2**20,
        out_err=out_err, lse_err=lse_err, tolerance=tol, empty_ok=empty_ok, nan_free=nan_free,
        passed=out_err <= tol and lse_err <= tol and empty_ok and nan_free,
        kernel_us=kernel_s * 1e6, reference_us=reference_s * 1e6,
        kernel_gbps=kv_bytes / kernel_s / 1e9, reference_gbps=kv_bytes / reference_s / 1e9,
        copy_gbps=2 * pool.nbytes / copy_s / 1e9,
    )


def run_model_check(num_prompts=32, input_len=64, output_len=128):
    import numpy as np

    import dcpjax

    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(3, 256, input_len)]}
               for i in range(num_prompts)]
    params = dcpjax.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows, ids = [], {}
    import jax

    for backend in ("pallas", "reference"):
        # full float32 dots on both sides (XLA's default on GPU is TF32 for float32 matmuls)
        with jax.default_matmul_precision("highest"):
            llm = dcpjax.LLM("tiny-llama", dtype="float32", attention_backend=backend,
                             kv_cache_memory_bytes=256 << 20, max_model_len=512, max_num_seqs=num_prompts)
            llm.generate(prompts, params)  # compiles every shape of the workload
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
        ids[backend] = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(t) for t in ids[backend])
        rows.append(dict(backend=backend, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds))
    same = ids["pallas"] == ids["reference"]
    return rows, same


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes in interpret mode (no GPU needed)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-model", action="store_true", help="kernels only (no whole-engine run)")
    args = p.parse_args(argv)
    import jax

    platform = jax.default_backend()
    if not args.cpu_smoke and platform != "gpu":
        print(f"no GPU: jax {jax.__version__} sees {platform}; run with --cpu-smoke for a dry run")
        return 2
    cases = SMOKE_CASES if args.cpu_smoke else CASES
    iters = 2 if args.cpu_smoke else args.iters
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({platform}), {time.strftime('%Y-%m-%d')}")
    rows = []
    for name, case in cases.items():
        for dtype in ("bfloat16", "float32"):
            rows.append(run_case(name, case, dtype, args.cpu_smoke, iters))
            print(f"{name} {dtype}: {'PASS' if rows[-1]['passed'] else 'FAIL'}", flush=True)  # which case, if one fails
    lines = [
        ("| case | dtype | context x batch | KV MiB | max abs err out / lse (tol) | empty seq ok | kernel us "
         "| kernel GB/s | reference GB/s | copy GB/s (r+w) | kernel / copy |"),
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['context']} x {r['batch']} | {r['kv_mib']:.0f} | "
            f"{r['out_err']:.1e} / {r['lse_err']:.1e} ({r['tolerance']:.0e}) {'PASS' if r['passed'] else 'FAIL'} | "
            f"{r['empty_ok']} | {r['kernel_us']:.0f} | {r['kernel_gbps']:.0f} | {r['reference_gbps']:.0f} | "
            f"{r['copy_gbps']:.0f} | {r['kernel_gbps'] / r['copy_gbps']:.2f} |"
        )
    passed = all(r["passed"] for r in rows)
    import quantized_matmul  # benchmarks/, beside this script

    if args.cpu_smoke:  # the GPU program, interpreted, on one small weight
        matmuls = quantized_matmul.measure([1], 1, shapes=[(256, 128, False)], backends=["pallas", "dequantize"])
    else:
        matmuls = quantized_matmul.measure([1, 16], args.iters)
    same = all(d <= QUANTIZED_TOLERANCE for r in matmuls for d in r["diff"].values())
    passed = passed and same
    lines += ["", "quantized matmul, int8 codes + float16 scales / minimums per 32 (x bfloat16 on the GPU):", "",
              quantized_matmul.table(matmuls), f"\nPallas within {QUANTIZED_TOLERANCE} of dequantize: {same}"]
    rows = rows + [dict(quantized_matmul=r) for r in matmuls]
    if not args.cpu_smoke and not args.skip_model:
        model_rows, same = run_model_check()
        passed = passed and same
        lines += ["", "| engine, tiny-llama f32, 32 x (64 in, 128 out) | output tokens/s | seconds |",
                  "|---|---:|---:|"]
        lines += [f"| attention {r['backend']} | {r['tokens_per_s']:.0f} | {r['seconds']:.2f} |" for r in model_rows]
        lines.append(f"\ngreedy token ids identical (pallas vs reference): {same}")
        rows = rows + [dict(model=r) for r in model_rows] + [dict(model_same=same)]
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        out = pathlib.Path(os.environ["OUT"])
        (out / "gpu_check.md").write_text(report + "\n")
        (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
