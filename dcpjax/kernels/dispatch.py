"""One entry point for decode attention that picks the implementation.

`attention_backend`:
  "reference": pure jnp (XLA fuses it well on CPU and TPU).
  "pallas":    the Pallas kernel (compiled on GPU; `interpret=True` on CPU).
  "auto":      Pallas on GPU when its tile rules hold, otherwise the reference.
"""

from __future__ import annotations

import jax

from dcpjax.kernels.common import check_decode_args
from dcpjax.kernels.pallas_decode import contiguous_page_size, decode_attention_pallas
from dcpjax.kernels.reference import decode_attention_reference

ATTENTION_BACKENDS = ("auto", "pallas", "reference")


def check_attention_backend(attention_backend: str) -> None:
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")


def _pallas_fits_gpu(k, block_tables) -> bool:
    page = k.shape[1] if block_tables is not None else contiguous_page_size(k.shape[1])
    return page >= 16 and page & (page - 1) == 0


def resolve_backend(attention_backend: str, k, block_tables) -> str:
    """The implementation "auto" stands for on this platform and these shapes."""
    check_attention_backend(attention_backend)
    if attention_backend != "auto":
        return attention_backend
    if jax.default_backend() == "gpu" and _pallas_fits_gpu(k, block_tables):
        return "pallas"
    return "reference"


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
) -> tuple[jax.Array, jax.Array]:
    """Decode attention returning (out [batch, q_heads, dv], lse [batch, q_heads] float32).

    Shapes in `dcpjax.kernels.common`; `v=None` with `v_head_dim` is MLA's latent form.
    """
    check_decode_args(q, k, v, lengths, block_tables, v_head_dim)
    backend = resolve_backend(attention_backend, k, block_tables)
    impl = decode_attention_pallas if backend == "pallas" else decode_attention_reference
    return impl(q, k, v, lengths, block_tables=block_tables, sm_scale=sm_scale, v_head_dim=v_head_dim)
