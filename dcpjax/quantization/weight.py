"""A weight held quantized on the devices (`QuantizedWeight`), dequantized where it is used.

It stands where a model declared an `nnx.Param` (`loader.holding.hold_quantized` swaps one for the
other, with the same global shape and logical axes), and answers `w[...]` with the float weight in
the parameter's declared dtype, so the model's matmuls read as before. Its parts, each sharded like
the weight:
    values [*shape]            float8_e4m3fn or int8 (GGUF codes)
    scale  [*shape / groups]   one per group of `groups[i]` elements along each axis
    offset [*shape / groups]   (GGUF types with a minimum) or None
w = values * scale (+ offset), in float32, then cast: exact against the checkpoint's own
dequantization (weight-only quantization: activations stay in the compute dtype). The groups come
from the checkpoint's blocks through the parameter's checkpoint rule (`loader.holding`), cut to
divide each device's share, so a TP split through a block stays exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def dequantize(values: jax.Array, scale: jax.Array, offset: jax.Array | None, dtype) -> jax.Array:
    """values [*shape] * scale [*shape / groups] (+ offset) -> [*shape] in `dtype` (computed in float32)."""
    groups = [n // s for n, s in zip(values.shape, scale.shape)]
    split = [d for n, g in zip(scale.shape, groups) for d in (n, g)]
    spread = [d for n in scale.shape for d in (n, 1)]
    w = values.astype(jnp.float32).reshape(split) * scale.astype(jnp.float32).reshape(spread)
    if offset is not None:
        w = w + offset.astype(jnp.float32).reshape(spread)
    return w.reshape(values.shape).astype(dtype)


def _part(shape, dtype, logical_axes, unpadded) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=logical_axes, unpadded_shape=tuple(unpadded))


class QuantizedWeight(nnx.Module):
    """A quantized parameter: `w[...]` is the float weight (`dtype`); `take_rows` looks rows up
    without dequantizing the rest (embeddings)."""

    def __init__(self, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], groups: tuple[int, ...],
                 values_dtype, scale_dtype, has_offset: bool, dtype, unpadded_shape: tuple[int, ...]):
        if any(n % g for n, g in zip(shape, groups)):
            raise ValueError(f"groups {groups} do not divide the weight's shape {shape}")
        scales = tuple(n // g for n, g in zip(shape, groups))
        unpadded_scales = tuple(-(-n // g) for n, g in zip(unpadded_shape, groups))
        self.values = _part(shape, values_dtype, logical_axes, unpadded_shape)
        self.scale = _part(scales, scale_dtype, logical_axes, unpadded_scales)
        self.offset = _part(scales, scale_dtype, logical_axes, unpadded_scales) if has_offset else None
        self.dtype = jnp.dtype(dtype)

    def __getitem__(self, index) -> jax.Array:
        offset = None if self.offset is None else self.offset[...]
        return dequantize(self.values[...], self.scale[...], offset, self.dtype)[index]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def take_rows(self, rows: jax.Array) -> jax.Array:
        """Rows `rows` [...] of a 2-D weight [n, d] -> [..., d] (only those rows dequantized)."""
        group = self.values.shape[0] // self.scale.shape[0]
        if group != 1:  # rows share scales: dequantize the whole weight
            return jnp.take(self[...], rows, axis=0)
        offset = None if self.offset is None else jnp.take(self.offset[...], rows, axis=0)
        return dequantize(jnp.take(self.values[...], rows, axis=0), jnp.take(self.scale[...], rows, axis=0),
                          offset, self.dtype)


def take_rows(weight, rows: jax.Array) -> jax.Array:
    """Rows of a 2-D parameter, float or quantized: weight [n, d], rows [...] -> [..., d]."""
    if isinstance(weight, QuantizedWeight):
        return weight.take_rows(rows)
    return jnp.take(weight[...], rows, axis=0)
