"""Qwen3-Next under DCP (Flax NNX): Gated DeltaNet layers and gated full-attention layers.

Most layers are linear attention (Gated DeltaNet): a short causal convolution over q, k, v and
the gated delta rule, whose fixed-size state per sequence lives in the layer's `LinearState`
(per engine slot); their heads split over all TP devices, each device running the recurrence
of its own heads. Every few layers is full attention (GQA with a sigmoid output gate, partial
RoPE, (1 + w) q/k norms: `LlamaAttention`) over the paged KV cache under DCP, exactly like
the other families. The MLPs are routed experts with a gated shared expert (`SparseMoE`), or
dense (`mlp_only_layers`). Norms store their weight centred on 0 and scale by (1 + w).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.kernels import LinearState
from dcpjax.models.base import CausalLM, DecoderLayer, StepBatch, StepContext
from dcpjax.models.component_rules import (
    decoder_rules,
    dense_or_routed_rules,
    gqa_attention_rules,
    linear_attention_rules,
    mlp_rules,
)
from dcpjax.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from dcpjax.models.family import ModelFamily
from dcpjax.models.gated_delta import CHUNK, causal_conv, gated_delta_rule
from dcpjax.models.layers import linear, param
from dcpjax.models.llama import LlamaAttention, llama_mlp
from dcpjax.models.weight_rules import Rule, transposed
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import reduce_model


class GatedRMSNorm(nnx.Module):
    """rms_norm(x) * weight * silu(gate), per value head (Gated DeltaNet's output norm)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = param((dim,), ("head_dim",), dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scaled = self.weight[...] * normed.astype(x.dtype)  # transformers' order: cast, scale, then the float32 gate
        return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Linear attention with a per-sequence state (see `dcpjax.models.gated_delta`).

    Parameters carry global shapes; inside `shard_map` each device holds key heads / TP and
    value heads / TP (each key head serves value_heads / key_heads value heads, all on its device).
    """

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        hidden, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, taps = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        heads = lambda n, d: param((hidden, n, d), ("embed", "linear_heads", "head_dim"), dtype)
        self.q_proj, self.k_proj, self.v_proj, self.z_proj = heads(nk, dk), heads(nk, dk), heads(nv, dv), heads(nv, dv)
        self.b_proj = param((hidden, nv), ("embed", "linear_heads"), dtype)
        self.a_proj = param((hidden, nv), ("embed", "linear_heads"), dtype)
        conv = lambda n, d: param((n, d, taps), ("linear_heads", "head_dim", None), dtype)
        self.conv_q, self.conv_k, self.conv_v = conv(nk, dk), conv(nk, dk), conv(nv, dv)
        self.dt_bias = param((nv,), ("linear_heads",), jnp.float32, init="ones")
        self.a_log = param((nv,), ("linear_heads",), jnp.float32)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, dtype)
        self.out_proj = param((nv, dv, hidden), ("linear_heads", "head_dim", "embed"), dtype)

    def __call__(self, x, batch: StepBatch, state: LinearState, ctx: StepContext):
        """x [B, T, hidden] (replicated); state: this device's heads of every slot's state.
        Returns the output [B, T, hidden] (replicated) and the updated state."""
        del ctx  # no collective inside: each device runs its own heads
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)
        slots, positions = batch.seq_slots.reshape(-1), batch.positions.reshape(-1)
        project = lambda w: linear(flat, w)

        def convolve(value, weight, conv_state):  # [N, heads, d] through the causal conv of its channels
            n, heads, d = value.shape
            out, conv_state = causal_conv(value.reshape(n, heads * d), weight[...].reshape(heads * d, -1), slots,
                                          positions, conv_state.reshape(conv_state.shape[0], heads * d, -1))
            return out.reshape(n, heads, d), conv_state.reshape(-1, heads, d, conv_state.shape[-1])

        q, conv_q = convolve(project(self.q_proj), self.conv_q, state.conv_q)
        k, conv_k = convolve(project(self.k_proj), self.conv_k, state.conv_k)
        v, conv_v = convolve(project(self.v_proj), self.conv_v, state.conv_v)
        group = v.shape[1] // q.shape[1]  # value heads per key head
        q, k = jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1)
        beta = jax.nn.sigmoid(linear(flat, self.b_proj).astype(jnp.float32))
        log_decay = -jnp.exp(self.a_log[...]) * jax.nn.softplus(linear(flat, self.a_proj).astype(jnp.float32)
                                                                 + self.dt_bias[...])
        out, recurrent = gated_delta_rule(q, k, v, log_decay, beta, slots, positions, state.recurrent,
                                          chunk=CHUNK if batch.packed else t, independent=not batch.packed)
        out = self.norm(out.astype(x.dtype), project(self.z_proj))  # [N, value heads, dv]
        out = linear(out, self.out_proj, contract=2)
        return reduce_model(out).reshape(b, t, hidden), LinearState(conv_q, conv_k, conv_v, recurrent)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next: `layer_types` picks each layer's token mixer."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype=jnp.float32):
        def make_layer(i: int) -> DecoderLayer:
            mixer = GatedDeltaNet(cfg, pc, dtype) if cfg.is_linear(i) else LlamaAttention(cfg, pc, dtype, i)
            return DecoderLayer(cfg, dtype, mixer, llama_mlp(cfg, pc, dtype, i))

        super().__init__(cfg, pc, dtype, make_layer)


# -- the family: what config.json and the checkpoint say ----------------------------------
def _layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer; ValueError unless every layer is named and one at least is full attention."""
    types = config.get("layer_types")
    if types is None:  # every full_attention_interval-th layer is full attention
        interval = config.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if len(types) != layers or unknown:
        raise ValueError(f"layer_types must name each of the {layers} layers {FULL_ATTENTION!r} or "
                         f"{LINEAR_ATTENTION!r}; got {len(types)} entries"
                         f"{', unknown ' + str(unknown) if unknown else ''}")
    if FULL_ATTENTION not in types:  # the KV cache (and DCP) lives in the full-attention layers
        raise ValueError(f"layer_types has no {FULL_ATTENTION!r} layer: dcpjax needs at least one (it holds the KV "
                         "cache that DCP splits); a model of linear-attention layers only is not supported")
    return tuple(types)


def qwen3_next_config_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's fields (transformers' defaults where a config leaves one out): the layer types,
    the linear heads, the full layers' output gate and partial RoPE, (1 + w) norms, q/k norms."""
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    return dict(
        layer_types=_layer_types(config, config["num_hidden_layers"]),
        linear_num_key_heads=config.get("linear_num_key_heads", 16),
        linear_num_value_heads=config.get("linear_num_value_heads", 32),
        linear_key_head_dim=config.get("linear_key_head_dim", 128),
        linear_value_head_dim=config.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=config.get("linear_conv_kernel_dim", 4), attention_output_gate=True,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
        norm_offset=1.0, shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
        qk_norm=True,
    )


