"""fp8 block quantization in numpy: the format DeepSeek-V3 ships, written and read.

`quantize_blocks` is what `quantization="fp8"` does to an unquantized checkpoint at load (one
function, so weights quantized online and a checkpoint written offline in this format hold the same
bytes); `scales_per_element` expands a block-scale tensor over a slice, as the loader reads it.
"""

from __future__ import annotations

import numpy as np

from dcpjax.quantization.formats import FP8_DTYPE, FP8_MAX, held_dtype


def _padded_blocks(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """[rows, cols] -> [row blocks, bm, col blocks, bn], the edge blocks padded with zeros."""
    (rows, cols), (bm, bn) = w.shape, block
    padded = np.zeros((-(-rows // bm) * bm, -(-cols // bn) * bn), np.float32)
    padded[:rows, :cols] = w
    return padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)


def quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A [rows, cols] float tensor -> (values float8_e4m3fn [rows, cols], scale float32
    [ceil(rows / bm), ceil(cols / bn)]): per block, scale = amax / 448 (1 for an all-zero block)
    and values = w / scale rounded to nearest, so w ~ values * scale."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"fp8 block quantization takes a 2-D [out, in] tensor, got shape {w.shape}")
    blocks = _padded_blocks(w, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    values = (blocks / scale[:, None, :, None]).reshape(blocks.shape[0] * block[0], -1)
    return values[: w.shape[0], : w.shape[1]].astype(held_dtype(FP8_DTYPE)), scale


def scales_per_element(scale: np.ndarray, block: tuple[int, int], rows: range, cols: range) -> np.ndarray:
    """The block scale of each element of the slice [rows, cols] (float32 [len(rows), len(cols)])."""
    row_blocks = np.arange(rows.start, rows.stop, rows.step or 1) // block[0]
    col_blocks = np.arange(cols.start, cols.stop, cols.step or 1) // block[1]
    return np.asarray(scale, np.float32)[np.ix_(row_blocks, col_blocks)]


def dequantize_blocks(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """values * scale per block, in float32 ([rows, cols])."""
    rows, cols = values.shape
    return values.astype(np.float32) * scales_per_element(scale, block, range(rows), range(cols))
