"""Where checkpoint tensors come from: a `TensorSource` reads a named tensor, or a slice of it, as
numpy. Safetensors files (`SafetensorsSource`), an in-memory state dict for random tiny models
(`DictSource`) and a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`) are sources; the rules
(`dcpjax.models.weight_rules`) read from any of them, each device only its slice.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from dcpjax.models.weight_rules import bounds
from dcpjax.quantization.formats import BlockFormat

QUANT_PARTS = ("values", "scale", "offset")
# safetensors dtypes its numpy reader cannot give (fp8 checkpoints), as ml_dtypes' numpy dtypes
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}

class TensorSource:
    """Read a named tensor, or a slice of it, as numpy (a `weight_rules.TensorReader`, plus the
    names and shapes the checkpoint check compares)."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice as float (a quantized tensor dequantized)."""
        raise NotImplementedError

    def dtype(self, name: str) -> np.dtype:
        """The dtype a tensor is stored in (default: read one element)."""
        return self.read(name, (slice(0, 1),) * len(self.shape(name))).dtype

    def format(self, name: str) -> BlockFormat | None:
        """How `name` is quantized in this source (None: it is float)."""
        return None

    def read_part(self, name: str, index: tuple[slice, ...], part: str) -> np.ndarray:
        """A quantized tensor's `part` over the slice `index` of its checkpoint layout: "values" as
        stored (float8_e4m3fn, int8), "scale" / "offset" the block scale (offset) of each element,
        float32, same shape."""
        raise ValueError(f"checkpoint tensor {name} is not quantized")


def slice_ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
    """Each axis of `index` (missing trailing axes: whole) as a range into `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [range(a, b) for a, b in bounds(index, shape)]


class DictSource(TensorSource):
    """Tensors held in memory (a random tiny model's checkpoint)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = dict(tensors)

    def names(self):
        return set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, index):
        return np.asarray(self.tensors[name][index])


class RenamedSource(TensorSource):
    """Another source's tensors under new names (`rename`: its name -> ours, None to hide it): the
    text model of a multimodal checkpoint (`models.config.TextPart`)."""

    def __init__(self, source: TensorSource, rename: Callable[[str], str | None]):
        self.source = source
        self._theirs = {ours: name for name in source.names() if (ours := rename(name)) is not None}

    def names(self):
        return set(self._theirs)

    def shape(self, name):
        return self.source.shape(self._theirs[name])

    def dtype(self, name):
        return self.source.dtype(self._theirs[name])

    def read(self, name, index):
        return self.source.read(self._theirs[name], index)

    def format(self, name):
        return self.source.format(self._theirs[name])

    def read_part(self, name, index, part):
        return self.source.read_part(self._theirs[name], index, part)


class SafetensorsSource(TensorSource):
    """`*.safetensors` files of a folder, with or without `model.safetensors.index.json`."""

    def __init__(self, folder: str | pathlib.Path):
        from safetensors import safe_open

        folder = pathlib.Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ValueError(f"{folder} has no *.safetensors files")
        self.handles = {f: safe_open(str(folder / f), framework="flax") for f in files}
        if weight_map is None:
            # safe_open handles have keys() but are not iterable
            weight_map = {name: f for f, h in self.handles.items() for name in h.keys()}  # noqa: SIM118
        self.weight_map = weight_map
        self.folder = folder
        self._headers: dict[pathlib.Path, tuple[int, dict]] = {}

    def names(self):
        return set(self.weight_map)

    def shape(self, name):
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

    def dtype(self, name):
        """From the file's header, nothing read."""
        kind = self.handles[self.weight_map[name]].get_slice(name).get_dtype()
        return np.dtype(_RAW_DTYPES[kind]) if kind in _RAW_DTYPES else super().dtype(name)

    def read(self, name, index):
        part = self.handles[self.weight_map[name]].get_slice(name)
        if part.get_dtype() in _RAW_DTYPES:  # dtypes safetensors' numpy reader lacks: mapped from the file
            return self._raw(name)[index]
        return np.asarray(part[index])

    def _raw(self, name: str) -> np.ndarray:
        """A tensor of the file memory-mapped (safetensors: an 8-byte header length, the JSON header,
        then each tensor's bytes at its data_offsets)."""
        path = self.folder / self.weight_map[name]
        if path not in self._headers:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        data = np.memmap(path, np.uint8, "r", offset=start + begin, shape=(end - begin,))
        return data.view(_RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])