def qwen3_next_checkpoint_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """Gated DeltaNet in `linear_attn` or gated GQA in `self_attn`; routed layers add the shared
    expert behind its sigmoid gate."""

    def layer(i: int, ours: str, hf: str) -> dict[str, Rule]:
        if cfg.is_linear(i):
            rules = linear_attention_rules(f"{ours}.attention", f"{hf}.linear_attn", cfg)
        else:
            rules = gqa_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg, pc)
        rules |= dense_or_routed_rules(f"{ours}.mlp", f"{hf}.mlp", cfg, i)
        if i in cfg.sparse_layers and cfg.shared_expert_intermediate_size:
            rules |= mlp_rules(f"{ours}.mlp.shared", f"{hf}.mlp.shared_expert", cfg.hidden_size,
                               cfg.shared_expert_intermediate_size)
            rules[f"{ours}.mlp.shared_gate"] = transposed(f"{hf}.mlp.shared_expert_gate.weight", (1, cfg.hidden_size))
        return rules

    return decoder_rules(cfg, layer)


FAMILY = ModelFamily(
    name="Qwen3-Next",
    architectures=("Qwen3NextForCausalLM",),
    model_class=Qwen3NextForCausalLM,
    checkpoint_rules=qwen3_next_checkpoint_rules,
    config_fields=qwen3_next_config_fields,
)
