"""Llama-family decoders under DCP: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE (Flax NNX).

GQA with RoPE, RMSNorm, SwiGLU; Qwen2's q/k/v bias, Qwen3's per-head q/k
RMSNorm, Qwen3-MoE's routed experts; tied embeddings. Runs inside `shard_map` (see `dcpjax.runner.model_runner`): query
heads, FFW and vocab split over all TP devices, KV heads over "tp", KV tokens
over "dcp". One forward handles a chunk of T tokens per sequence (prefill
chunks and decode alike): each token's K/V is written on the DCP rank that
owns its position, then every query attends to the distributed cache with its
own causal bound and the exact LSE merge.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.kernels import KVPools
from dcpjax.models.base import CausalLM, DecoderLayer, StepBatch, StepContext
from dcpjax.models.component_rules import decoder_rules, dense_or_routed_rules, gqa_attention_rules
from dcpjax.models.config import BYTE_EOS, BYTE_VOCAB, ModelConfig, RopeConfig
from dcpjax.models.family import GGUFArchitecture, ModelFamily
from dcpjax.models.layers import GatedMLP, RMSNorm, SparseMoE, linear, out_projection, param
from dcpjax.models.rope import apply_rope, rope_frequencies
from dcpjax.models.weight_rules import Rule
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.local_ops import dcp_attention
from dcpjax.sharding.mesh import kv_head_slots, reduce_model


class LlamaAttention(nnx.Module):
    """GQA over the paged DCP cache. Qwen3-Next's full-attention layers add a sigmoid output gate
    (q_proj gives each head's query and gate side by side), RoPE on a part of each head
    (`rotary_dim`) and (1 + w) q/k norms; Gemma's layers a sliding window on some of them (with
    their own RoPE base) and the softmax scale query_pre_attn_scalar ** -0.5."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype, layer: int):
        heads, d, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        slots = kv_head_slots(cfg.num_key_value_heads, pc)
        self.output_gate = cfg.attention_output_gate
        q_width = 2 * d if self.output_gate else d
        self.q_proj = param((hidden, heads, q_width), ("embed", "q_heads", "head_dim"), dtype)
        self.k_proj = param((hidden, slots, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_proj = param((hidden, slots, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.o_proj = param((heads, d, hidden), ("q_heads", "head_dim", "embed"), dtype)
        if cfg.attention_bias:
            self.q_bias = param((heads, d), ("q_heads", "head_dim"), dtype, init="zeros")
            self.k_bias = param((slots, d), ("kv_heads", "head_dim"), dtype, init="zeros")
            self.v_bias = param((slots, d), ("kv_heads", "head_dim"), dtype, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, axis="head_dim", offset=cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, axis="head_dim", offset=cfg.norm_offset)
        self.rotary_dim = cfg.rotary_dim
        inv_freq, self.rope_factor = rope_frequencies(cfg.rope_of(layer), self.rotary_dim)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: plain floats, not a Variable
        self.has_bias, self.has_qk_norm, self.head_dim = cfg.attention_bias, cfg.qk_norm, d
        self.scale, self.window, self.softcap = cfg.attention_scale, cfg.window_of(layer), cfg.attn_logit_softcapping

    def _rope(self, x, positions):
        """RoPE on the first `rotary_dim` dims of each head (all of them unless partial)."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, positions, self.inv_freq, self.rope_factor)
        rotated = apply_rope(x[..., : self.rotary_dim], positions, self.inv_freq, self.rope_factor)
        return jnp.concatenate([rotated, x[..., self.rotary_dim :]], axis=-1)

    def __call__(self, x, batch: StepBatch, kv: KVPools, ctx: StepContext):
        """x [B, T, hidden]; kv: this rank's K/V pools [kv_heads_local, blocks, block_size, head_dim].

        Returns the attention output [B, T, hidden] (replicated) and the updated kv.
        """
        positions = batch.positions
        q = linear(x, self.q_proj)
        gate = None
        if self.output_gate:  # each head's query, then its gate
            q, gate = jnp.split(q, 2, axis=-1)
        k = linear(x, self.k_proj)
        v = linear(x, self.v_proj)
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, positions), self._rope(k, positions)

        flat = lambda a: a.reshape(-1, *a.shape[2:])  # [B, T, H, d] -> [B * T, H, d]
        kv = kv.write(flat(k), flat(v), batch.slots)
        options = dataclasses.replace(ctx.attention, sm_scale=self.scale, softcap=self.softcap)
        out, _ = dcp_attention(q, kv.with_block_tables(batch.block_tables), batch.causal_bounds, ctx.pc, options,
                               batch.page_offsets, self.window)
        out = out.astype(x.dtype)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        out = out_projection(out, self.o_proj)
        return reduce_model(out), kv


def llama_mlp(cfg: ModelConfig, pc: ParallelConfig, dtype, index: int) -> nnx.Module:
    if index in cfg.sparse_layers:
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, dtype, pc, shared_intermediate=cfg.shared_expert_intermediate_size)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, pc, cfg.hidden_act)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE causal LM."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype=jnp.float32):
        super().__init__(cfg, pc, dtype, lambda i: DecoderLayer(
            cfg, dtype, LlamaAttention(cfg, pc, dtype, i), llama_mlp(cfg, pc, dtype, i)))


# -- the family: what config.json, the checkpoint and GGUF files say ----------------------
BIASED_QKV = ("Qwen2ForCausalLM",)  # q/k/v bias whatever config.json says
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # per-head q/k RMSNorm


def llama_config_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """What the architecture implies beyond the shared fields: Qwen2's bias, Qwen3's q/k norms."""
    fields: dict[str, Any] = {}
    if architecture in BIASED_QKV:
        fields["attention_bias"] = True
    if architecture in QK_NORM:
        fields["qk_norm"] = True
    return fields


def llama_checkpoint_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """GQA in `self_attn`, a dense MLP or routed experts (Qwen3-MoE) in `mlp`."""
    return decoder_rules(cfg, lambda i, ours, hf: (
        gqa_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg, pc)
        | dense_or_routed_rules(f"{ours}.mlp", f"{hf}.mlp", cfg, i)))


FAMILY = ModelFamily(
    name="Llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Qwen3MoeForCausalLM"),
    model_class=LlamaForCausalLM,
    checkpoint_rules=llama_checkpoint_rules,
    config_fields=llama_config_fields,
    gguf={  # llama.cpp's converter permutes Q/K rows for `llama` only
        "llama": GGUFArchitecture("LlamaForCausalLM", rope_theta=10000.0, permuted_qk=True),
        "qwen2": GGUFArchitecture("Qwen2ForCausalLM", rope_theta=1000000.0),
        "qwen3": GGUFArchitecture("Qwen3ForCausalLM", rope_theta=1000000.0),
    },
    tiny_models={
        "tiny-llama": ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=32768, eos_token_id=(BYTE_EOS,),
            rope=RopeConfig(theta=10000.0),
        ),
        "tiny-qwen3": ModelConfig(
            architecture="Qwen3ForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=16, qk_norm=True,
            max_position_embeddings=32768, eos_token_id=(BYTE_EOS,),
            rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True,
        ),
    },
)
