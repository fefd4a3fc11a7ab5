"""Hugging Face weights -> sharded parameters, each device reading only its slice.

Every dcpjax parameter has a rule (`dcpjax.models.weight_rules`, chosen by the config's family:
`dcpjax.loader.rules`) that maps the part a device holds (an index of slices into the dcpjax
layout) to the slice of the Hugging Face tensor it comes from, so `jax.make_array_from_callback`
reads exactly those bytes from a `TensorSource` (`dcpjax.loader.tensor_source`): safetensors
files, a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`, the same Hugging Face names and
shapes) or an in-memory state dict for random tiny models.
Parameters padded for the mesh (`models.layers.PADDABLE_AXES`) read their true part
and zeros after it (`read_padded`). A parameter held quantized (`loader.holding`) reads each of its
parts through the same rule (`read_held_part`): values as stored, one scale per group.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from dcpjax.loader.holding import Held, path_name
from dcpjax.loader.rules import IGNORED_CHECKPOINT_TENSORS, model_rules
from dcpjax.loader.tensor_source import QUANT_PARTS, DictSource, TensorSource
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


class _PartView:
    """One part of a source's quantized tensors, read as a rule reads tensors."""

    def __init__(self, source: TensorSource, part: str):
        self.source, self.part = source, part

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.source.read_part(name, index, self.part)


def read_held_part(rule: Rule, source: TensorSource, held: Held, part: str, name: str, index: tuple[slice, ...],
                   weight_shape: tuple[int, ...], unpadded: tuple[int, ...]) -> np.ndarray:
    """A device's block of one part of a parameter held quantized. `index` is into the part:
    the weight's own for "values"; for "scale" / "offset" each index covers `held.groups` weight
    elements per axis, whose per-element scales are read through the rule, checked to be one
    value per group (on the weight's true part; padding holds zeros) and kept once."""
    view = _PartView(source, part)
    if part == "values":
        return read_padded(rule, view, index, weight_shape, unpadded)
    groups = held.groups
    spans = bounds(index, tuple(n // g for n, g in zip(weight_shape, groups)))
    elements = tuple(slice(a * g, b * g) for (a, b), g in zip(spans, groups))
    per_element = read_padded(rule, view, elements, weight_shape, unpadded)
    kept = per_element[tuple(slice(None, None, g) for g in groups)]
    spread = kept
    for axis, g in enumerate(groups):
        spread = np.repeat(spread, g, axis=axis)
    true = tuple(slice(0, max(0, min(n, b * g) - a * g)) for (a, b), g, n in zip(spans, groups, unpadded))
    if not np.array_equal(spread[true], per_element[true]):
        raise ValueError(f"parameter {name}: its checkpoint's {held.format.name} blocks {held.format.block} do not "
                         f"map onto groups {groups} of the dcpjax layout; load it with quantization='none'")
    return kept


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
               progress: bool = True, ignored=lambda name: False, held: dict[str, Held] | None = None) -> nnx.State:
    """Fill an abstract model state with sharded arrays read from `source`, each converted
    to the dtype its parameter was declared with (the model dtype; float32 for routers); the
    parameters of `held` (`loader.holding.hold_quantized`) part by part."""
    check_checkpoint(rules, source, ignored)
    held = held or {}
    flat = list(nnx.to_flat_state(abstract_state))
    names = [_param_and_part(path_name(p), held) for p, _ in flat]
    unknown = [param for param, _ in names if param not in rules]
    if unknown:
        raise ValueError(f"no checkpoint rule for parameters: {unknown}")
    weights = {path_name(p): v for p, v in flat}
    for (path, var), (param, part) in tqdm(list(zip(flat, names)), desc="Loading weights", disable=not progress,
                                            unit="tensor"):
        rule, shape = rules[param], tuple(var.get_value().shape)
        sharding = NamedSharding(mesh, logical_spec(*var.logical_axes))
        target = var.get_value().dtype
        if part is None:
            unpadded = getattr(var, "unpadded_shape", shape)
            read = lambda index, rule=rule, shape=shape, unpadded=unpadded: read_padded(rule, source, index, shape,
                                                                                       unpadded)
        else:
            values = weights[f"{param}.values"]
            weight_shape = tuple(values.get_value().shape)
            unpadded = getattr(values, "unpadded_shape", weight_shape)
            read = lambda index, rule=rule, part=part, param=param, weight_shape=weight_shape, unpadded=unpadded: (
                read_held_part(rule, source, held[param], part, param, index, weight_shape, unpadded))
        var.set_value(jax.make_array_from_callback(shape, sharding, lambda index, read=read, target=target:
                                                   read(index).astype(target)))
    return abstract_state


def _param_and_part(name: str, held: dict[str, Held]) -> tuple[str, str | None]:
    """"layers.0.mlp.gate.scale" -> ("layers.0.mlp.gate", "scale") for a held parameter's part."""
    param, _, part = name.rpartition(".")
    return (param, part) if part in QUANT_PARTS and param in held else (name, None)


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
