"""Pallas GPU (Triton) split-K decode kernel over paged KV.

One program per (sequence, KV head, KV split) loads the group's query rows
once, walks its share of the sequence's pages with an online softmax in
float32, and writes an unmerged partial (out, lse); the splits are merged with
the same exact LSE merge that DCP uses across devices. Triton tiles must be
powers of two: query rows are padded by the caller, head dims are loaded in
power-of-two chunks (MLA's 576 = 512 + 64), and pages must be a power of two
(>= 16 for tensor-core dots). Also runs with `interpret=True` on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import dot_f32
from dcpjax.sharding.merge import merge_partials


def pow2_chunks(size: int) -> tuple[tuple[int, int], ...]:
    """(start, width) power-of-two pieces of [0, size), largest first: 576 -> (0,512),(512,64)."""
    chunks, start = [], 0
    while size:
        width = 1 << (size.bit_length() - 1)
        chunks.append((start, width))
        start, size = start + width, size - width
    return tuple(chunks)


def rows_per_program(rows: int, dk: int, dv: int, max_elements: int = 16384) -> int:
    """Query rows one program holds: its q tile [r, dk] sits in shared memory (the dot's
    A operand, loaded once) and its f32 accumulator [r, dv] in registers, so r * max(dk, dv)
    is capped (16384 elements: 64 KiB of f32 q; 128 f32 registers a thread at 4 warps).
    Power of two, >= 16 (tensor-core dots). MLA's 128 rows x 576 -> 16; GQA's 16 x 128 -> 16."""
    r = rows
    while r > 16 and r * max(dk, dv) > max_elements:
        r //= 2
    return r


def default_num_splits(batch: int, kv_heads: int, pages: int, interpret: bool) -> int:
    if interpret:
        return 1  # a CPU core gains nothing from more programs
    target_programs = 264  # two waves of an H100/H200's 132 SMs
    return max(1, min(pages, math.ceil(target_programs / (batch * kv_heads))))


def _gpu_kernel(
    lengths_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
    sm_scale, block_size, pages_per_split, k_chunks, v_chunks, v_from_k, scaled, row_blocks,
):
    """q_ref [rows, dk]; k_ref [N, bs, Hkv, dk]; v_ref [N, bs, Hkv, dv] (unused if v_from_k);
    if scaled (fp8 cache): ks_ref, vs_ref [N, bs, Hkv] per-token dequantisation scales;
    tables_ref [B, P]; lengths_ref [B]; out_ref [rows, dv] f32; lse_ref [rows] f32."""
    (ks_ref, vs_ref, out_ref, lse_ref) = refs if scaled else (None, None, *refs)
    seq, split = pl.program_id(0), pl.program_id(2)
    head = pl.program_id(1) // row_blocks  # axis 1 walks (KV head, block of query rows)
    length = lengths_ref[seq]
    first_page = split * pages_per_split
    num_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_split)
    q_parts = [q_ref[:, pl.ds(start, width)] for start, width in k_chunks]
    rows = q_parts[0].shape[0]

    def visit_page(i, carry):
        row_max, row_sum, accs = carry
        page_index = first_page + i
        page = tables_ref[seq, page_index]
        k_parts = [k_ref[page, :, head, pl.ds(start, width)].astype(q_parts[0].dtype) for start, width in k_chunks]
        scores = sum(dot_f32(qp, kp, 1) for qp, kp in zip(q_parts, k_parts)) * sm_scale  # [rows, bs]
        if scaled:  # per-token scales fold into the scores and the probabilities
            scores = scores * ks_ref[page, :, head][None, :]
        positions = page_index * block_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(positions < length, scores, -jnp.inf)
        # Only pages holding >= 1 valid token are visited, so new_max is finite.
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        rescale = jnp.exp(row_max - new_max)
        probs = jnp.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + jnp.sum(probs, axis=1)
        if v_from_k:
            v_parts = k_parts[: len(v_chunks)]
        else:
            v_parts = [v_ref[page, :, head, pl.ds(start, width)].astype(q_parts[0].dtype) for start, width in v_chunks]
        weighted = probs * vs_ref[page, :, head][None, :] if scaled else probs
        accs = tuple(
            acc * rescale[:, None] + dot_f32(weighted.astype(vp.dtype), vp, 0) for acc, vp in zip(accs, v_parts)
        )
        return new_max, row_sum, accs

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        tuple(jnp.zeros((rows, width), jnp.float32) for _, width in v_chunks),
    )
    row_max, row_sum, accs = jax.lax.fori_loop(0, num_pages, visit_page, init)
    has_tokens = row_sum > 0
    denominator = jnp.where(has_tokens, row_sum, 1.0)
    for (start, width), acc in zip(v_chunks, accs):
        out_ref[:, pl.ds(start, width)] = acc / denominator[:, None]
    lse_ref[...] = jnp.where(has_tokens, row_max + jnp.log(denominator), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "num_splits", "interpret"))
def paged_decode_gpu(qg, k, v, lengths, block_tables, k_scale=None, v_scale=None, *, sm_scale: float, dv: int,
                     num_splits: int | None, interpret: bool = False):
    """Split-K decode over pages.

    Args:
      qg: [batch, kv_heads, rows, dk] query heads grouped by KV head (rows padded).
      k: [num_blocks, block_size, kv_heads, dk]; v: [..., dv] or None (V = K[..., :dv]).
      k_scale, v_scale: [num_blocks, block_size, kv_heads] float32 for an fp8 cache (else None).
      lengths: [batch] int32; block_tables: [batch, pages] int32.
    Returns out [batch, kv_heads, rows, dv] f32 and lse [batch, kv_heads, rows] f32.
    """
    batch, kv_heads, rows, dk = qg.shape
    block_size, pages = k.shape[1], block_tables.shape[1]
    block_rows = rows_per_program(rows, dk, dv)
    row_blocks = rows // block_rows
    splits = max(1, min(num_splits or default_num_splits(batch, kv_heads * row_blocks, pages, interpret), pages))
    pages_per_split = pl.cdiv(pages, splits)
    k_chunks, v_chunks = pow2_chunks(dk), pow2_chunks(dv)
    v_from_k = v is None and k_chunks[: len(v_chunks)] == v_chunks  # MLA: reuse K's loaded latent
    values = k if v is None else v

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    scaled = k_scale is not None
    scales = [k_scale, k_scale if v_scale is None else v_scale] if scaled else []
    kernel = functools.partial(
        _gpu_kernel, sm_scale=sm_scale, block_size=block_size, pages_per_split=pages_per_split,
        k_chunks=k_chunks, v_chunks=v_chunks, v_from_k=v_from_k, scaled=scaled, row_blocks=row_blocks,
    )
    compiler_params = None
    if not interpret:  # Triton, not Mosaic GPU: it lowers this kernel on jax 0.10 - 0.12 alike
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    partial_out, partial_lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads * row_blocks, splits),
        in_specs=[
            whole(lengths.shape),
            whole(block_tables.shape),
            pl.BlockSpec((None, None, block_rows, dk), lambda b, g, s: (b, g // row_blocks, g % row_blocks, 0)),
            whole(k.shape),
            whole(values.shape),
        ] + [whole(x.shape) for x in scales],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, dv), lambda b, g, s: (b, g // row_blocks, s, g % row_blocks, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda b, g, s: (b, g // row_blocks, s, g % row_blocks)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="dcpjax_decode_attention_gpu",
    )(lengths, block_tables, qg, k, values, *scales)
    return merge_partials(partial_out, partial_lse, axis=2)
