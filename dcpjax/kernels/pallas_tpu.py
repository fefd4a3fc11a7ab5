"""Pallas TPU (Mosaic) decode kernel over paged KV: one page per grid step.

Grid (sequence, KV head, page), the page axis sequential ("arbitrary"): the
block table and lengths are scalar-prefetched into SMEM and pick, per step,
the physical page whose K/V block Pallas pipelines from HBM into VMEM. A
running max, sum and accumulator live in VMEM scratch (online softmax, float32);
the last page writes out and LSE. Pages past a sequence's length re-use the
index of its last valid page, so they cost no DMA and no compute.

TPU tiling: K/V are viewed as [num_blocks, block_size, kv_heads * d] and one
head is the block (block_size, d) along the last axis, so d must be a multiple
of 128 unless there is a single KV head (as on every DCP rank, and for MLA).
The LSE is written broadcast over 128 lanes, the TPU's natural row layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dcpjax.kernels.common import dot_f32

LANES = 128
SUBLANES = 8


def tpu_tiling_problem(kv_heads: int, dk: int, dv: int, block_size: int, shared_kv: bool,
                       scaled: bool = False) -> str | None:
    """Why this kernel cannot tile these shapes on TPU, or None if it can."""
    if scaled and kv_heads > 1:
        return f"an fp8 cache needs one KV head per device on TPU (its scales tile per head), got {kv_heads}"
    if block_size % SUBLANES:
        return f"block_size must be a multiple of {SUBLANES} on TPU, got {block_size}"
    if kv_heads > 1 and (dk % LANES or dv % LANES):
        return f"with {kv_heads} KV heads per device, head dims must be multiples of {LANES} (got dk={dk}, dv={dv})"
    if shared_kv and dv % LANES and dv != dk:
        return f"MLA latent width v_head_dim must be a multiple of {LANES} on TPU, got {dv}"
    return None


def _tpu_kernel(lengths_ref, tables_ref, q_ref, k_ref, *refs, sm_scale, block_size, dv, v_from_k, scaled):
    """q_ref [rows, dk]; k_ref [bs, dk]; then v_ref [bs, dv] unless v_from_k (MLA: V is K's
    first dv lanes, so K is fetched once); then, for an fp8 cache, ks_ref and vs_ref [bs, 1];
    out_ref [rows, dv]; lse_ref [rows, LANES]; scratch max_scr, sum_scr [rows, LANES]
    (all lanes equal) and acc_scr [rows, dv]."""
    refs = list(refs)
    v_ref = None if v_from_k else refs.pop(0)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
    out_ref, lse_ref, max_scr, sum_scr, acc_scr = refs
    seq, page = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[seq]

    @pl.when(page == 0)
    def _init():
        max_scr[...] = jnp.full(max_scr.shape, -jnp.inf, jnp.float32)
        sum_scr[...] = jnp.zeros(sum_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(page * block_size < length)
    def _visit():
        q = q_ref[...]
        k = k_ref[...].astype(q.dtype)
        scores = dot_f32(q, k, 1) * sm_scale  # [rows, bs]
        if scaled:  # per-token scales fold into the scores and the probabilities
            scores = scores * jnp.transpose(ks_ref[...])
        positions = page * block_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(positions < length, scores, -jnp.inf)
        old_max = max_scr[...]
        new_max = jnp.maximum(old_max, jnp.max(scores, axis=1, keepdims=True))  # this page has a valid token
        rescale = jnp.exp(old_max - new_max)
        probs = jnp.exp(scores - new_max[:, :1])
        sum_scr[...] = sum_scr[...] * rescale + jnp.sum(probs, axis=1, keepdims=True)
        values = k[:, :dv] if v_from_k else v_ref[...].astype(q.dtype)
        weighted = probs * jnp.transpose(vs_ref[...]) if scaled else probs
        acc_scr[...] = acc_scr[...] * rescale[:, :1] + dot_f32(weighted.astype(values.dtype), values, 0)
        max_scr[...] = new_max

    @pl.when(page == pl.num_programs(2) - 1)
    def _finish():
        total = sum_scr[...]
        has_tokens = total > 0
        denominator = jnp.where(has_tokens, total, 1.0)
        out_ref[...] = acc_scr[...] / denominator[:, :1]
        lse_ref[...] = jnp.where(has_tokens, max_scr[...] + jnp.log(denominator), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "interpret"))
def paged_decode_tpu(qg, k, v, lengths, block_tables, k_scale=None, v_scale=None, *, sm_scale: float, dv: int,
                     interpret: bool = False):
    """Decode attention over pages on TPU (no KV splits: one core walks a sequence).

    Args:
      qg: [batch, kv_heads, rows, dk] query heads grouped by KV head (rows padded).
      k: [num_blocks, block_size, kv_heads, dk]; v: [..., dv] or None (V = K[..., :dv]).
      lengths: [batch] int32; block_tables: [batch, pages] int32.
      k_scale, v_scale: [num_blocks, block_size, 1] float32 for an fp8 cache (one KV head), else None.
    Returns out [batch, kv_heads, rows, dv] f32 and lse [batch, kv_heads, rows] f32.
    """
    batch, kv_heads, rows, dk = qg.shape
    scaled = k_scale is not None
    num_blocks, block_size = k.shape[:2]
    pages = block_tables.shape[1]
    v_from_k = v is None
    # One head is a lane-aligned slice of the flattened last axis: a free reshape.
    kv_inputs = [k.reshape(num_blocks, block_size, kv_heads * dk)]
    if not v_from_k:
        kv_inputs.append(v.reshape(num_blocks, block_size, kv_heads * dv))
    if scaled:
        kv_inputs += [k_scale, k_scale if v_scale is None else v_scale]

    def kv_block(b, h, p, lengths_ref, tables_ref):
        last_page = jnp.maximum(pl.cdiv(lengths_ref[b], block_size) - 1, 0)
        return tables_ref[b, jnp.minimum(p, last_page)], 0, h

    per_head = lambda b, h, p, *_: (b, h, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, kv_heads, pages),
        in_specs=[
            pl.BlockSpec((None, None, rows, dk), per_head),
            pl.BlockSpec((None, block_size, dk), kv_block),
        ] + ([] if v_from_k else [pl.BlockSpec((None, block_size, dv), kv_block)])
        + ([pl.BlockSpec((None, block_size, 1), kv_block)] * 2 if scaled else []),
        out_specs=[
            pl.BlockSpec((None, None, rows, dv), per_head),
            pl.BlockSpec((None, None, rows, LANES), per_head),
        ],
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, dv), jnp.float32),
        ],
    )
    kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, block_size=block_size, dv=dv, v_from_k=v_from_k,
                               scaled=scaled)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, rows, LANES), jnp.float32),
        ],
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="dcpjax_decode_attention_tpu",
    )(lengths, block_tables, qg, *kv_inputs)
    return out, lse[..., 0]
