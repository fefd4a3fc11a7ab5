"""One quantized matmul for every held weight: y = x @ dequantize(values, scale, offset), with no float
copy of the whole weight.

The weight as a matrix, in one of two layouts:
    [K, N] (`transposed=False`): a Linear as dcpjax holds it ([in, out]); scale, offset [K / gk, N / gn]
    [N, K] (`transposed=True`):  a tied embedding table [vocab, hidden];  scale, offset [N / gn, K / gk]
with int8 (GGUF codes) or float8_e4m3fn values, float16 / float32 scales, and w = values * scale (+ offset)
per block of gk x gn elements (the groups follow from the shapes, as in `weight.dequantize`).

Backends (`backend=`):
    "kernel": the compiled CPU kernel (`cpu_kernel`, an XLA custom call): each weight byte is read once and
              converted in registers. The CPU default for up to `KERNEL_MAX_ROWS` rows (decode), and for a
              table [N, K] at any number of rows (prompt logprobs: table rows dequantized a few at a time into
              a cache-sized buffer; a vocabulary-sized float copy would be hundreds of MB).
    "tiled":  XLA only: a loop over tiles of `tile_rows` rows along K, each tile dequantized (a tile's float
              copy stays in cache, never the whole weight), multiplied and accumulated. The CPU path where the
              kernel does not build.
    "dequantize": the whole weight dequantized, then one dot (what XLA:GPU / TPU fuse; the oracle's order).
              Also the CPU path for a Linear [K, N] past `KERNEL_MAX_ROWS` rows (prefill): there the
              arithmetic bounds the time, and XLA's GEMM on one layer's transient float copy beats both the
              kernel and the tiles (benchmarks/quantized_matmul.py --rows 32,64,256).
    "pallas": the Pallas kernel (`pallas_matmul`): Triton on GPU, Mosaic on TPU, interpreted on CPU; codes
              converted a K group at a time in registers / VMEM. Needs K groups of a power of two >= 16
              (GGUF's 32, fp8's 128) and N a column block (`pallas_matmul.pallas_problem` says why not).
"auto": $DCPJAX_QUANTIZED_MATMUL when set (one of the backends: how an engine picks "pallas"); else "kernel"
or "tiled" on CPU and "dequantize" elsewhere, since XLA:GPU / TPU fuse the convert into the dot's operand
and the Pallas kernel has not yet been timed against that on a GPU or TPU (`benchmarks/gpu_check.py` does).
All agree with a float64 `x @ dequantize(w)` up to float32 rounding (they sum in other orders).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from dcpjax.quantization import cpu_kernel, pallas_matmul

BACKENDS = ("auto", "kernel", "tiled", "dequantize", "pallas")
BACKEND_ENV = "DCPJAX_QUANTIZED_MATMUL"  # the backend "auto" stands for, when set
KERNEL_MAX_ROWS = 32  # beyond this many rows of x, XLA's float GEMM outruns the kernel (compute-bound; measured)
TILE_BYTES = 1 << 20  # "tiled": a tile's float32 copy fits a core's L2 (measured: benchmarks/quantized_matmul.py)


def groups_of(values_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Elements per scale along each axis."""
    return tuple(n // s for n, s in zip(values_shape, scale_shape))


def dequantize_matrix(values: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """values [R, C] * scale [R / gr, C / gc] (+ offset) -> [R, C] float32."""
    (rows, cols), (gr, gc) = values.shape, groups_of(values.shape, scale.shape)
    spread = lambda a: a.astype(jnp.float32)[:, None, :, None]
    w = values.astype(jnp.float32).reshape(rows // gr, gr, cols // gc, gc) * spread(scale)
    if offset is not None:
        w = w + spread(offset)
    return w.reshape(rows, cols)


def tile_rows(k: int, n: int, group_k: int, tile_bytes: int = TILE_BYTES) -> int:
    """The "tiled" path's rows per tile along K: the most whole groups that divide K and keep a tile's
    float32 copy within `tile_bytes` (at least one group)."""
    best = group_k
    for groups in range(1, k // group_k + 1):
        rows = groups * group_k
        if k % rows == 0 and rows * n * 4 <= tile_bytes:
            best = rows
    return best


def _tiled(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None, transposed: bool,
           tile_bytes: int) -> jax.Array:
    axis = 1 if transposed else 0  # K's axis in values
    k, n = values.shape[axis], values.shape[1 - axis]
    gk = groups_of(values.shape, scale.shape)[axis]
    rows = tile_rows(k, n, gk, tile_bytes)

    def tile(i, acc):
        take = lambda a, size: jax.lax.dynamic_slice_in_dim(a, i * size, size, axis=axis)
        part = dequantize_matrix(take(values, rows), take(scale, rows // gk),
                                 None if offset is None else take(offset, rows // gk))
        xs = jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=1)
        dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(xs, part, dims, preferred_element_type=jnp.float32)

    zero = jnp.zeros((x.shape[0], n), jnp.float32)
    return jax.lax.fori_loop(0, k // rows, tile, zero) if k > rows else tile(0, zero)


def _kernel(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None,
            transposed: bool) -> jax.Array:
    gr, gc = groups_of(values.shape, scale.shape)
    gk, gn = (gc, gr) if transposed else (gr, gc)
    n = values.shape[0] if transposed else values.shape[1]
    call = jax.ffi.ffi_call(cpu_kernel.TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), values, scale, scale if offset is None else offset,
                group_k=int(gk), group_n=int(gn), transposed=int(transposed), has_offset=int(offset is not None))


def _dequantize(x, values, scale, offset, transposed):
    # the weight in x's dtype (bfloat16 on GPU / TPU: the dot runs at that dtype's speed), summed in float32
    w = dequantize_matrix(values, scale, offset).astype(x.dtype)
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _k_n_groups(values, scale, transposed) -> tuple[int, int, int, int]:
    """K, N and the elements per scale along each (gk, gn), in either layout."""
    axis = 1 if transposed else 0  # K's axis in values
    groups = groups_of(values.shape, scale.shape)
    return values.shape[axis], values.shape[1 - axis], int(groups[axis]), int(groups[1 - axis])


def _pallas_problem(values, scale, transposed, platform: str) -> str | None:
    k, n, gk, _ = _k_n_groups(values, scale, transposed)
    if platform == "gpu" and values.dtype == jnp.float8_e4m3fn:
        problem = pallas_matmul.gpu_fp8_problem(getattr(jax.devices()[0], "compute_capability", None))
        if problem:
            return problem
    return pallas_matmul.pallas_problem(k, n, gk, _pallas_target(platform))


def _pallas_target(platform: str) -> str:
    return "tpu" if platform == "tpu" else "gpu"  # CPU interprets the GPU kernel


def _pallas(x, values, scale, offset, transposed, platform: str):
    _, _, gk, gn = _k_n_groups(values, scale, transposed)
    return pallas_matmul.quantized_matmul_pallas(x, values, scale, offset, transposed=transposed, group_k=gk,
                                                 group_n=gn, target=_pallas_target(platform),
                                                 interpret=platform == "cpu")


def _auto(args, tile_bytes):
    """$DCPJAX_QUANTIZED_MATMUL, where it applies: "pallas" serves each weight the kernel can tile (the
    platform's default the others); else the platform's default."""
    chosen = os.environ.get(BACKEND_ENV, "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"${BACKEND_ENV} must be one of {BACKENDS}, got {chosen!r}")
    platform = jax.default_backend()
    if chosen == "pallas" and _pallas_problem(args[1], args[2], args[4], platform) is None:
        return _pallas(*args, platform)
    if chosen not in ("auto", "pallas"):
        return _run(chosen, args, tile_bytes)
    return jax.lax.platform_dependent(cpu=lambda: _on_cpu(*args, tile_bytes), default=lambda: _dequantize(*args))


def _on_cpu(x, values, scale, offset, transposed, tile_bytes):
    # platform_dependent traces every branch: a GPU / TPU host neither builds the kernel nor warns about it
    on_cpu_host = jax.default_backend() == "cpu"
    if x.shape[0] <= KERNEL_MAX_ROWS or transposed:  # a table: never its vocabulary-sized float copy
        if on_cpu_host and cpu_kernel.available():
            return _kernel(x, values, scale, offset, transposed)
        return _tiled(x, values, scale, offset, transposed, tile_bytes)
    return _dequantize(x, values, scale, offset, transposed)


def quantized_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None = None, *,
                     transposed: bool = False, backend: str = "auto", tile_bytes: int = TILE_BYTES) -> jax.Array:
    """x [..., K] @ dequantize(values, scale, offset) -> [..., N] float32 (layouts: the module docstring).

    Runs on the arrays it is given: inside `shard_map`, each device's shard (a TP cut through a block is
    exact because the groups follow from the local shapes). A custom call declares no varying mesh axes,
    so such a `shard_map` runs with `check_vma=False`, as dcpjax's model runner does."""
    if backend not in BACKENDS:
        raise ValueError(f"quantized_matmul backend must be one of {BACKENDS}, got {backend!r}")
    if values.ndim != 2 or scale.ndim != 2 or (offset is not None and offset.shape != scale.shape):
        raise ValueError(f"quantized_matmul takes 2-D values and scales of one shape, got values {values.shape}, "
                         f"scale {scale.shape}, offset {None if offset is None else offset.shape}")
    if any(n % s for n, s in zip(values.shape, scale.shape)):
        raise ValueError(f"scale {scale.shape} does not divide values {values.shape} into whole blocks")
    k = values.shape[1] if transposed else values.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis {x.shape[-1]} is not the weight's K {k} (values {values.shape}, "
                         f"transposed={transposed})")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    y = _run(backend, (x2, values, scale, offset, transposed), tile_bytes)
    return y.reshape(*lead, y.shape[-1])


def _run(backend: str, args: tuple, tile_bytes: int) -> jax.Array:
    if backend == "kernel":
        if not cpu_kernel.available():
            raise RuntimeError("the compiled CPU kernel is not available (no C++ compiler, its build failed: see the "
                               "warning logged, or DCPJAX_CPU_KERNEL=0)")
        return _kernel(*args)
    if backend == "tiled":
        return _tiled(*args, tile_bytes)
    if backend == "dequantize":
        return _dequantize(*args)
    if backend == "pallas":
        platform = jax.default_backend()
        problem = _pallas_problem(args[1], args[2], args[4], platform)
        if problem:
            raise ValueError(f"the Pallas quantized matmul cannot tile values {args[1].shape} with scale "
                             f"{args[2].shape}: {problem}; use backend 'auto' or 'dequantize'")
        return _pallas(*args, platform)
    return _auto(args, tile_bytes)
