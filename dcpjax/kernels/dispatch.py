"""The one attention entry point: validates once, then picks the implementation.

`AttentionOptions.backend`:
  "reference": pure jnp (XLA fuses it well on CPU and TPU).
  "pallas":    the Pallas kernel for this platform (GPU: Triton, TPU: Mosaic;
               `interpret=True` on CPU).
  "auto":      Pallas on GPU and TPU when the shapes fit its tiles, otherwise the reference.
"""

from __future__ import annotations

import jax

from dcpjax.kernels.common import AttentionOptions, AttentionShapes, check_attention_args
from dcpjax.kernels.kv_cache import KVCache
from dcpjax.kernels.pallas import default_target, run_pallas
from dcpjax.kernels.pallas_tpu import tpu_tiling_problem
from dcpjax.kernels.reference import attention_reference


def _gpu_page_fits(page: int) -> bool:
    return page >= 16 and page & (page - 1) == 0  # Triton tiles: a power of two, tensor-core dots


def _pallas_fits(platform: str, shapes: AttentionShapes, kv: KVCache) -> bool:
    page = shapes.block_size
    if platform == "gpu":
        return _gpu_page_fits(page)
    if platform == "tpu":
        return tpu_tiling_problem(shapes.kv_heads, shapes.dk, shapes.dv, page, kv.use_mla, kv.quantized) is None
    return False  # CPU: the interpreter is for tests, XLA's fused reference is faster


def resolve_backend(options: AttentionOptions, shapes: AttentionShapes, kv: KVCache) -> str:
    """The implementation `options.backend` stands for on its platform and these shapes."""
    if options.backend != "auto":
        return options.backend
    return "pallas" if _pallas_fits(options.platform or jax.default_backend(), shapes, kv) else "reference"


def reads_only_visible_pages(options: AttentionOptions, block_size: int) -> bool:
    """Whether the kernel `options` pick reads only the pages inside each query's bound, whatever
    the block table's width: the GPU Pallas kernel (its page loop has a traced trip count). The
    jnp reference reads every page of the width, and the TPU kernel's grid spans them."""
    platform = options.platform or jax.default_backend()
    return platform == "gpu" and options.backend != "reference" and _gpu_page_fits(block_size)


DEFAULT_OPTIONS = AttentionOptions()


def attention(q: jax.Array, kv: KVCache, bounds: jax.Array, options: AttentionOptions = DEFAULT_OPTIONS,
              starts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of T queries per sequence over a paged KV cache, each with its own causal bound.

    Args:
      q: [batch, T, q_heads, dk].
      kv: `KVCache` with block_tables [batch, pages].
      bounds: [batch, T] int, each query's causal bound: query t sees tokens 0 .. bounds[b, t] - 1.
      options: scale, backend, platform (static).
      starts: optional [batch, T] int, each query's first visible token (packed rows: see
        `dcpjax.kernels.common`; sliding windows: `sharding.local_ops.dcp_attention`); None: 0.
    Returns out [batch, T, q_heads, dv] in q's dtype and lse [batch, T, q_heads] float32
    (natural log; a query that sees nothing gives 0 and -inf).
    """
    shapes = check_attention_args(q, kv, bounds, starts)
    scale = options.scale(shapes.dk)
    if resolve_backend(options, shapes, kv) == "pallas":
        platform = options.platform or jax.default_backend()
        return run_pallas(q, kv, bounds, shapes, scale, target=default_target(platform), interpret=platform == "cpu",
                          starts=starts, softcap=options.softcap)
    return attention_reference(q, kv, bounds, shapes, scale, starts, options.softcap)


def decode_attention(q: jax.Array, kv: KVCache, lengths: jax.Array,
                     options: AttentionOptions = DEFAULT_OPTIONS) -> tuple[jax.Array, jax.Array]:
    """One query per sequence: q [batch, q_heads, dk], lengths [batch] -> out [batch, q_heads, dv],
    lse [batch, q_heads]. Sugar over `attention` with T = 1."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if tuple(lengths.shape) != (q.shape[0],):
        raise ValueError(f"lengths must be [batch] = [{q.shape[0]}], got {list(lengths.shape)}")
    out, lse = attention(q[:, None], kv, lengths[:, None], options)
    return out[:, 0], lse[:, 0]
