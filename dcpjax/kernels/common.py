"""Shapes and checks shared by every decode-attention implementation.

The contract (all implementations):
  q:        [batch, q_heads, dk]
  k:        contiguous [batch, seq, kv_heads, dk], or paged
            [num_blocks, block_size, kv_heads, dk] with `block_tables`
  v:        like k with dv last, or None for MLA's latent form (V = K[..., :v_head_dim])
  lengths:  [batch] int, valid tokens per sequence (0 allowed)
  block_tables: [batch, max_blocks] int, paged only
Returns out [batch, q_heads, dv] in q's dtype and lse [batch, q_heads] float32,
natural-log based; a sequence of length 0 gives out = 0 and lse = -inf.

The chunk form adds a query axis (several queries per sequence: prefill chunks,
speculative decode), each query with its own causal bound:
  q [batch, T, q_heads, dk], lengths [batch, T] -> out [batch, T, q_heads, dv],
  lse [batch, T, q_heads].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    batch: int
    q_heads: int
    kv_heads: int
    dk: int
    dv: int
    paged: bool
    block_size: int  # tokens per page (contiguous: the whole sequence)
    pages_per_seq: int  # block-table width (contiguous: 1)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def check_decode_args(q, k, v, lengths, block_tables, v_head_dim) -> DecodeShapes:
    """Validate the contract above; return the sizes every implementation needs."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if k.ndim != 4:
        raise ValueError(f"k must be [batch, seq, kv_heads, dk] or [num_blocks, block_size, kv_heads, dk], got {k.shape}")
    batch, q_heads, dk = q.shape
    kv_heads = k.shape[2]
    if k.shape[3] != dk:
        raise ValueError(f"q head_dim {dk} != k head_dim {k.shape[3]}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if v is None:
        if v_head_dim is None or not 0 < v_head_dim <= dk:
            raise ValueError(f"with v=None (MLA latent form) pass 0 < v_head_dim <= {dk}, got {v_head_dim}")
        dv = v_head_dim
    else:
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v {v.shape} must match k {k.shape} except in the last dimension")
        dv = v.shape[3]
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [batch] = [{batch}], got {lengths.shape}")
    paged = block_tables is not None
    if paged:
        if block_tables.ndim != 2 or block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must be [batch={batch}, max_blocks], got {block_tables.shape}")
        block_size, pages_per_seq = k.shape[1], block_tables.shape[1]
    else:
        if k.shape[0] != batch:
            raise ValueError(f"contiguous k must have batch {batch} first, got {k.shape}")
        block_size, pages_per_seq = k.shape[1], 1
    return DecodeShapes(batch, q_heads, kv_heads, dk, dv, paged, block_size, pages_per_seq)


def check_chunk_args(q, k, v, lengths, block_tables, v_head_dim) -> DecodeShapes:
    """The contract with a query axis: q [batch, T, q_heads, dk], lengths [batch, T]."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, queries, q_heads, head_dim], got shape {q.shape}")
    if lengths.shape != q.shape[:2]:
        raise ValueError(f"lengths must be [batch, queries] = {list(q.shape[:2])}, got {list(lengths.shape)}")
    one_query = jax.ShapeDtypeStruct((q.shape[0], *q.shape[2:]), q.dtype)
    return check_decode_args(one_query, k, v, jax.ShapeDtypeStruct(q.shape[:1], lengths.dtype), block_tables, v_head_dim)


def default_sm_scale(dk: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(dk) if sm_scale is None else float(sm_scale)


def value_view(k, v, v_head_dim):
    """V itself, or MLA's latent: the first v_head_dim features of K."""
    return k[..., :v_head_dim] if v is None else v


def finish_softmax(acc, row_max, row_sum, out_dtype):
    """Normalise an unnormalised softmax-weighted sum and form the LSE.

    acc [..., dv] = sum_t exp(s_t - row_max) v_t, row_sum [...] = sum_t exp(s_t - row_max).
    Rows with no valid token (row_sum == 0) give out 0 and lse -inf, never NaN.
    """
    has_tokens = row_sum > 0
    out = acc / jnp.where(has_tokens, row_sum, 1.0)[..., None]
    lse = jnp.where(has_tokens, row_max + jnp.log(jnp.where(has_tokens, row_sum, 1.0)), -jnp.inf)
    return out.astype(out_dtype), lse.astype(jnp.float32)


def dot_f32(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [m, k] . b (contracting b's axis `contract_b`) with a float32 result, for kernels.

    float32 inputs use full precision: Triton would otherwise use TF32 (10-bit mantissa).
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
