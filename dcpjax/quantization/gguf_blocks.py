"""GGUF quantized blocks unpacked into the layout dcpjax holds on the devices, and its reference dequantization.

A GGUF tensor of `rows x cols` elements (cols = the innermost GGUF dimension; blocks run along it) is held as
    values [rows, cols]          int8: the integer codes, already shifted (Q4_0's q - 8, Q6_K's q - 32, ...)
    scale  [rows, cols // G]     float16 where the format's scale is a plain float16 (Q8_0, Q4_0, Q4_1, Q5_0,
                                 Q5_1), else float32: a K-quant's super-scale times its sub-scale, computed as
                                 gguf computes it
    offset [rows, cols // G]     (scale's dtype) for the formats with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K),
                                 else None
with G = `HELD_TYPES[qtype]`, one group per sub-block. `dequantize` gives, bit for bit, what
`gguf.quants.dequantize` gives for the raw blocks:
    w = float32(values) * float32(scale) (+ float32(offset))
Why it is exact: gguf's numpy code is `d * q` or `d * q + m` for the plain types and `(d * sc) * q - dmin * m`
for the K-quants, each a float32 product and at most one add. We keep gguf's own float32 factors (the
float16 scale widened, `d * sc` as gguf rounds it) and fold the integer shifts into `values`; a product is
commutative in IEEE, and `x + (-y)` is `x - y` bit for bit, so `offset = -(dmin * m)`.
It also stays exact under FMA contraction (XLA fuses the multiply and the add, on CPU too): every product
`values * scale` is exact in float32 (at most 11 + 7 + 5 significant bits, and no subnormals: every term is a
multiple of float16's smallest step, 2**-24), so rounding it first or not changes nothing.

Not held (left to be dequantized to float at load): the other GGUF types. The IQ1/IQ2/IQ3 types decode
through codebook grids (several elements per code); IQ4_NL / IQ4_XS (an int8 codebook value per element),
TQ1_0 / TQ2_0 and MXFP4 would fit this layout exactly too but are not held yet.
"""

from __future__ import annotations

import gguf
import numpy as np

from dcpjax.quantization.formats import BlockFormat

Q = gguf.GGMLQuantizationType

# qtype -> G, the elements that share one scale (and offset): one plain block, or one K-quant sub-block
HELD_TYPES: dict[gguf.GGMLQuantizationType, int] = {
    Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32,
    Q.Q2_K: 16, Q.Q3_K: 16, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16,
}

_NIBBLES = np.array([0, 4], dtype=np.uint8)
_CRUMBS = np.array([0, 2, 4, 6], dtype=np.uint8)
_BITS = np.arange(8, dtype=np.uint8)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block [n, type_size] -> [n, 1] float16 (a copy, as gguf reads it)."""
    return blocks[:, at:at + 2].copy().view(np.float16)


def _low_high(qs: np.ndarray, width: int) -> np.ndarray:
    """Nibbles of [n, k] bytes, each run of `width` bytes giving its `width` low then its `width` high nibbles
    -> [n, 2 * k] uint8 (gguf's order for Q4_0 .. Q5_1, Q4_K, Q5_K and Q6_K's low bits)."""
    n, k = qs.shape  # explicit sizes, not -1: n may be 0
    return ((qs.reshape(n, k // width, 1, width) >> _NIBBLES.reshape(1, 1, 2, 1)) & np.uint8(0x0F)).reshape(n, 2 * k)


def _bits(qh: np.ndarray, shifts: np.ndarray, mask: int) -> np.ndarray:
    """Fields of [n, k] bytes: byte j of each run of 32 gives element j of `len(shifts)` consecutive runs
    of 32 ((byte >> shift) & mask) -> [n, k * len(shifts)] uint8."""
    n, k = qh.shape
    fields = (qh.reshape(n, k // 32, 1, 32) >> shifts.reshape(1, 1, -1, 1)) & np.uint8(mask)
    return fields.reshape(n, k * len(shifts))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's / Q5_K's 12 bytes of 6-bit sub-scales and mins [n, 12] -> (sc, m), each [n, 8] uint8."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scale(d: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """A K-quant's super-scale [n, 1] float16 times its integer sub-scales [n, s] -> [n, s] float32, rounded
    as gguf rounds it (float32(d) * float32(sub))."""
    return d.astype(np.float32) * sub.astype(np.float32)


def _unpack_blocks(blocks: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw blocks [n, type_size] uint8 -> values [n, block_size] int8, scale and offset [n, block_size // G]."""
    n = blocks.shape[0]
    if qtype == Q.Q8_0:  # d(2) qs(32): x * d
        return blocks[:, 2:].view(np.int8).copy(), _f16(blocks, 0), None  # a copy: never a view of the mmap
    if qtype == Q.Q4_0:  # d(2) qs(16): d * (q - 8)
        return (_low_high(blocks[:, 2:], 16).view(np.int8) - np.int8(8)), _f16(blocks, 0), None
    if qtype == Q.Q4_1:  # d(2) m(2) qs(16): d * q + m
        return _low_high(blocks[:, 4:], 16).view(np.int8), _f16(blocks, 0), _f16(blocks, 2)
    if qtype in (Q.Q5_0, Q.Q5_1):  # d(2) [m(2)] qh(4) qs(16): bit j of qh (little-endian uint32) is q_j's bit 4
        at = 2 if qtype == Q.Q5_0 else 4
        high = np.unpackbits(blocks[:, at:at + 4], axis=-1, bitorder="little")
        q = (_low_high(blocks[:, at + 4:], 16) | (high << np.uint8(4))).view(np.int8)
        if qtype == Q.Q5_0:  # d * (q - 16)
            return q - np.int8(16), _f16(blocks, 0), None
        return q, _f16(blocks, 0), _f16(blocks, 2)  # d * q + m
    if qtype == Q.Q2_K:  # scales(16) qs(64) d(2) dmin(2): (d * sc) * q - (dmin * m), 16 sub-blocks of 16
        scales = blocks[:, :16]
        q = _bits(blocks[:, 16:80], _CRUMBS, 0x03).view(np.int8)
        scale = _k_scale(_f16(blocks, 80), scales & np.uint8(0x0F))
        offset = -_k_scale(_f16(blocks, 82), scales >> np.uint8(4))
        return q, scale, offset
    if qtype == Q.Q3_K:  # hmask(32) qs(64) scales(12) d(2): (d * (sc - 32)) * (q - 4 * (1 - hbit))
        low = _bits(blocks[:, 32:96], _CRUMBS, 0x03)
        high = _bits(blocks[:, :32], _BITS, 0x01)
        q = low.view(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).view(np.int8)
        # 16 6-bit sub-scales: low nibbles from bytes 0..7 (low halves then high halves), top 2 bits from 8..11
        lsc = ((blocks[:, 96:104].reshape(n, 1, 8) >> _NIBBLES.reshape(1, 2, 1)) & np.uint8(0x0F)).reshape(n, 16)
        hsc = ((blocks[:, 104:108].reshape(n, 1, 4) >> _CRUMBS.reshape(1, 4, 1)) & np.uint8(0x03)).reshape(n, 16)
        sc = (lsc | (hsc << np.uint8(4))).view(np.int8) - np.int8(32)
        return q, _k_scale(_f16(blocks, 108), sc), None
    if qtype in (Q.Q4_K, Q.Q5_K):  # d(2) dmin(2) scales(12) [qh(32)] qs(128): (d * sc) * q - (dmin * m)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == Q.Q4_K:
            q = _low_high(blocks[:, 16:], 32)
        else:
            q = _low_high(blocks[:, 48:], 32) | (_bits(blocks[:, 16:48], _BITS, 0x01) << np.uint8(4))
        return q.view(np.int8), _k_scale(_f16(blocks, 0), sc), -_k_scale(_f16(blocks, 2), mn)
    if qtype == Q.Q6_K:  # ql(128) qh(64) scales(16, int8) d(2): (d * sc) * (q - 32)
        q = (_low_high(blocks[:, :128], 64) | (_bits(blocks[:, 128:192], _CRUMBS, 0x03) << np.uint8(4)))
        sc = blocks[:, 192:208].view(np.int8)
        return q.view(np.int8) - np.int8(32), _k_scale(_f16(blocks, 208), sc), None
    raise ValueError(f"GGUF type {Q(qtype).name} is not held quantized; held: {[t.name for t in HELD_TYPES]}")


