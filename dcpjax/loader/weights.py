"""Hugging Face weights -> sharded parameters, each device reading only its slice.

Every dcpjax parameter has a rule (`dcpjax.loader.rules`) that maps the part a device holds (an
index of slices into the dcpjax layout) to the slice of the Hugging Face tensor it comes
from, so `jax.make_array_from_callback` reads exactly those bytes from a
`TensorSource`: safetensors files, a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`, the same
Hugging Face names and shapes) or an in-memory state dict for random tiny models.
Parameters padded for the mesh (`models.layers.PADDABLE_AXES`) read their true part
and zeros after it (`read_padded`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from dcpjax.config import ParallelConfig
from dcpjax.loader.rules import IGNORED_CHECKPOINT_TENSORS, Rule, _bounds, model_rules
from dcpjax.models.config import ModelConfig
from dcpjax.sharding.mesh import logical_spec


# -- where tensors come from -------------------------------------------------------------
class TensorSource:
    """Read a named tensor, or a slice of it, as numpy."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError


class DictSource(TensorSource):
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


# -- loading -------------------------------------------------------------------------------
def check_checkpoint(rules: dict[str, Rule], source: TensorSource, ignored=lambda name: False) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over."""
    expected = {name: shape for r in rules.values() for name, shape in r.tensors.items()}
    available = source.names()
    missing = sorted(set(expected) - available)
    extra = sorted(n for n in available - set(expected) if not IGNORED_CHECKPOINT_TENSORS.match(n) and not ignored(n))
    wrong = [f"{n}: checkpoint {source.shape(n)}, model expects {s}" for n, s in expected.items()
             if n in available and source.shape(n) != s]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}")
    if wrong:
        problems.append("mis-shaped tensors: " + "; ".join(wrong[:10]))
    if problems:
        raise ValueError("checkpoint does not match the model config: " + " | ".join(problems))


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def read_padded(rule: Rule, source: TensorSource, index: tuple[slice, ...], shape: tuple[int, ...],
                unpadded: tuple[int, ...]) -> np.ndarray:
    """A device's block of a parameter whose axes are padded past the checkpoint's `unpadded`
    sizes (see `models.layers.PADDABLE_AXES`): the true part read by `rule`, zeros after it."""
    bounds = _bounds(index, shape)
    if tuple(shape) == tuple(unpadded):
        return rule.read(source, index, shape)
    true_part = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(bounds, unpadded))
    block = np.zeros([b - a for a, b in bounds], np.float32)
    if all(s.stop > s.start for s in true_part):
        values = rule.read(source, true_part, tuple(unpadded))
        block = block.astype(values.dtype)
        block[tuple(slice(0, n) for n in values.shape)] = values
    return block


def load_state(abstract_state: nnx.State, rules: dict[str, Rule], source: TensorSource, mesh: Mesh,
               progress: bool = True, ignored=lambda name: False) -> nnx.State:
    """Fill an abstract model state with sharded arrays read from `source`, each converted
    to the dtype its parameter was declared with (the model dtype; float32 for routers)."""
    check_checkpoint(rules, source, ignored)
    flat = list(nnx.to_flat_state(abstract_state))
    unknown = [_path_name(p) for p, _ in flat if _path_name(p) not in rules]
    if unknown:
        raise ValueError(f"no checkpoint rule for parameters: {unknown}")
    for path, var in tqdm(flat, desc="Loading weights", disable=not progress, unit="tensor"):
        rule, shape = rules[_path_name(path)], tuple(var.get_value().shape)
        unpadded = getattr(var, "unpadded_shape", shape)
        sharding = NamedSharding(mesh, logical_spec(*var.logical_axes))
        target = var.get_value().dtype
        read = lambda index, rule=rule, shape=shape, unpadded=unpadded, target=target: read_padded(
            rule, source, index, shape, unpadded).astype(target)
        var.set_value(jax.make_array_from_callback(shape, sharding, read))
    return abstract_state


def random_checkpoint(cfg: ModelConfig, pc: ParallelConfig, seed: int, std: float = 0.3) -> DictSource:
    """A random Hugging Face-layout state dict for a built-in tiny model (norms at 1)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    expected = {name: shape for r in model_rules(cfg, pc).values() for name, shape in r.tensors.items()}
    for name in sorted(expected):
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(expected[name], np.float32)
        else:
            tensors[name] = (rng.standard_normal(expected[name]) * std).astype(np.float32)
    return DictSource(tensors)
