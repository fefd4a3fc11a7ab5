"""One entry point for decode attention that picks the implementation.

`attention_backend`:
  "reference": pure jnp (XLA fuses it well on CPU and TPU).
  "pallas":    the Pallas kernel for this platform (GPU: Triton, TPU: Mosaic;
               `interpret=True` on CPU).
  "auto":      Pallas on GPU and TPU when the shapes fit its tiles, otherwise the reference.
"""

from __future__ import annotations

import jax

from dcpjax.kernels.common import check_chunk_args, check_decode_args
from dcpjax.kernels.pallas_decode import chunk_attention_pallas, contiguous_page_size
from dcpjax.kernels.pallas_tpu import tpu_tiling_problem
from dcpjax.kernels.reference import chunk_attention_reference

ATTENTION_BACKENDS = ("auto", "pallas", "reference")


def check_attention_backend(attention_backend: str) -> None:
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")


def _pallas_fits(platform: str, k, v, block_tables, v_head_dim, scaled: bool) -> bool:
    page = k.shape[1] if block_tables is not None else contiguous_page_size(k.shape[1])
    if platform == "gpu":
        return page >= 16 and page & (page - 1) == 0
    if platform == "tpu":
        dv = v_head_dim if v is None else v.shape[-1]
        return tpu_tiling_problem(k.shape[2], k.shape[3], dv, page, v is None, scaled) is None
    return False  # CPU: the interpreter is for tests, XLA's fused reference is faster


def resolve_backend(attention_backend: str, k, block_tables, v=None, v_head_dim=None, platform: str | None = None,
                    scaled: bool = False) -> str:
    """The implementation "auto" stands for on this platform (default: JAX's default) and these shapes."""
    check_attention_backend(attention_backend)
    if attention_backend != "auto":
        return attention_backend
    fits = _pallas_fits(platform or jax.default_backend(), k, v, block_tables, v_head_dim, scaled)
    return "pallas" if fits else "reference"


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    attention_backend: str = "auto",
    platform: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention returning (out [batch, q_heads, dv], lse [batch, q_heads] float32).

    Shapes in `dcpjax.kernels.common`; `v=None` with `v_head_dim` is MLA's latent form.
    platform: where it runs ("cpu", "gpu", "tpu"; default JAX's default backend).
    k_scale, v_scale: per-token float32 scales of an fp8 cache (k's shape without the last dim).
    """
    check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    out, lse = chunk_attention(
        q[:, None], k, v, lengths[:, None], block_tables=block_tables, sm_scale=sm_scale, v_head_dim=v_head_dim,
        attention_backend=attention_backend, platform=platform, k_scale=k_scale, v_scale=v_scale,
    )
    return out[:, 0], lse[:, 0]


def chunk_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    lengths: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    attention_backend: str = "auto",
    platform: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Several queries per sequence, each with its own causal bound (prefill chunks).

    q [batch, T, q_heads, dk], lengths [batch, T] -> out [batch, T, q_heads, dv],
    lse [batch, T, q_heads] float32. KV and platform as in `decode_attention`.
    """
    check_chunk_args(q, k, v, lengths, block_tables, v_head_dim)
    backend = resolve_backend(attention_backend, k, block_tables, v, v_head_dim, platform, k_scale is not None)
    kw = dict(block_tables=block_tables, sm_scale=sm_scale, v_head_dim=v_head_dim, k_scale=k_scale, v_scale=v_scale)
    if backend == "pallas":
        return chunk_attention_pallas(q, k, v, lengths, platform=platform, **kw)
    return chunk_attention_reference(q, k, v, lengths, **kw)
