"""What a quantized checkpoint tensor is: its block format (`BlockFormat`), and what a model's
`config.json` says about its quantization (`CheckpointQuantization`, read from
`quantization_config`).

A quantized tensor keeps, in its checkpoint layout ([out, in] for a Linear), integer or fp8
`values` and one `scale` (and for some GGUF types one `offset`) per [rows, cols] block:
    w = values * scale (+ offset)
fp8 block-scaled checkpoints (DeepSeek-V3, Kimi K2, Qwen3-*-FP8) use [128, 128] blocks of
float8_e4m3fn with float32 scales (`weight_scale_inv`, the multiplier despite its name); GGUF's
types use [1, 32] (or [1, 16]) blocks along each row, held as int8 with float16/float32 scales.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_FP8_BLOCK = (128, 128)  # DeepSeek-V3's, Kimi K2's and Qwen3-FP8's weight_block_size


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """How one checkpoint tensor is quantized: `values_dtype` values, one `scale_dtype` scale (and
    with `has_offset` one offset) per `block` = (rows, cols) of its checkpoint layout."""

    name: str  # "fp8", or the GGUF type ("Q4_1")
    block: tuple[int, int]
    values_dtype: str
    scale_dtype: str
    has_offset: bool = False
    per_tensor: bool = False  # one scale for the whole tensor (`block` is then its shape)


def fp8_format(block: tuple[int, int], per_tensor: bool = False) -> BlockFormat:
    return BlockFormat("fp8", (int(block[0]), int(block[1])), FP8_DTYPE, "float32", per_tensor=per_tensor)


QUANT_METHODS = ("fp8",)


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """config.json's `quantization_config`, as far as dcpjax reads it: fp8 weights (e4m3) with
    dynamic activations, scaled per `weight_block_size` block (`X.weight_scale_inv`) or, without
    one, per tensor (`X.weight_scale`)."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] | None = DEFAULT_FP8_BLOCK

    @classmethod
    def from_hf(cls, config: dict[str, Any] | None) -> CheckpointQuantization | None:
        """From a parsed `quantization_config` (None: an unquantized checkpoint); ValueError names
        an unsupported method or field."""
        if not config:
            return None
        method = config.get("quant_method")
        if method not in QUANT_METHODS:
            raise ValueError(f"quantization_config quant_method {method!r} is not supported; dcpjax reads "
                             f"{', '.join(QUANT_METHODS)} checkpoints (block-scaled as DeepSeek-V3 ships, or per "
                             "tensor), and GGUF files")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config fmt {config['fmt']!r} is not supported (only e4m3)")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config activation_scheme {config['activation_scheme']!r} is not "
                             "supported: dcpjax quantizes weights only (activation_scheme 'dynamic')")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(n, int) and n >= 1 for n in block)):
            raise ValueError(f"quantization_config weight_block_size must be two integers >= 1, got {block!r}")
        return cls(method, None if block is None else (block[0], block[1]))

    def to_hf(self) -> dict[str, Any]:
        out = {"quant_method": self.method, "fmt": "e4m3", "activation_scheme": "dynamic"}
        return out | ({"weight_block_size": list(self.weight_block_size)} if self.weight_block_size else {})


def held_dtype(name: str) -> np.dtype:
    """numpy's dtype of a format's dtype name (float8_e4m3fn through ml_dtypes, as jax names it)."""
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(name))
