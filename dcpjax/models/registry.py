"""The model registry: the families dcpjax runs (one line each), which class implements an
architecture, its abstract parameters on a mesh, and the one check that a layout can hold it (for
`LLM` and the planner alike).

Each family module declares its `ModelFamily` (`dcpjax.models.family`); importing this module
registers them with the config reader, and `dcpjax.models` imports it first, so
`ModelConfig.from_hf` and `TINY_MODELS` know every family whichever model module is imported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.models import deepseek, dsa, gemma3, llama, qwen3_next
from dcpjax.models.config import ModelConfig, register_architectures
from dcpjax.models.family import GGUFArchitecture, ModelFamily
from dcpjax.models.layers import padding_multiple, unsplittable_dims
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import logical_spec

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    deepseek.FAMILY,
    dsa.FAMILY,
    qwen3_next.FAMILY,
    gemma3.FAMILY,
)


def _by_architecture(families: tuple[ModelFamily, ...]) -> dict[str, ModelFamily]:
    """Architecture -> its family; each architecture in one family only."""
    table: dict[str, ModelFamily] = {}
    for family in families:
        for architecture in family.architectures:
            if architecture in table:
                raise ValueError(f"{architecture} is claimed by both {table[architecture].name} and {family.name}")
            table[architecture] = family
    return table


_FAMILY_OF = _by_architecture(FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(_FAMILY_OF)
MODEL_CLASSES = {architecture: family.model_class for architecture, family in _FAMILY_OF.items()}
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {name: arch for family in FAMILIES
                                                   for name, arch in family.gguf.items()}


def _register(families: tuple[ModelFamily, ...]) -> None:
    """Tell the config reader each family's architectures, own fields and tiny models."""
    for family in families:
        register_architectures(family.architectures, family.config_fields, family.tiny_models, family.text_parts)


_register(FAMILIES)


def family_of(architecture: str) -> ModelFamily:
    """The family that builds `architecture`; ValueError naming the supported ones."""
    if architecture not in _FAMILY_OF:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return _FAMILY_OF[architecture]


def _abstract_model(cfg: ModelConfig, pc: ParallelConfig, dtype, pad_multiple: int = 1) -> tuple[nnx.GraphDef,
                                                                                                   nnx.State]:
    model_class = family_of(cfg.architecture).model_class
    with padding_multiple(pad_multiple):
        return nnx.split(nnx.eval_shape(lambda: model_class(cfg, pc, dtype)))


def layout_problems(cfg: ModelConfig, pc: ParallelConfig, state: nnx.State | None = None) -> list[str]:
    """Why this model cannot run on `pc`'s mesh, one sentence each (empty: it can): the TP/DCP
    rules, then any parameter dimension the mesh cannot split (of `state`, the abstract model,
    built here if not given). The one check of `build_model` and the planner, so a layout
    reported valid also loads."""
    broken = pc.model_rule_violations(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    if broken:
        return broken
    if state is None:
        return list(_abstract_layout_problems(cfg, pc))
    return unsplittable_dims(state, pc)


@functools.lru_cache(maxsize=64)
def _abstract_layout_problems(cfg: ModelConfig, pc: ParallelConfig) -> tuple[str, ...]:
    """`unsplittable_dims` of the abstract model, kept per (config, layout): the planner asks for the same
    layouts many times (a large MoE's abstract model takes seconds to build)."""
    return tuple(unsplittable_dims(_abstract_model(cfg, pc, jnp.float32)[1], pc))


def build_model(cfg: ModelConfig, pc: ParallelConfig, dtype, pad_multiple: int = 1) -> tuple[nnx.GraphDef,
                                                                                            nnx.State]:
    """The model's structure and its abstract (shape-only) parameters, checked against the mesh
    before any weight is read (ValueError names the rule, with the DCP sizes that would be
    valid, or the dimension). `pad_multiple`: see `layers.padding_multiple`."""
    pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    graphdef, state = _abstract_model(cfg, pc, dtype, pad_multiple)
    problems = layout_problems(cfg, pc, state)
    if problems:
        raise ValueError(f"tensor_parallel_size={pc.tp}, decode_context_parallel_size={pc.dcp} cannot hold this "
                         f"model: " + "; ".join(problems))
    return graphdef, state


def param_specs(state: nnx.State):
    """PartitionSpec per parameter, from its logical axes."""
    return jax.tree.map(
        lambda var: logical_spec(*var.logical_axes), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
