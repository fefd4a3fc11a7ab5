"""The quantized matmul as a Pallas kernel for GPU (Triton) and TPU (Mosaic): the weight is read as its
int8 / fp8 codes, one K group at a time, and converted in registers (GPU) or VMEM (TPU); no float copy of
the weight exists outside a group's tile.

    y[m, n] = sum over K groups g of  s[g, n] * (x[m, g] . v[g, n])  (+ o[g, n] * sum(x[m, g]))

the order of the compiled CPU kernel (each block summed, then scaled: `matmul.py`). Products run in x's
dtype (bfloat16 on GPU / TPU: tensor-core / MXU speed; float32 at HIGHEST precision) and sum in float32.

The caller (`matmul.quantized_matmul`, backend "pallas") hands over x [M, K] and the values in either layout;
here the scales (and minimums) become [K / gk, N] float32, one per K group and column (a transpose and a
repeat of an array gk * gn times smaller than the weight), and the rows of x are padded to the target's tile.

GPU: grid (row blocks, column blocks, K splits); each program walks its share of the K groups with loads at
dynamic offsets and writes an unsummed partial; the splits are added outside (a decode step has one row
block, so splitting K is what fills the GPU's SMs). TPU: grid (row blocks, column blocks, K chunks), the
chunk axis sequential, the output block resident in VMEM while Pallas pipelines the next chunk's codes from
HBM; the groups of a chunk are static slices. Both run with `interpret=True` on CPU (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import dot_f32

TARGETS = ("gpu", "tpu")
GPU_BLOCK_ROWS = 64  # rows of x per program: a decode batch in one (Triton's dot needs >= 16)
TPU_BLOCK_ROWS = 256  # rows of x per TPU grid step
TPU_CHUNK_BYTES = 1 << 20  # a chunk of codes per grid step: 1 MiB, double-buffered in VMEM
TPU_MAX_CHUNK_BYTES = 4 << 20  # where K has no smaller chunk, the most codes a step may hold


def column_block(n: int, target: str) -> int | None:
    """Columns per program: the widest of 256..16 (GPU) or 512..128 (TPU lanes) dividing N, or N itself
    when it is a small power of two; None when nothing tiles N."""
    widths = (256, 128, 64, 32, 16) if target == "gpu" else (512, 256, 128)
    fits = [w for w in widths if n % w == 0]
    if fits:
        return fits[0]
    return n if target == "tpu" and n <= 512 and n % 8 == 0 else None


def pallas_problem(k: int, n: int, group_k: int, target: str) -> str | None:
    """Why the Pallas kernel cannot tile a [K, N] weight with K groups of `group_k`, or None if it can."""
    if target not in TARGETS:
        return f"target must be one of {TARGETS}, got {target!r}"
    if group_k < 16 or group_k & (group_k - 1):
        return f"its K groups must be a power of two >= 16 (a tensor-core dot's depth), got {group_k}"
    columns = column_block(n, target)
    if columns is None:
        need = "a multiple of 16" if target == "gpu" else "a multiple of 128, or of 8 up to 512"
        return f"N = {n} has no column block ({need})"
    if target == "tpu" and _tpu_chunk(k, columns, group_k) * columns > TPU_MAX_CHUNK_BYTES:
        return f"K = {k} has no chunk of whole groups (a multiple of 128 and of 8 groups) within VMEM"
    return None


def gpu_fp8_problem(compute_capability: str | None) -> str | None:
    """fp8 codes on a GPU: Triton converts float8_e4m3fn from compute capability 8.9 (Ada, Hopper) on."""
    if compute_capability and tuple(int(p) for p in compute_capability.split(".")[:2]) < (8, 9):
        return f"fp8 codes need compute capability >= 8.9 in Triton, this GPU has {compute_capability}"
    return None


def scales_by_group_and_column(scale: jax.Array, transposed: bool, group_n: int) -> jax.Array:
    """[K / gk, N / gn] (or [N / gn, K / gk] when transposed) -> [K / gk, N] float32."""
    per_k = scale.T if transposed else scale
    return jnp.repeat(per_k.astype(jnp.float32), group_n, axis=1)


def _add_group(acc, xg, vg, sg, og, transposed):
    """acc [r, c] += (xg [r, gk] . vg [gk, c] or [c, gk]) * sg [1, c] (+ sum(xg) * og [1, c])."""
    acc = acc + dot_f32(xg, vg.astype(xg.dtype), 1 if transposed else 0) * sg
    if og is not None:
        acc = acc + jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True) * og
    return acc


def _gpu_kernel(x_ref, v_ref, s_ref, *refs, group_k, groups_per_split, transposed, has_offset):
    """x_ref [r, K]; v_ref [K, c] (or [c, K]); s_ref, o_ref [K / gk, c]; out_ref [r, c]: this split's sum."""
    o_ref, out_ref = refs if has_offset else (None, refs[0])
    groups = s_ref.shape[0]
    first = pl.program_id(2) * groups_per_split

    def group(g, acc):
        start = pl.multiple_of(g * group_k, group_k)
        xg = x_ref[:, pl.ds(start, group_k)]
        vg = v_ref[:, pl.ds(start, group_k)] if transposed else v_ref[pl.ds(start, group_k), :]
        og = o_ref[pl.ds(g, 1), :] if has_offset else None
        return _add_group(acc, xg, vg, s_ref[pl.ds(g, 1), :], og, transposed)

    last = jnp.minimum(first + groups_per_split, groups)
    out_ref[...] = jax.lax.fori_loop(first, last, group, jnp.zeros(out_ref.shape, jnp.float32))


