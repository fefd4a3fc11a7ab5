"""Pallas GPU (Triton) split-K attention kernel over paged KV, for a tile of queries.

The query rows of one (sequence, KV head) are the T queries x G heads of its group
(T = 1 at decode, a prefill chunk or speculative draft otherwise), each row with its
own causal bound. One program per (sequence, KV head, block of rows, KV split)
loads its rows once, walks its share of the sequence's pages up to the longest
bound among them with an online softmax in float32, and writes an unmerged partial
(out, lse); the splits are merged with the same exact LSE merge that DCP uses across
devices. So a page is loaded once per block of rows, not once per query.

Triton tiles must be powers of two: query rows are padded by the caller, head dims
are loaded in power-of-two chunks (MLA's 576 = 512 + 64), and pages must be a power
of two (>= 16 for tensor-core dots). Also runs with `interpret=True` on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import dot_f32, soft_cap
from dcpjax.kernels.merge import merge_partials


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
    tables_ref, bounds_ref, starts_ref, q_ref, k_ref, v_ref, *refs,
    sm_scale, block_size, pages_per_split, k_chunks, v_chunks, v_from_k, scaled, row_blocks, softcap,
):
    """One program's block of rows (r = block_rows): q_ref [r, dk]; bounds_ref [r] causal bound
    per row and starts_ref [r] its first visible token; k_ref [Hkv, N, bs, dk]; v_ref [Hkv, N, bs,
    dv] (unused if v_from_k); if scaled (fp8 cache): ks_ref, vs_ref [Hkv, N, bs] per-token
    dequantisation scales; tables_ref [B, P]; out_ref [r, dv] f32 and lse_ref [r] f32, this
    split's unmerged partial."""
    (ks_ref, vs_ref, out_ref, lse_ref) = refs if scaled else (None, None, *refs)
    seq, split = pl.program_id(0), pl.program_id(2)
    head = pl.program_id(1) // row_blocks  # axis 1 walks (KV head, block of query rows)
    bounds, starts = bounds_ref[...], starts_ref[...]
    # the pages any row of the block sees: from the lowest start of a row that sees something
    lowest = jnp.min(jnp.where(bounds > starts, starts, jnp.iinfo(jnp.int32).max))
    split_start = split * pages_per_split
    first_page = jnp.clip(lowest // block_size, split_start, split_start + pages_per_split)
    end_page = jnp.minimum(pl.cdiv(jnp.max(bounds), block_size), split_start + pages_per_split)
    num_pages = jnp.maximum(end_page - first_page, 0)
    q_parts = [q_ref[:, pl.ds(start, width)] for start, width in k_chunks]
    rows = q_parts[0].shape[0]

    def visit_page(i, carry):
        row_max, row_sum, accs = carry
        page_index = first_page + i
        page = tables_ref[seq, page_index]
        k_parts = [k_ref[head, page, :, pl.ds(start, width)].astype(q_parts[0].dtype) for start, width in k_chunks]
        scores = sum(dot_f32(qp, kp, 1) for qp, kp in zip(q_parts, k_parts)) * sm_scale  # [rows, bs]
        if scaled:  # per-token scales fold into the scores and the probabilities
            scores = scores * ks_ref[head, page, :][None, :]
        scores = soft_cap(scores, softcap)
        positions = page_index * block_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where((positions >= starts[:, None]) & (positions < bounds[:, None]), scores, -jnp.inf)
        # A row may see no token of this page (shorter bound, padding): keep its max finite.
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        safe_max = jnp.where(new_max > -jnp.inf, new_max, 0.0)
        rescale = jnp.exp(row_max - safe_max)
        probs = jnp.exp(scores - safe_max[:, None])
        row_sum = row_sum * rescale + jnp.sum(probs, axis=1)
        if v_from_k:
            v_parts = k_parts[: len(v_chunks)]
        else:
            v_parts = [v_ref[head, page, :, pl.ds(start, width)].astype(q_parts[0].dtype) for start, width in v_chunks]
        weighted = probs * vs_ref[head, page, :][None, :] if scaled else probs
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


def _triton_params():
    """Triton, not Mosaic GPU: it lowers this kernel on jax 0.10 - 0.12 alike."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "num_splits", "interpret", "block_rows", "softcap"))
def paged_attention_gpu(qg, bounds, starts, k, v, block_tables, k_scale=None, v_scale=None, *, sm_scale: float,
                        dv: int, num_splits: int | None, interpret: bool = False, block_rows: int | None = None,
                        softcap: float | None = None):
    """Split-K attention of query rows over pages.

    Args:
      qg: [batch, kv_heads, rows, dk] each KV head's (query, head) rows (`common.to_rows`), padded to a power of two.
      bounds: [batch, rows] int32, each row's causal bound (0 for padding rows).
      starts: [batch, rows] int32, each row's first visible token (0 unless packed or windowed).
      k: [kv_heads, num_blocks, block_size, dk]; v: [..., dv] or None (V = K[..., :dv]).
      k_scale, v_scale: [kv_heads, num_blocks, block_size] float32 for an fp8 cache (else None).
      block_tables: [batch, pages] int32.
      block_rows: query rows per program (default `rows_per_program`; a power of two dividing rows).
    Returns out [batch, kv_heads, rows, dv] f32 and lse [batch, kv_heads, rows] f32.
    """
    batch, kv_heads, rows, dk = qg.shape
    block_size, pages = k.shape[2], block_tables.shape[1]
    block_rows = min(block_rows or rows_per_program(rows, dk, dv), rows)
    if block_rows & (block_rows - 1) or rows % block_rows:
        raise ValueError(f"block_rows must be a power of two dividing the {rows} padded rows, got {block_rows}")
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
        _gpu_kernel, sm_scale=sm_scale, block_size=block_size, pages_per_split=pages_per_split, k_chunks=k_chunks,
        v_chunks=v_chunks, v_from_k=v_from_k, scaled=scaled, row_blocks=row_blocks, softcap=softcap)
    per_row = pl.BlockSpec((None, block_rows), lambda b, g, s: (b, g % row_blocks))  # bounds, starts
    partial_out, partial_lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads * row_blocks, splits),
        in_specs=[
            whole(block_tables.shape),
            per_row,
            per_row,
            pl.BlockSpec((None, None, block_rows, dk), lambda b, g, s: (b, g // row_blocks, g % row_blocks, 0)),
            whole(k.shape),
            whole(values.shape),
        ] + [whole(x.shape) for x in scales],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, dv),
                         lambda b, g, s: (b, g // row_blocks, s, g % row_blocks, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda b, g, s: (b, g // row_blocks, s, g % row_blocks)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(),
        name="dcpjax_paged_attention_gpu",
    )(block_tables, bounds, starts, qg, k, values, *scales)
    return merge_partials(partial_out, partial_lse, axis=2)
