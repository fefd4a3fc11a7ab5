"""Hugging Face weights -> sharded parameters, each device reading only its slice.

Every dcpjax parameter has a rule (`dcpjax.models.weight_rules`, chosen by the config's family:
`dcpjax.loader.rules`) that maps the part a device holds (an index of slices into the dcpjax
layout) to the slice of the Hugging Face tensor it comes from, so `jax.make_array_from_callback`
reads exactly those bytes from a `TensorSource` (`dcpjax.loader.tensor_source`): safetensors
files, a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`, the same Hugging Face names and
shapes) or an in-memory state dict for random tiny models.
Parameters padded for the mesh (`models.layers.PADDABLE_AXES`) read their true part
and zeros after it (`read_padded`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from dcpjax.loader.rules import IGNORED_CHECKPOINT_TENSORS, model_rules
from dcpjax.loader.tensor_source import DictSource, TensorSource
from dcpjax.models.config import ModelConfig
from dcpjax.models.weight_rules import Rule, bounds
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import logical_spec


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
    spans = bounds(index, shape)
    if tuple(shape) == tuple(unpadded):
        return rule.read(source, index, shape)
    true_part = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(spans, unpadded))
    block = np.zeros([b - a for a, b in spans], np.float32)
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