def _tpu_kernel(x_ref, v_ref, s_ref, *refs, group_k, transposed, has_offset):
    """x_ref [r, bk]; v_ref [bk, c] (or [c, bk]); s_ref, o_ref [bk / gk, c]; out_ref [r, c] accumulated
    over the chunk axis."""
    o_ref, out_ref = refs if has_offset else (None, refs[0])

    @pl.when(pl.program_id(2) == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    acc = out_ref[...]
    for g in range(s_ref.shape[0]):  # static: each group a static slice of the chunk
        cut = slice(g * group_k, (g + 1) * group_k)
        vg = v_ref[:, cut] if transposed else v_ref[cut, :]
        og = o_ref[g:g + 1, :] if has_offset else None
        acc = _add_group(acc, x_ref[:, cut], vg, s_ref[g:g + 1, :], og, transposed)
    out_ref[...] = acc


def _padded_rows(m: int, target: str) -> int:
    """Rows of x padded to the target's tile: GPU a power of two >= 16 (Triton's dot), then whole blocks of
    GPU_BLOCK_ROWS; TPU a multiple of 8 sublanes, then whole blocks of TPU_BLOCK_ROWS."""
    if target == "tpu":
        return -(-m // 8) * 8 if m <= TPU_BLOCK_ROWS else -(-m // TPU_BLOCK_ROWS) * TPU_BLOCK_ROWS
    return max(16, pl.next_power_of_2(m)) if m <= GPU_BLOCK_ROWS else -(-m // GPU_BLOCK_ROWS) * GPU_BLOCK_ROWS


def _tpu_chunk(k: int, columns: int, group_k: int, chunk_bytes: int = TPU_CHUNK_BYTES) -> int:
    """K per TPU grid step: a multiple of 128 lanes (x's block) and of 8 groups (the scales' sublanes)
    dividing K, its codes within `chunk_bytes`; all of K when no such chunk exists."""
    step = math.lcm(128, 8 * group_k)
    fits = [size for size in range(step, k, step) if k % size == 0 and size * columns <= chunk_bytes]
    return fits[-1] if fits else k


def default_num_splits(row_blocks: int, column_blocks: int, groups: int, interpret: bool) -> int:
    if interpret:
        return 1  # a CPU core gains nothing from more programs
    target_programs = 264  # two waves of an H100 / H200's 132 SMs
    return max(1, min(groups, -(-target_programs // (row_blocks * column_blocks))))


@functools.partial(jax.jit, static_argnames=("transposed", "group_k", "group_n", "target", "interpret",
                                             "num_splits", "tpu_chunk_bytes"))
def quantized_matmul_pallas(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None, *,
                            transposed: bool, group_k: int, group_n: int, target: str, interpret: bool,
                            num_splits: int | None = None, tpu_chunk_bytes: int = TPU_CHUNK_BYTES) -> jax.Array:
    """x [M, K] @ dequantize(values, scale, offset) -> [M, N] float32 (shapes checked by the caller and
    `pallas_problem`): values [K, N] (or [N, K] when transposed) int8 / float8_e4m3fn; scale, offset
    [K / gk, N / gn] (or [N / gn, K / gk])."""
    m, k = x.shape
    n = values.shape[0] if transposed else values.shape[1]
    groups, rows = k // group_k, _padded_rows(m, target)
    compute = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    x = jnp.pad(x.astype(compute), ((0, rows - m), (0, 0)))
    per_column = [scales_by_group_and_column(a, transposed, group_n) for a in (scale, offset) if a is not None]
    c = column_block(n, target)
    has_offset = offset is not None
    codes_block = (lambda kk: (c, kk)) if transposed else (lambda kk: (kk, c))
    if target == "gpu":
        block_rows = min(rows, GPU_BLOCK_ROWS)
        per_split = -(-groups // (num_splits or default_num_splits(rows // block_rows, n // c, groups, interpret)))
        splits = -(-groups // per_split)  # no program without a group
        codes_at = (lambda i, j, s: (j, 0)) if transposed else (lambda i, j, s: (0, j))
        partial = pl.pallas_call(
            functools.partial(_gpu_kernel, group_k=group_k, groups_per_split=per_split, transposed=transposed,
                              has_offset=has_offset),
            grid=(rows // block_rows, n // c, splits),
            in_specs=[pl.BlockSpec((block_rows, k), lambda i, j, s: (i, 0)),
                      pl.BlockSpec(codes_block(k), codes_at)]
            + [pl.BlockSpec((groups, c), lambda i, j, s: (0, j))] * len(per_column),
            out_specs=pl.BlockSpec((None, block_rows, c), lambda i, j, s: (s, i, j)),
            out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
            interpret=interpret,
            compiler_params=None if interpret else _triton_params(),
            name="dcpjax_quantized_matmul_gpu",
        )(x, values, *per_column)
        return partial.sum(axis=0)[:m]
    chunk, block_rows = _tpu_chunk(k, c, group_k, tpu_chunk_bytes), min(rows, TPU_BLOCK_ROWS)
    codes_at = (lambda i, j, kk: (j, kk)) if transposed else (lambda i, j, kk: (kk, j))
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, group_k=group_k, transposed=transposed, has_offset=has_offset),
        grid=(rows // block_rows, n // c, k // chunk),
        in_specs=[pl.BlockSpec((block_rows, chunk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec(codes_block(chunk), codes_at)]
        + [pl.BlockSpec((chunk // group_k, c), lambda i, j, kk: (kk, j))] * len(per_column),
        out_specs=pl.BlockSpec((block_rows, c), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _tpu_params(),
        name="dcpjax_quantized_matmul_tpu",
    )(x, values, *per_column)
    return out[:m]


def _triton_params():
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=3)


def _tpu_params():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
