"""Exact merge of partial softmax results by their log-sum-exp (LSE): the arithmetic.

A partial result over a subset of tokens is (out_i, lse_i) with out_i already
normalised over that subset. Over the union:
    lse = logsumexp_i(lse_i),   out = sum_i exp(lse_i - lse) * out_i.
An empty subset has lse_i = -inf and contributes nothing, whatever out_i holds
(even NaN). All arithmetic is float32.

Pure maths: the GPU kernel merges its KV splits with it, and `dcpjax.sharding.merge`
wraps it in the collectives that merge DCP ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_weights(lses: jax.Array, lse_total: jax.Array) -> jax.Array:
    """exp(lse_i - lse_total), 0 for empty partials (no NaN from -inf - -inf)."""
    nonempty = lses > -jnp.inf
    return jnp.where(nonempty, jnp.exp(jnp.where(nonempty, lses - lse_total, 0.0)), 0.0)


def total_lse(lses: jax.Array, axis: int) -> jax.Array:
    """logsumexp over `axis`; -inf when every partial is empty."""
    peak = jnp.max(lses, axis=axis, keepdims=True)
    safe_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.where(lses > -jnp.inf, jnp.exp(lses - safe_peak), 0.0), axis=axis, keepdims=True)
    lse = jnp.where(total > 0, safe_peak + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return jnp.squeeze(lse, axis)


def weighted(outs: jax.Array, weights: jax.Array) -> jax.Array:
    """outs [..., dv] scaled by weights [...] in float32."""
    # where(), not a product: an empty partial may hold NaN and 0 * NaN = NaN.
    return jnp.where(weights[..., None] > 0, outs.astype(jnp.float32) * weights[..., None], 0.0)


def merge_partials(outs: jax.Array, lses: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Merge N partials stacked on `axis`.

    Args:
      outs: [..., N (at `axis`), ..., dv] partial outputs.
      lses: outs' shape without dv, float32.
    Returns:
      (out float32 without the N axis, lse float32 without the N axis).
    """
    axis = axis % lses.ndim
    lse = total_lse(lses, axis)
    weights = merge_weights(lses, jnp.expand_dims(lse, axis))
    return jnp.sum(weighted(outs, weights), axis=axis), lse