def unpack(raw: np.ndarray, qtype, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Whole rows of a GGUF tensor, raw [rows, bytes_per_row] uint8 (as `GGUFReader`'s `tensor.data[rows]`; any
    leading dims [..., bytes_per_row] work alike) of `cols` elements each ->
    (values [rows, cols] int8, scale [rows, cols // G], offset [rows, cols // G] or None), G = HELD_TYPES[qtype];
    scale and offset are float16 for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, float32 for the K-quants."""
    qtype = Q(qtype)
    if qtype not in HELD_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not held quantized; held: {[t.name for t in HELD_TYPES]}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{qtype.name} rows of {cols} elements are not whole {block_size}-element blocks")
    raw = np.asarray(raw).view(np.uint8)
    if raw.shape[-1] != cols // block_size * type_size:
        raise ValueError(f"{qtype.name} rows of {cols} elements take {cols // block_size * type_size} bytes, "
                         f"not {raw.shape[-1]}")
    lead = raw.shape[:-1]
    group = HELD_TYPES[qtype]
    values, scale, offset = _unpack_blocks(np.ascontiguousarray(raw).reshape(-1, type_size), qtype)
    values = np.ascontiguousarray(values).reshape(*lead, cols)
    scale = np.ascontiguousarray(scale).reshape(*lead, cols // group)
    if offset is not None:
        offset = np.ascontiguousarray(offset).reshape(*lead, cols // group)
    return values, scale, offset


def dequantize(values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """values [rows, cols] * scale [rows, cols // G] (+ offset [rows, cols // G]) -> [rows, cols] float32 (any
    leading dims alike), in float32 and in this order: bit for bit `gguf.quants.dequantize` of the raw rows.
    The reference the library's jitted `quantization.weight.dequantize` mirrors."""
    *lead, cols = values.shape
    groups = scale.shape[-1]
    w = values.astype(np.float32).reshape(*lead, groups, cols // groups) * scale.astype(np.float32)[..., None]
    if offset is not None:
        w = w + offset.astype(np.float32)[..., None]
    return w.reshape(values.shape)


_FLOAT16_SCALED = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
_WITH_OFFSET = {Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K}


def held_format(qtype) -> BlockFormat:
    """How a tensor of GGUF type `qtype` (one of `HELD_TYPES`) is held: int8 values in [1, G] blocks
    of its [out, in] layout, with `unpack`'s scale dtype and offset."""
    return BlockFormat(Q(qtype).name, (1, HELD_TYPES[Q(qtype)]), "int8",
                       "float16" if qtype in _FLOAT16_SCALED else "float32", qtype in _WITH_OFFSET)
