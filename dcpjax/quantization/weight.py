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

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.quantization.matmul import quantized_matmul


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

    def matrix(self, contract: int) -> tuple[jax.Array, jax.Array, jax.Array | None] | None:
        """(values [K, N], scale, offset [K / gk, N / gn]) of the weight as a matrix whose first `contract`
        axes are K (each device's shard inside shard_map); None where the flattened blocks are not runs of
        one length (the caller then dequantizes)."""
        shape, scale_shape = self.values.shape, self.scale.shape
        groups = tuple(n // s for n, s in zip(shape, scale_shape))
        gk, gn = uniform_group(shape[:contract], groups[:contract]), uniform_group(shape[contract:], groups[contract:])
        if gk is None or gn is None:
            return None
        k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
        as_2d = lambda part: None if part is None else part[...].reshape(k // gk, n // gn)
        return self.values[...].reshape(k, n), as_2d(self.scale), as_2d(self.offset)

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


def uniform_group(sizes: tuple[int, ...], groups: tuple[int, ...]) -> int | None:
    """The group of the flattened axes `sizes` (row-major) whose per-axis groups are `groups`: after the
    first axis with a group > 1 every axis must lie whole in one group (else the flattened blocks are
    not runs of one length: None)."""
    for i, g in enumerate(groups):
        if g > 1:
            if any(gj != n for gj, n in zip(groups[i + 1:], sizes[i + 1:])):
                return None
            return g * math.prod(sizes[i + 1:])
    return 1


def linear(x: jax.Array, weight, contract: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *weight.shape[:contract]] @ weight [*in, *out] -> [..., *out] in `out_dtype` (default x's).

    As one 2-D product [..., K] @ [K, N]; a `QuantizedWeight` through `quantization.matmul.quantized_matmul`
    (no float copy of the whole weight), a float one through XLA's dot (contracting several axes
    separately let XLA:CPU transpose the weight at every step: a copy of it per call)."""
    shape = tuple(weight.shape)
    k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
    lead = x.shape[:x.ndim - contract]
    flat = x.reshape(*lead, k)
    if isinstance(weight, QuantizedWeight) and (matrix := weight.matrix(contract)) is not None:
        y = quantized_matmul(flat, *matrix).astype(out_dtype or x.dtype)
    else:
        y = jnp.matmul(flat, weight[...].reshape(k, n), preferred_element_type=out_dtype)
    return y.reshape(*lead, *shape[contract:])


def linear_transposed(x: jax.Array, weight, out_dtype=None) -> jax.Array:
    """x [..., K] @ weight [N, K].T -> [..., N] (a tied embedding table used as the LM head)."""
    if isinstance(weight, QuantizedWeight) and (matrix := weight.matrix(1)) is not None:
        return quantized_matmul(x, *matrix, transposed=True).astype(out_dtype or x.dtype)
    return jnp.einsum("...k,nk->...n", x, weight[...], preferred_element_type=out_dtype)
