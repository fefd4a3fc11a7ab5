"""The quantized matmul alone (`dcpjax.quantization.matmul`), each backend of this platform against a float
dot of the same weight: ms per call (best of 5 loops of `--calls`, the arrays already on the device), the held
bytes read per second, and each backend's largest difference from "dequantize" (the oracle's order).

Weights are GGUF-like int8 codes with float16 scales and minimums per 32 along K (Q4_1 / Q8_0 as held).
    CPU: SmolLM2's shapes, float32 x; backends "kernel" (compiled), "tiled", "dequantize".
    GPU / TPU: Llama-3-8B's shapes, bfloat16 x; backends "pallas" and "dequantize" (XLA's fused convert).

    python benchmarks/quantized_matmul.py                  # batch 1 and 16
    python benchmarks/quantized_matmul.py --rows 1 --calls 5   # a quick look
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SHAPES = {  # K, N, transposed
    "cpu": [(576, 1536, False), (1536, 576, False), (576, 49152, True)],  # SmolLM2: gate / up, down, tied head
    "accelerator": [(4096, 14336, False), (14336, 4096, False), (4096, 128256, True)],  # Llama-3-8B
}


def best_ms(fn, args, calls: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e3


def backends_here() -> list[str]:
    import jax

    from dcpjax.quantization import cpu_kernel

    if jax.default_backend() != "cpu":
        return ["pallas", "dequantize"]
    return (["kernel"] if cpu_kernel.available() else []) + ["tiled", "dequantize"]


def measure(rows_list: list[int], calls: int, shapes=None, backends=None) -> list[dict]:
    """One row per (shape, rows): ms of each backend and of the float dot, held GB/s, max |diff| / max |y|."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dcpjax.quantization.matmul import quantized_matmul

    on_cpu = jax.default_backend() == "cpu"
    shapes = shapes or SHAPES["cpu" if on_cpu else "accelerator"]
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    rng = np.random.default_rng(0)
    results = []
    for k, n, transposed in shapes:
        shape, scales = ((n, k), (n, k // 32)) if transposed else ((k, n), (k // 32, n))
        values = jax.device_put(rng.integers(-8, 8, shape).astype(np.int8))
        scale = jax.device_put((rng.random(scales) * 0.01).astype(np.float16))
        offset = jax.device_put((rng.standard_normal(scales) * 0.01).astype(np.float16))
        weight = jnp.asarray(values, dtype)
        held = values.nbytes + scale.nbytes + offset.nbytes
        for rows in rows_list:
            x = jax.device_put(jnp.asarray(rng.standard_normal((rows, k)), dtype))
            row = dict(k=k, n=n, transposed=transposed, rows=rows, held_mb=held / 1e6, ms={}, diff={})
            outs = {}
            for backend in backends or backends_here():
                fn = jax.jit(lambda *a, b=backend, t=transposed: quantized_matmul(*a, transposed=t, backend=b))
                outs[backend] = np.asarray(fn(x, values, scale, offset), np.float64)
                row["ms"][backend] = best_ms(fn, (x, values, scale, offset), calls)
            want = outs["dequantize"]
            row["diff"] = {b: float(np.abs(y - want).max() / np.abs(want).max()) for b, y in outs.items()}
            dense = jax.jit(lambda x, w, t=transposed: x @ (w.T if t else w))
            row["ms"][f"{jnp.dtype(dtype).name} dot"] = best_ms(dense, (x, weight), calls)
            results.append(row)
    return results


def table(results: list[dict]) -> str:
    names = list(results[0]["ms"])
    quantized = [b for b in names if not b.endswith(" dot")]
    lines = ["| K x N (layout) | rows | " + " | ".join(f"{b} ms" for b in names) + " | held MB | best held GB/s | "
             "max rel diff from dequantize |", "|---|---:|" + "---:|" * (len(names) + 3)]
    for r in results:
        best = min(r["ms"][b] for b in quantized)
        diffs = ", ".join(f"{b} {r['diff'][b]:.0e}" for b in quantized if b != "dequantize")
        layout = "[N, K]" if r["transposed"] else "[K, N]"
        lines.append(f"| {r['k']} x {r['n']} {layout} | {r['rows']} | " + " | ".join(f"{r['ms'][b]:.3f}" for b in names)
                     + f" | {r['held_mb']:.1f} | {r['held_mb'] / best:.1f} | {diffs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16", help="rows of x (batch), comma-separated")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}")
    print(table(measure([int(r) for r in args.rows.split(",")], args.calls)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
