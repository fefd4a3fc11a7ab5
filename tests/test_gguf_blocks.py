"""GGUF blocks unpacked to int8 values with per-group scale (and offset): `gguf_blocks.dequantize` of what
`unpack` gives must equal `gguf.quants.dequantize` of the raw rows bit for bit, for every held type, on
blocks gguf quantizes itself and on random bytes (every code, sub-scale and float16 scale, subnormals and
negatives included); jax under jit must give the same bits.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax.quantization import gguf_blocks
from dcpjax.quantization.gguf_blocks import HELD_TYPES, dequantize, unpack
from dcpjax.quantization.weight import dequantize as jax_weight_dequantize

Q = gguf.GGMLQuantizationType
ROWS, COLS = 4, 512
# the range of each type's (shifted) codes, reached by random bytes
VALUE_RANGE = {Q.Q8_0: (-128, 127), Q.Q4_0: (-8, 7), Q.Q4_1: (0, 15), Q.Q5_0: (-16, 15), Q.Q5_1: (0, 31),
               Q.Q2_K: (0, 3), Q.Q3_K: (-4, 3), Q.Q4_K: (0, 15), Q.Q5_K: (0, 31), Q.Q6_K: (-32, 31)}
HALF_SCALES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # a plain float16 scale; the K-quants' are float32
WITH_OFFSET = (Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K)
# byte offsets, within a block, of each type's float16 fields (d, and dmin / m): random bytes must keep them finite
HALF_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
               Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
TYPES = list(HELD_TYPES)


def random_bytes(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks [rows, bytes_per_row] uint8 whose float16 fields are finite (any sign, subnormals too)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        half = blocks[:, at:at + 2].copy().view(np.uint16)
        half = np.where(half & 0x7C00 == 0x7C00, half & ~np.uint16(0x4000), half)  # inf / NaN exponent -> finite
        blocks[:, at:at + 2] = half.view(np.uint8)
    return blocks.reshape(rows, -1)


def random_weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, cols] float32 normal values, rows scaled small, unit, large, and one outlier per row."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    data *= np.array([1e-5, 1.0, 300.0, 0.02] * rows, np.float32)[:rows, None]
    data[np.arange(rows), rng.integers(0, cols, rows)] *= 20
    return data


def quantized_or_random(qtype, rows: int, cols: int) -> np.ndarray:
    """gguf's own quantization of random weights where gguf's numpy code can quantize the type (not the
    K-quants), random valid bytes otherwise."""
    try:
        return gguf.quants.quantize(random_weights(rows, cols), qtype)
    except NotImplementedError:
        return random_bytes(qtype, rows, cols, seed=1)


def assert_bitwise(actual: np.ndarray, expected: np.ndarray):
    assert actual.dtype == expected.dtype == np.float32 and actual.shape == expected.shape
    assert not np.isnan(expected).any()  # NaN payloads aside, equal bits are equal values
    mismatch = actual.view(np.uint32) != expected.view(np.uint32)
    assert not mismatch.any(), f"{mismatch.sum()} elements differ, first at {np.argwhere(mismatch)[0]}: " \
                               f"{actual[mismatch][:4]} vs {expected[mismatch][:4]}"


def check_layout(qtype, values, scale, offset, rows: int, cols: int):
    group = HELD_TYPES[qtype]
    lo, hi = VALUE_RANGE[qtype]
    assert values.dtype == np.int8 and values.shape == (rows, cols)
    assert lo <= values.min() and values.max() <= hi
    assert scale.dtype == (np.float16 if qtype in HALF_SCALES else np.float32)
    assert scale.shape == (rows, cols // group)
    if qtype in WITH_OFFSET:
        assert offset is not None and offset.dtype == scale.dtype and offset.shape == scale.shape
    else:
        assert offset is None


def test_held_types():
    assert set(HELD_TYPES) == set(VALUE_RANGE)
    for qtype, group in HELD_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[qtype][0] % group == 0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_rows_exact(qtype):
    raw = quantized_or_random(qtype, ROWS, COLS)
    values, scale, offset = unpack(raw, qtype, COLS)
    check_layout(qtype, values, scale, offset, ROWS, COLS)
    assert_bitwise(dequantize(values, scale, offset), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_bytes_exact(qtype):
    """Every code, sub-scale and min, and float16 scales of any sign and size (subnormals included)."""
    raw = random_bytes(qtype, 8, 4096)
    values, scale, offset = unpack(raw, qtype, 4096)
    check_layout(qtype, values, scale, offset, 8, 4096)
    assert (values.min(), values.max()) == VALUE_RANGE[qtype]  # every code reached, so no bit is dropped
    assert_bitwise(dequantize(values, scale, offset), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_leading_dims_and_row_slices(qtype):
    """[experts, rows, bytes] unpacks like its rows; a row slice unpacks to the same rows' parts."""
    raw = random_bytes(qtype, 6, 256).reshape(2, 3, -1)
    values, scale, offset = unpack(raw, qtype, 256)
    assert values.shape == (2, 3, 256) and scale.shape == (2, 3, 256 // HELD_TYPES[qtype])
    assert_bitwise(dequantize(values, scale, offset), gguf.quants.dequantize(raw, qtype))
    part = unpack(raw[1, 1:], qtype, 256)
    assert np.array_equal(part[0], values[1, 1:]) and np.array_equal(part[1], scale[1, 1:])


def test_reader_rows(tmp_path):
    """`GGUFReader`'s tensor.data (a memory map) unpacks as the array that was written; the parts are copies."""
    path = tmp_path / "w.gguf"
    raw = quantized_or_random(Q.Q8_0, ROWS, COLS)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.data.shape == raw.shape
    values, scale, offset = unpack(tensor.data[1:2], tensor.tensor_type, COLS)
    assert not np.shares_memory(values, tensor.data) and not np.shares_memory(scale, tensor.data)
    assert_bitwise(dequantize(values, scale, offset), gguf.quants.dequantize(raw[1:2], Q.Q8_0))


def test_errors():
    raw = random_bytes(Q.Q4_0, 2, 64)
    with pytest.raises(ValueError, match="not whole"):
        unpack(raw, Q.Q4_0, 48)
    with pytest.raises(ValueError, match="take 18 bytes, not 36"):
        unpack(raw, Q.Q4_0, 32)
    with pytest.raises(ValueError, match="not held"):
        unpack(raw, Q.IQ4_NL, 64)
    with pytest.raises(ValueError, match="not held"):
        gguf_blocks._unpack_blocks(raw.reshape(-1, 18), Q.F16)


def test_empty_rows():
    values, scale, offset = unpack(np.zeros((0, 144 * 2), np.uint8), Q.Q4_K, 512)
    assert values.shape == (0, 512) and scale.shape == offset.shape == (0, 16)
    assert dequantize(values, scale, offset).shape == (0, 512)


@jax.jit
def _jax_dequantize(values, scale, offset):
    """The numpy reference written in jax (offset may be None: a different trace)."""
    rows, cols = values.shape
    w = values.astype(jnp.float32).reshape(rows, scale.shape[1], -1) * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[..., None]
    return w.reshape(rows, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_jax_jit_exact(qtype):
    """jax under jit (here on CPU) gives numpy's bits: the reference formula, and the library's own
    `quantization.weight.dequantize`. (Each product values * scale is exact in float32, so an FMA
    contraction of the multiply and the add could not change a bit either.)"""
    raw = random_bytes(qtype, 8, 4096, seed=2)
    values, scale, offset = unpack(raw, qtype, 4096)
    expected = gguf.quants.dequantize(raw, qtype)
    assert_bitwise(np.asarray(_jax_dequantize(values, scale, offset)), expected)
    library = jax.jit(jax_weight_dequantize, static_argnums=3)(values, scale, offset, jnp.float32)
    assert_bitwise(np.asarray(library), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fma_contraction_changes_nothing(qtype):
    """XLA may contract `a * b + c` into one FMA (jax 0.10.2 does on CPU: jit gives 2**-24 for
    (1 + 2**-12)**2 - (1 + 2**-11), numpy 0), rounding `values * scale + offset` once where numpy rounds
    twice. Both agree because every product is exact in float32: the one-rounding result (modelled in
    float64, where the sum of two multiples of 2**-24 below 2**28 is exact) is gguf's."""
    raw = random_bytes(qtype, 8, 4096, seed=3)
    values, scale, offset = unpack(raw, qtype, 4096)
    product = values.astype(np.float64).reshape(8, scale.shape[1], -1) * scale.astype(np.float64)[..., None]
    assert np.array_equal(product.astype(np.float32), product)  # exact in float32
    once = product if offset is None else product + offset.astype(np.float64)[..., None]
    assert_bitwise(once.astype(np.float32).reshape(8, 4096), gguf.quants.dequantize(raw, qtype))
