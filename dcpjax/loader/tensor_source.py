"""Where checkpoint tensors come from: a `TensorSource` reads a named tensor, or a slice of it, as
numpy. Safetensors files (`SafetensorsSource`), an in-memory state dict for random tiny models
(`DictSource`) and a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`) are sources; the rules
(`dcpjax.models.weight_rules`) read from any of them, each device only its slice.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import numpy as np


class TensorSource:
    """Read a named tensor, or a slice of it, as numpy (a `weight_rules.TensorReader`, plus the
    names and shapes the checkpoint check compares)."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError


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

    def names(self):
        return set(self.weight_map)

    def shape(self, name):
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

    def read(self, name, index):
        return np.asarray(self.handles[self.weight_map[name]].get_slice(name)[index])
