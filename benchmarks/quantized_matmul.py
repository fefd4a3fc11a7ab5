"""The quantized matmul alone (`dcpjax.quantization.matmul`), each backend against float32's dot, on
SmolLM2's shapes (Q4_1-like int8 codes, float16 scales and minimums per 32 along K): ms per call, best of 5
loops of `--calls`, the arrays already on the device.

    python benchmarks/quantized_matmul.py                  # 1 CPU device, batch 1 and 16
    python benchmarks/quantized_matmul.py --rows 1 --calls 5   # a quick look
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SHAPES = [(576, 1536, False), (1536, 576, False), (576, 49152, True)]  # gate / up, down, the tied LM head


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16", help="rows of x (batch), comma-separated")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    import jax
    import numpy as np

    from dcpjax.quantization import cpu_kernel
    from dcpjax.quantization.matmul import quantized_matmul

    backends = (["kernel"] if cpu_kernel.available() else []) + ["tiled", "dequantize"]
    rng = np.random.default_rng(0)
    print("| K x N (layout) | rows | " + " | ".join(backends) + " | float32 | held MB |")
    print("|---|---:|" + "---:|" * (len(backends) + 2))
    for k, n, transposed in SHAPES:
        shape, scales = ((n, k), (n, k // 32)) if transposed else ((k, n), (k // 32, n))
        values = jax.device_put(rng.integers(-8, 8, shape).astype(np.int8))
        scale = jax.device_put((rng.random(scales) * 0.01).astype(np.float16))
        offset = jax.device_put((rng.standard_normal(scales) * 0.01).astype(np.float16))
        weight = jax.device_put(np.asarray(values).astype(np.float32))
        held_mb = (values.nbytes + scale.nbytes + offset.nbytes) / 1e6
        for rows in (int(r) for r in args.rows.split(",")):
            x = jax.device_put(rng.standard_normal((rows, k)).astype(np.float32))
            cells = []
            for backend in backends:
                fn = jax.jit(lambda *a, b=backend, t=transposed: quantized_matmul(*a, transposed=t, backend=b))
                cells.append(f"{best_ms(fn, (x, values, scale, offset), args.calls):.3f}")
            dense = jax.jit(lambda x, w, t=transposed: x @ (w.T if t else w))
            cells.append(f"{best_ms(dense, (x, weight), args.calls):.3f}")
            layout = "[N, K]" if transposed else "[K, N]"
            print(f"| {k} x {n} {layout} | {rows} | " + " | ".join(cells) + f" | {held_mb:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
