"""A GGUF reader that parses the key-value metadata with struct and numpy.

gguf-py's `GGUFReader` builds a memory-map view per element of every metadata array: Gemma 3's
262,144 tokens, scores and token types take it 17-25 s (SmolLM2's 49,152 about 10 s). This
subclass reads the same metadata in under a second and leaves the tensor infos to gguf-py. Its
`meta` equals `{key: field.contents()}` of gguf-py's fields (tested); `fields` keeps only
`general.alignment`, the one field the reader itself consults. Big-endian files, and any gguf-py
whose private `_build_fields` / `_push_field` this relies on have changed, take gguf-py's own path.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType) -> little-endian numpy dtype; 8 string, 9 array
_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
           12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9


def read_metadata(buf: memoryview, pos: int, count: int) -> tuple[dict[str, Any], int]:
    """`count` key-value pairs from byte `pos` of a little-endian file -> ({key: value, arrays as
    lists}, the offset just past them)."""
    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def value(kind: int, pos: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(pos)
        if kind == _ARRAY:
            sub, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub in (_STRING, _ARRAY):
                items = []
                for _ in range(n):
                    item, pos = value(sub, pos)
                    items.append(item)
                return items, pos
            dtype = np.dtype(_SCALAR[sub])
            array = np.frombuffer(buf, dtype=dtype, count=n, offset=pos)
            return (array.astype(bool) if sub == _BOOL else array).tolist(), pos + n * dtype.itemsize
        dtype = np.dtype(_SCALAR[kind])
        item = np.frombuffer(buf, dtype=dtype, count=1, offset=pos)[0].item()
        return (bool(item) if kind == _BOOL else item), pos + dtype.itemsize

    meta = {}
    for _ in range(count):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        meta[key], pos = value(kind, pos + 4)
    return meta, pos


def open_reader(gguf, path: str) -> tuple[Any, dict[str, Any]]:
    """(a `gguf.GGUFReader` of `path` with its tensors, the file's metadata without the GGUF.* header
    fields); the fast path where gguf-py allows it, gguf-py's own otherwise."""

    class FastReader(gguf.GGUFReader):
        def _build_fields(self, offs, count):
            if self.byte_order == "S":  # a big-endian file: gguf-py's own path
                return super()._build_fields(offs, count)
            self.meta, end = read_metadata(memoryview(self.data), offs, int(count))
            if "general.alignment" in self.meta:
                self._push_field(gguf.ReaderField(offs, "general.alignment",
                                                  [np.array([self.meta["general.alignment"]], np.uint32)], [0],
                                                  [gguf.GGUFValueType.UINT32]))
            return end

    try:
        reader = FastReader(path)
    except (AttributeError, TypeError):  # a gguf-py whose private hooks differ
        reader = gguf.GGUFReader(path)
    meta = getattr(reader, "meta", None)
    if meta is None:
        meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return reader, meta
