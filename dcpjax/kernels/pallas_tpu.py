"""Pallas TPU (Mosaic) attention kernel over paged KV, for a tile of queries: one page per grid step.

The query rows of one (sequence, KV head) are the T queries x G heads of its group
(T = 1 at decode), each row with its own causal bound. Grid (sequence, KV head,
block of rows, page), the page axis sequential ("arbitrary"): the block table and
each row block's longest bound are scalar-prefetched into SMEM and pick, per step,
the physical page whose K/V block Pallas pipelines from HBM into VMEM, so a page
is fetched once per block of rows, not once per query. A running max, sum and
accumulator live in VMEM scratch (online softmax, float32); the last page writes out
and LSE. Pages past a block's longest bound re-use the index of its last valid page,
so they cost no DMA and no compute; so do pages before a block's lowest start (packed rows).

TPU tiling: the pools are heads first, [kv_heads, num_blocks, block_size, d], so one
head's page is the block (block_size, d) spanning the two minor axes whole: legal for
any head dim and any number of KV heads (fp8 scales ride along as [.., block_size, 1]).
The LSE is written broadcast over 128 lanes, the TPU's natural row layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dcpjax.kernels.common import dot_f32, soft_cap

LANES = 128
SUBLANES = 8


def tpu_tiling_problem(kv_heads: int, dk: int, dv: int, block_size: int, shared_kv: bool,
                       scaled: bool = False) -> str | None:
    """Why this kernel cannot tile these shapes on TPU, or None if it can.

    kv_heads and scaled no longer constrain it (heads-first pools); kept in the signature so
    callers describe the whole cache."""
    if block_size % SUBLANES:
        return f"block_size must be a multiple of {SUBLANES} on TPU, got {block_size}"
    if shared_kv and dv % LANES and dv != dk:
        return f"MLA latent width v_head_dim must be a multiple of {LANES} on TPU, got {dv}"
    return None


def tpu_block_rows(rows: int, dk: int, dv: int, max_elements: int = 131072) -> int:
    """Query rows per grid step: a multiple of 8 with block_rows * max(dk, dv) capped, so the
    q block and the f32 accumulator (512 KiB each at the cap) sit in VMEM with room to spare."""
    cap = max(SUBLANES, max_elements // max(dk, dv) // SUBLANES * SUBLANES)
    return min(-(-rows // SUBLANES) * SUBLANES, cap)


def _tpu_kernel(tables_ref, tile_bound_ref, tile_start_ref, q_ref, bounds_ref, starts_ref, k_ref, *refs, sm_scale,
                block_size, dv, v_from_k, scaled, softcap):
    """One grid step's block of rows (r = block_rows) and page: q_ref [r, dk]; bounds_ref [r, 1]
    causal bound per row, starts_ref [r, 1] its first visible token; k_ref [bs, dk]; then v_ref
    [bs, dv] unless v_from_k (MLA: V is K's first dv lanes, so K is fetched once); then, for an
    fp8 cache, ks_ref and vs_ref [bs, 1];
    out_ref [r, dv]; lse_ref [r, LANES]; scratch max_scr, sum_scr [r, LANES] (all lanes equal)
    and acc_scr [r, dv]. Scalar-prefetched (SMEM): tables_ref [B, P], tile_bound_ref and
    tile_start_ref [B, row_blocks] (the block's highest bound and lowest start)."""
    refs = list(refs)
    v_ref = None if v_from_k else refs.pop(0)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
    out_ref, lse_ref, max_scr, sum_scr, acc_scr = refs
    seq, row_block, page = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(page == 0)
    def _init():
        max_scr[...] = jnp.full(max_scr.shape, -jnp.inf, jnp.float32)
        sum_scr[...] = jnp.zeros(sum_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when((page * block_size < tile_bound_ref[seq, row_block])
             & ((page + 1) * block_size > tile_start_ref[seq, row_block]))
    def _visit():
        q = q_ref[...]
        k = k_ref[...].astype(q.dtype)
        scores = dot_f32(q, k, 1) * sm_scale  # [rows, bs]
        if scaled:  # per-token scales fold into the scores and the probabilities
            scores = scores * jnp.transpose(ks_ref[...])
        scores = soft_cap(scores, softcap)
        positions = page * block_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where((positions >= starts_ref[...]) & (positions < bounds_ref[...]), scores, -jnp.inf)
        old_max = max_scr[...]
        new_max = jnp.maximum(old_max, jnp.max(scores, axis=1, keepdims=True))
        safe_max = jnp.where(new_max > -jnp.inf, new_max, 0.0)  # a row may see none of this page
        rescale = jnp.exp(old_max - safe_max)
        probs = jnp.exp(scores - safe_max[:, :1])
        sum_scr[...] = sum_scr[...] * rescale + jnp.sum(probs, axis=1, keepdims=True)
        values = k[:, :dv] if v_from_k else v_ref[...].astype(q.dtype)
        weighted = probs * jnp.transpose(vs_ref[...]) if scaled else probs
        acc_scr[...] = acc_scr[...] * rescale[:, :1] + dot_f32(weighted.astype(values.dtype), values, 0)
        max_scr[...] = new_max

    @pl.when(page == pl.num_programs(3) - 1)
    def _finish():
        total = sum_scr[...]
        has_tokens = total > 0
        denominator = jnp.where(has_tokens, total, 1.0)
        out_ref[...] = acc_scr[...] / denominator[:, :1]
        lse_ref[...] = jnp.where(has_tokens, max_scr[...] + jnp.log(denominator), -jnp.inf)


def _grid_spec(grid, block_rows: int, block_size: int, dk: int, dv: int, v_from_k: bool, scaled: bool):
    """Blocks of one grid step (sequence b, KV head h, row block r, page p): the row block's
    q and bounds, the page's K (and V, scales) picked through the prefetched block table."""

    def kv_block(b, h, r, p, tables_ref, tile_bound_ref, tile_start_ref):
        last_page = jnp.maximum(pl.cdiv(tile_bound_ref[b, r], block_size) - 1, 0)
        first_page = jnp.minimum(tile_start_ref[b, r] // block_size, last_page)
        return h, tables_ref[b, jnp.clip(p, first_page, last_page)], 0, 0

    rows_of = lambda b, h, r, p, *_: (b, h, r, 0)
    per_row = pl.BlockSpec((None, block_rows, 1), lambda b, h, r, p, *_: (b, r, 0))
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, block_rows, dk), rows_of),
            per_row,
            per_row,
            pl.BlockSpec((None, None, block_size, dk), kv_block),
        ] + ([] if v_from_k else [pl.BlockSpec((None, None, block_size, dv), kv_block)])
        + ([pl.BlockSpec((None, None, block_size, 1), kv_block)] * 2 if scaled else []),
        out_specs=[
            pl.BlockSpec((None, None, block_rows, dv), rows_of),
            pl.BlockSpec((None, None, block_rows, LANES), rows_of),
        ],
        scratch_shapes=[
            pltpu.VMEM((block_rows, LANES), jnp.float32),
            pltpu.VMEM((block_rows, LANES), jnp.float32),
            pltpu.VMEM((block_rows, dv), jnp.float32),
        ],
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "interpret", "block_rows", "softcap"))
def paged_attention_tpu(qg, bounds, starts, k, v, block_tables, k_scale=None, v_scale=None, *, sm_scale: float,
                        dv: int, interpret: bool = False, block_rows: int | None = None,
                        softcap: float | None = None):
    """Attention of query rows over pages on TPU (no KV splits: one core walks a sequence).

    Args:
      qg: [batch, kv_heads, rows, dk] each KV head's (query, head) rows (`common.to_rows`), padded to a multiple of 8.
      bounds: [batch, rows] int32, each row's causal bound (0 for padding rows).
      starts: [batch, rows] int32, each row's first visible token (0 unless packed or windowed).
      k: [kv_heads, num_blocks, block_size, dk]; v: [..., dv] or None (V = K[..., :dv]).
      block_tables: [batch, pages] int32.
      k_scale, v_scale: [kv_heads, num_blocks, block_size] float32 for an fp8 cache, else None.
      block_rows: query rows per grid step (default `tpu_block_rows`; a multiple of 8).
    Returns out [batch, kv_heads, rows, dv] f32 and lse [batch, kv_heads, rows] f32.
    """
    batch, kv_heads, rows, dk = qg.shape
    block_rows = block_rows or tpu_block_rows(rows, dk, dv)
    if block_rows % SUBLANES:
        raise ValueError(f"block_rows must be a multiple of {SUBLANES} on TPU, got {block_rows}")
    row_blocks = -(-rows // block_rows)
    padded = row_blocks * block_rows
    if padded != rows:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        bounds = jnp.pad(bounds, ((0, 0), (0, padded - rows)))
        starts = jnp.pad(starts, ((0, 0), (0, padded - rows)))
    tile_bound = jnp.max(bounds.reshape(batch, row_blocks, block_rows), axis=2)  # [B, row_blocks]
    seeing = jnp.where(bounds > starts, starts, jnp.iinfo(jnp.int32).max)  # rows that see nothing don't count
    tile_start = jnp.min(seeing.reshape(batch, row_blocks, block_rows), axis=2)
    scaled = k_scale is not None
    block_size = k.shape[2]
    v_from_k = v is None
    kv_inputs = [k] if v_from_k else [k, v]
    if scaled:  # [H, N, bs] -> [H, N, bs, 1]: a (bs, 1) block spans both minor axes
        kv_inputs += [k_scale[..., None], (k_scale if v_scale is None else v_scale)[..., None]]

    grid = (batch, kv_heads, row_blocks, block_tables.shape[1])
    grid_spec = _grid_spec(grid, block_rows, block_size, dk, dv, v_from_k, scaled)
    kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, block_size=block_size, dv=dv, v_from_k=v_from_k,
                               scaled=scaled, softcap=softcap)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, padded, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, padded, LANES), jnp.float32),
        ],
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="dcpjax_paged_attention_tpu",
    )(block_tables, tile_bound, tile_start, qg, bounds[..., None], starts[..., None], *kv_inputs)
    return out[:, :, :rows], lse[:, :, :rows, 0]
