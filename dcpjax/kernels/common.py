"""The attention contract every implementation shares, its checks and its static options.

  q:       [batch, T, q_heads, dk], T queries per sequence (decode: T = 1; prefill
           chunks and speculative drafts: T > 1)
  kv:      a `KVCache`: paged pools [kv_heads, num_blocks, block_size, d], block tables
           [batch, pages], optional fp8 scales; v None is MLA's latent form
           (V = K[..., :v_head_dim])
  bounds:  [batch, T] int, each query's causal bound: query t of sequence b sees tokens
           0 .. bounds[b, t] - 1 of its row's pages
           (0 allowed: padding, or a DCP rank that owns none of them)
  starts:  optional [batch, T] int, each query's first visible token (default 0): query t
           sees tokens starts[b, t] .. bounds[b, t] - 1. A packed row (several sequences'
           chunks in one row, their pages one after another in its block table) gives each
           query the range of its own sequence's pages.
Returns out [batch, T, q_heads, dv] in q's dtype and lse [batch, T, q_heads]
float32, natural-log based; a query with no visible token gives out 0, lse -inf.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dcpjax.kernels.kv_cache import FP8, KVCache

ATTENTION_BACKENDS = ("auto", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Static choices of an attention call (hashable: part of a jit cache key).

    sm_scale: softmax scale (default 1/sqrt(dk)).
    backend: "auto" (Pallas on GPU/TPU when the shapes fit its tiles, else the jnp
      reference), "pallas" or "reference".
    platform: where it runs, "cpu" | "gpu" | "tpu" (default: JAX's default backend).
    softcap: soft-cap the scaled scores to softcap * tanh(s / softcap) before the softmax (Gemma 2's
      attn_logit_softcapping); None: no cap.
    """

    sm_scale: float | None = None
    backend: str = "auto"
    platform: str | None = None
    softcap: float | None = None

    def __post_init__(self):
        check_attention_backend(self.backend)

    def scale(self, dk: int) -> float:
        return 1.0 / math.sqrt(dk) if self.sm_scale is None else float(self.sm_scale)


