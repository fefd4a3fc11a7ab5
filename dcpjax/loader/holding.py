"""Which parameters a model holds quantized, and how many bytes each device holds.

`held_quantized` decides, per dcpjax parameter, from the formats of the checkpoint tensors its
rule reads (`TensorSource.format`) and the rule's `groups`: a parameter is held quantized
(`quantization.weight.QuantizedWeight`) when all its tensors share one format and its rule maps a
block to dcpjax groups; each group is then cut to divide every device's share of its axis, so each
device holds whole groups and a TP split through a checkpoint block stays exact. Anything else
quantized in the checkpoint is dequantized at load.

`weight_bytes_per_device` counts what a device holds from the abstract state (values, scales and
offsets included): the one count the engine logs and the planner plans with.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from dcpjax.models.weight_rules import Rule
from dcpjax.quantization.formats import BlockFormat
from dcpjax.quantization.weight import QuantizedWeight
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import RULES

logger = logging.getLogger(__name__)
# (checkpoint tensor name, its shape) -> how that tensor is quantized (None: float)
FormatOf = Callable[[str, tuple[int, ...]], BlockFormat | None]


@dataclasses.dataclass(frozen=True)
class Held:
    """A parameter held quantized: its checkpoint `format` and the `groups` one scale covers along
    each dcpjax axis (dividing each device's share)."""

    format: BlockFormat
    groups: tuple[int, ...]


def path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def held_quantized(rules: dict[str, Rule], format_of: FormatOf, state: nnx.State,
                   pc: ParallelConfig) -> dict[str, Held]:
    """dcpjax parameter path -> `Held`, for the parameters held quantized (see the module docstring).
    Parameters read from quantized tensors but not held are logged (they are dequantized at load)."""
    held, dequantized = {}, []
    for path, var in nnx.to_flat_state(state):
        name, rule = path_name(path), rules.get(path_name(path))
        formats = {format_of(tensor, shape) for tensor, shape in rule.tensors.items()} if rule else {None}
        if formats == {None}:
            continue
        shape = var.get_value().shape
        groups = rule.groups(next(iter(formats)).block) if rule.groups and len(formats) == 1 else None
        if groups is None or len(groups) != len(shape):
            dequantized.append(name)
            continue
        held[name] = Held(next(iter(formats)), tuple(math.gcd(g, n // RULES.ways(axis, pc))
                                                     for g, n, axis in zip(groups, shape, var.logical_axes)))
    if dequantized:
        logger.info("%d parameters read from quantized tensors are dequantized at load (their layout or mixed "
                    "formats cannot be held): %s", len(dequantized), ", ".join(dequantized[:8]))
    return held


def pad_multiple(formats) -> int:
    """What a padded axis's share per device is rounded to (`models.layers.padding_multiple`) for
    weights of these formats: the widest side of their blocks (128 for fp8's 128 x 128, 32 for
    GGUF's 1 x 32), so a padded share spans whole blocks (a narrower side keeps the groups their
    common divisor allows; per-tensor scales ask nothing)."""
    sides = [max(f.block) for f in formats if f is not None and not f.per_tensor]
    return math.lcm(*sides) if sides else 1


def _parent_and_key(model: nnx.Module, path: tuple) -> tuple[object, object]:
    node = model
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node, path[-1]


def hold_quantized(graphdef: nnx.GraphDef, state: nnx.State, held: dict[str, Held]) -> tuple[nnx.GraphDef,
                                                                                               nnx.State]:
    """The abstract model with each parameter of `held` replaced by a `QuantizedWeight` of the same
    shape and logical axes, dequantized into the dtype the parameter was declared with (the model
    dtype; float32 for DeepSeek's router)."""
    if not held:
        return graphdef, state
    model = nnx.merge(graphdef, state)
    places, makers = [], []
    for path, var in list(nnx.to_flat_state(state)):
        spec = held.get(path_name(path))
        if spec is None:
            continue
        value = var.get_value()
        fmt = spec.format
        makers.append(lambda value=value, var=var, fmt=fmt, groups=spec.groups: QuantizedWeight(
            tuple(value.shape), tuple(var.logical_axes), groups, jnp.dtype(fmt.values_dtype),
            jnp.dtype(fmt.scale_dtype), fmt.has_offset, value.dtype,
            getattr(var, "unpadded_shape", tuple(value.shape))))
        places.append(_parent_and_key(model, tuple(getattr(p, "key", p) for p in path)))
    # one abstract trace for every weight: a trace each costs ~8 ms, and DeepSeek-V3 holds ~700 per layout
    for (parent, key), weight in zip(places, nnx.eval_shape(lambda: [make() for make in makers])):
        setattr(parent, key, weight)
    return nnx.split(model)


def weight_bytes_per_device(state: nnx.State, pc: ParallelConfig) -> int:
    """Bytes of the fullest device's shard of every parameter of `state` (abstract or loaded):
    quantized values, scales and offsets included; float32 routers stay float32."""
    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = math.prod(n // RULES.ways(a, pc) for n, a in zip(value.shape, var.logical_axes))
        total += shard * jnp.dtype(value.dtype).itemsize
    return total


def held_summary(held: dict[str, Held]) -> dict[str, int]:
    """Parameters held quantized per format name (for the load log)."""
    counts: dict[str, int] = {}
    for spec in held.values():
        counts[spec.format.name] = counts.get(spec.format.name, 0) + 1
    return counts
