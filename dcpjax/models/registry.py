"""The model registry: which class implements an architecture, its abstract parameters on a mesh,
and the one check that a layout can hold it (for `LLM` and the planner alike)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.config import ParallelConfig
from dcpjax.models.config import LLAMA_FAMILY, ModelConfig
from dcpjax.models.deepseek import DeepseekV3ForCausalLM
from dcpjax.models.layers import unsplittable_dims
from dcpjax.models.llama import LlamaForCausalLM
from dcpjax.models.qwen3_next import Qwen3NextForCausalLM
from dcpjax.sharding.mesh import logical_spec

MODEL_CLASSES = {arch: LlamaForCausalLM for arch in LLAMA_FAMILY} | {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
                                                                     "Qwen3NextForCausalLM": Qwen3NextForCausalLM}


def _abstract_model(cfg: ModelConfig, pc: ParallelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    model_class = MODEL_CLASSES[cfg.architecture]
    return nnx.split(nnx.eval_shape(lambda: model_class(cfg, pc, dtype)))


def layout_problems(cfg: ModelConfig, pc: ParallelConfig, state: nnx.State | None = None) -> list[str]:
    """Why this model cannot run on `pc`'s mesh, one sentence each (empty: it can): the TP/DCP
    rules, then any parameter dimension the mesh cannot split (of `state`, the abstract model,
    built here if not given). The one check of `build_model` and the planner, so a layout
    reported valid also loads."""
    broken = pc.model_rule_violations(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    if broken:
        return broken
    return unsplittable_dims(state if state is not None else _abstract_model(cfg, pc, jnp.float32)[1], pc)


def build_model(cfg: ModelConfig, pc: ParallelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its abstract (shape-only) parameters, checked against the mesh
    before any weight is read (ValueError names the rule, with the DCP sizes that would be
    valid, or the dimension)."""
    pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    graphdef, state = _abstract_model(cfg, pc, dtype)
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