def check_attention_backend(attention_backend: str) -> None:
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """The sizes of one attention call, read once from its arguments by `check_attention_args`."""

    batch: int
    queries: int
    q_heads: int
    kv_heads: int
    dk: int
    dv: int
    block_size: int
    pages: int  # block-table width

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def check_attention_args(q, kv: KVCache, bounds, starts=None) -> AttentionShapes:
    """Validate the contract above once; return the sizes every implementation needs."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, queries, q_heads, head_dim], got shape {q.shape}")
    if kv.k.ndim != 4:
        raise ValueError(f"kv.k must be [kv_heads, num_blocks, block_size, dk], got {kv.k.shape}")
    batch, queries, q_heads, dk = q.shape
    kv_heads = kv.k.shape[0]
    if kv.k.shape[3] != dk:
        raise ValueError(f"q head_dim {dk} != k head_dim {kv.k.shape[3]}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if kv.v is None:
        if not 0 < kv.v_head_dim <= dk:
            raise ValueError(f"an MLA latent cache (v=None) needs 0 < v_head_dim <= {dk}, got {kv.v_head_dim}")
        dv = kv.v_head_dim
    else:
        if kv.v.shape[:3] != kv.k.shape[:3]:
            raise ValueError(f"v {kv.v.shape} must match k {kv.k.shape} except in the last dimension")
        dv = kv.v.shape[3]
    _check_scales(kv)
    if tuple(bounds.shape) != (batch, queries):
        raise ValueError(f"bounds must be [batch, queries] = {[batch, queries]}, got {list(bounds.shape)}")
    if starts is not None and tuple(starts.shape) != (batch, queries):
        raise ValueError(f"starts must be [batch, queries] = {[batch, queries]}, got {list(starts.shape)}")
    tables = kv.block_tables
    if tables is None or tables.ndim != 2 or tables.shape[0] != batch:
        got = None if tables is None else tables.shape
        raise ValueError(f"kv.block_tables must be [batch={batch}, pages], got {got}")
    return AttentionShapes(batch, queries, q_heads, kv_heads, dk, dv, kv.k.shape[2], tables.shape[1])


# -- the (query, head) rows layout both kernels attend in -----------------------------
# A KV head is shared by the G = q_heads // kv_heads query heads of its group, and a chunk
# has T queries per sequence, so each KV head serves T * G (query, head) pairs. Laid out as
# rows (row t * G + g: query t, q head h * G + g), they attend as one tile: a page is read
# once per tile, not once per query, and each row keeps its own causal bound.


def to_rows(x: jax.Array, shapes: AttentionShapes) -> jax.Array:
    """[batch, T, q_heads, ...] -> [batch, kv_heads, T * G, ...]: each KV head's (query, head)
    rows, row t * G + g being query t with q head h * G + g. Trailing dims (dk) ride along."""
    b, t, hkv, g = shapes.batch, shapes.queries, shapes.kv_heads, shapes.group
    grouped = x.reshape(b, t, hkv, g, *x.shape[3:])
    return jnp.moveaxis(grouped, 2, 1).reshape(b, hkv, t * g, *x.shape[3:])


def from_rows(x: jax.Array, shapes: AttentionShapes) -> jax.Array:
    """Inverse of `to_rows`: [batch, kv_heads, rows >= T * G, ...] -> [batch, T, q_heads, ...];
    rows past T * G (a kernel's tile padding) are dropped. Trailing dims (dv) ride along."""
    b, t, hkv, g = shapes.batch, shapes.queries, shapes.kv_heads, shapes.group
    grouped = x[:, :, : t * g].reshape(b, hkv, t, g, *x.shape[3:])
    return jnp.moveaxis(grouped, 1, 2).reshape(b, t, shapes.q_heads, *x.shape[3:])


def row_bounds(bounds: jax.Array, shapes: AttentionShapes) -> jax.Array:
    """[batch, T] causal bounds (or starts) -> [batch, T * G]: row t * G + g gets query t's
    value (the same for every KV head, so one array serves all of them)."""
    return jnp.repeat(bounds, shapes.group, axis=1)


def _check_scales(kv: KVCache) -> None:
    """fp8 pools come with a float32 scale per token and head: k_scale, and v_scale unless MLA."""
    fp8 = jnp.dtype(kv.k.dtype) == jnp.dtype(FP8)
    if fp8 != kv.quantized:
        raise ValueError(f"an fp8 cache needs k_scale (and only an fp8 one has it): k is {kv.k.dtype}, "
                         f"k_scale is {None if kv.k_scale is None else kv.k_scale.shape}")
    if not kv.quantized:
        return
    if (kv.v_scale is None) != kv.use_mla:
        raise ValueError("an fp8 cache with v needs v_scale; an MLA latent cache (v=None) has none")
    for scale in (kv.k_scale, kv.v_scale):
        if scale is not None and tuple(scale.shape) != tuple(kv.k.shape[:3]):
            raise ValueError(f"fp8 scales must be [kv_heads, num_blocks, block_size] = {list(kv.k.shape[:3])}, "
                             f"got {list(scale.shape)}")


def finish_softmax(acc, row_max, row_sum, out_dtype):
    """Normalise an unnormalised softmax-weighted sum and form the LSE.

    acc [..., dv] = sum_t exp(s_t - row_max) v_t, row_sum [...] = sum_t exp(s_t - row_max).
    Rows with no valid token (row_sum == 0) give out 0 and lse -inf, never NaN.
    """
    has_tokens = row_sum > 0
    out = acc / jnp.where(has_tokens, row_sum, 1.0)[..., None]
    lse = jnp.where(has_tokens, row_max + jnp.log(jnp.where(has_tokens, row_sum, 1.0)), -jnp.inf)
    return out.astype(out_dtype), lse.astype(jnp.float32)


def soft_cap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Scaled attention scores squashed into (-softcap, softcap) (Gemma 2); None: unchanged. Zero at
    zero and monotonic, so masking after it (to -inf) is unaffected."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def dot_f32(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [m, k] . b (contracting b's axis `contract_b`) with a float32 result, for kernels.

    float32 inputs use full precision: Triton would otherwise use TF32 (10-bit mantissa).
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
