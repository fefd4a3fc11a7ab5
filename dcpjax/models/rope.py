"""Rotary position embedding with the scalings real checkpoints use.

Inverse frequencies follow the published definitions (as Hugging Face computes
them): default, linear (positions / factor), llama3 (wavelength-banded
smoothing) and YaRN (ramp between interpolation and extrapolation, plus an
attention factor that multiplies cos and sin, hence the softmax scale).
Rotation is the "rotate half" convention of Llama-family checkpoints.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dcpjax.models.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim // 2] float64, attention factor for cos/sin)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / rope.theta**exponents
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        factor, original = rope.factor, rope.original_max_position_embeddings
        attention_factor = rope.attention_factor
        if attention_factor is None:
            if rope.mscale and rope.mscale_all_dim:
                attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
        return inv_freq, float(attention_factor)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def apply_rope_pairs(x: jax.Array, positions: jax.Array, inv_freq, attention_factor: float,
                     interleaved: bool) -> jax.Array:
    """`apply_rope` for weights whose rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek's MLA, GLM-5's
    indexer) when `interleaved`: regrouped into halves first. q and k both regrouped, their dot product
    is unchanged, so the result stays in halves."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, inv_freq, attention_factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float) -> jax.Array:
    """Rotate x [..., T, heads, rotary_dim] by positions [..., T] (rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [..., T, rd/2]
    cos = (jnp.cos(angles) * attention_factor)[..., None, :]
    sin = (jnp.sin(angles) * attention_factor)[..., None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
