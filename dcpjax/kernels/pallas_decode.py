"""Pallas split-K decode attention over paged KV, returning (out, lse).

One program per (sequence, KV head, KV split) loads the group's query heads
once, walks its share of the sequence's pages with an online softmax in
float32, and writes an unmerged partial (out, lse). The splits are then merged
with the same exact LSE merge that DCP uses across devices. Contiguous KV is a
free reshape into pages with an identity block table, so one kernel serves both.

GPU (Triton lowering): loaded tiles must be powers of two, so the query group is
padded to a power of two >= 16 and head dims are loaded in power-of-two chunks
(MLA's 576 = 512 + 64). Page size must be a power of two >= 16 there. On CPU the
kernel runs with `interpret=True` (tests); TPU uses the reference path for now.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dcpjax.kernels.common import DecodeShapes, check_decode_args, default_sm_scale
from dcpjax.sharding.merge import merge_partials

MIN_GROUP_ROWS = 16  # Triton's dot needs M >= 16
MAX_CONTIGUOUS_PAGE = 128


def pow2_chunks(size: int) -> tuple[tuple[int, int], ...]:
    """(start, width) power-of-two pieces of [0, size), largest first: 576 -> (0,512),(512,64)."""
    chunks, start = [], 0
    while size:
        width = 1 << (size.bit_length() - 1)
        chunks.append((start, width))
        start, size = start + width, size - width
    return tuple(chunks)


def contiguous_page_size(seq: int, limit: int = MAX_CONTIGUOUS_PAGE) -> int:
    """Largest power of two <= limit that divides seq (so paging contiguous KV is a reshape)."""
    page = 1
    while page * 2 <= limit and seq % (page * 2) == 0:
        page *= 2
    return page


def default_num_splits(batch: int, kv_heads: int, pages: int, interpret: bool) -> int:
    if interpret:
        return 1  # a CPU core gains nothing from more programs
    target_programs = 256  # ~2 waves of an H100/H200's SMs
    return max(1, min(pages, math.ceil(target_programs / (batch * kv_heads))))


def _decode_kernel(
    lengths_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, lse_ref,
    *, sm_scale, block_size, pages_per_split, k_chunks, v_chunks, v_from_k,
):
    """q_ref [Gp, dk]; k_ref [N, bs, Hkv, dk]; v_ref [N, bs, Hkv, dv] (unused if v_from_k);
    tables_ref [B, P]; lengths_ref [B]; out_ref [Gp, dv] f32; lse_ref [Gp] f32."""
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[seq]
    first_page = split * pages_per_split
    num_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_split)
    q_parts = [q_ref[:, pl.ds(start, width)] for start, width in k_chunks]
    rows = q_parts[0].shape[0]

    def dot(a, b, contract_b: int):
        # float32 inputs: full precision, not TF32 (Triton's default on GPU).
        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jax.lax.dot_general(
            a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    def visit_page(i, carry):
        row_max, row_sum, accs = carry
        page_index = first_page + i
        page = tables_ref[seq, page_index]
        k_parts = [k_ref[page, :, head, pl.ds(start, width)] for start, width in k_chunks]  # [bs, w]
        scores = sum(dot(qp, kp, 1) for qp, kp in zip(q_parts, k_parts)) * sm_scale  # [Gp, bs]
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
            v_parts = [v_ref[page, :, head, pl.ds(start, width)] for start, width in v_chunks]
        accs = tuple(
            acc * rescale[:, None] + dot(probs.astype(vp.dtype), vp, 0) for acc, vp in zip(accs, v_parts)
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


def _compiler_params(interpret: bool):
    # Triton, not Mosaic GPU: it lowers this kernel on jax 0.10 - 0.12 alike. A
    # CPU host that lowers for GPU (jax.export) lands here too.
    if interpret or jax.default_backend() == "tpu":
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def decode_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    num_kv_splits: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas decode attention; contract in `dcpjax.kernels.common`.

    Returns out [batch, q_heads, dv] (q.dtype) and lse [batch, q_heads] float32.
    """
    shapes = check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if not shapes.paged:  # contiguous -> pages of one sequence each, identity table
        batch, seq = k.shape[:2]
        page = contiguous_page_size(seq)
        k = k.reshape(batch * (seq // page), page, *k.shape[2:])
        v = None if v is None else v.reshape(batch * (seq // page), page, *v.shape[2:])
        block_tables = jnp.arange(batch * (seq // page), dtype=jnp.int32).reshape(batch, seq // page)
    return _paged_call(
        q, k, v, lengths.astype(jnp.int32), block_tables.astype(jnp.int32), shapes,
        default_sm_scale(shapes.dk, sm_scale), num_kv_splits, bool(interpret),
    )


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8))
def _paged_call(q, k, v, lengths, block_tables, shapes: DecodeShapes, sm_scale, num_kv_splits, interpret):
    batch, kv_heads, group, dk, dv = shapes.batch, shapes.kv_heads, shapes.group, shapes.dk, shapes.dv
    block_size, pages = k.shape[1], block_tables.shape[1]
    rows = max(MIN_GROUP_ROWS, pl.next_power_of_2(group)) if not interpret else group
    splits = num_kv_splits or default_num_splits(batch, kv_heads, pages, interpret)
    splits = max(1, min(splits, pages))
    pages_per_split = pl.cdiv(pages, splits)

    qg = q.reshape(batch, kv_heads, group, dk)
    if rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    k_chunks, v_chunks = pow2_chunks(dk), pow2_chunks(dv)
    v_from_k = v is None and k_chunks[: len(v_chunks)] == v_chunks
    values = k if v is None else v  # MLA: V is the first dv features of K

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, block_size=block_size, pages_per_split=pages_per_split,
        k_chunks=k_chunks, v_chunks=v_chunks, v_from_k=v_from_k,
    )
    partial_out, partial_lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            whole(lengths.shape),
            whole(block_tables.shape),
            pl.BlockSpec((None, None, rows, dk), lambda b, h, s: (b, h, 0, 0)),
            whole(k.shape),
            whole(values.shape),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dv), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="dcpjax_decode_attention",
    )(lengths, block_tables, qg, k, values)
    out, lse = merge_partials(partial_out, partial_lse, axis=2)  # [B, Hkv, rows, dv], [B, Hkv, rows]
    out = out[:, :, :group].reshape(batch, shapes.q_heads, dv).astype(q.dtype)
    return out, lse[:, :, :group].reshape(batch, shapes.q_heads)
