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

import jax.numpy as jnp
from flax import nnx

from dcpjax.config import ParallelConfig
from dcpjax.kernels import KVPools
from dcpjax.models.base import CausalLM, DecoderLayer, StepBatch, StepContext
from dcpjax.models.config import ModelConfig
from dcpjax.models.layers import GatedMLP, RMSNorm, SparseMoE, out_projection, param
from dcpjax.models.rope import apply_rope, rope_frequencies
from dcpjax.sharding.local_ops import dcp_attention
from dcpjax.sharding.mesh import kv_head_slots, reduce_model


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        heads, slots, d, hidden = cfg.num_attention_heads, kv_head_slots(cfg.num_key_value_heads, pc), cfg.head_dim, cfg.hidden_size
        self.q_proj = param((hidden, heads, d), ("embed", "q_heads", "head_dim"), dtype)
        self.k_proj = param((hidden, slots, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_proj = param((hidden, slots, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.o_proj = param((heads, d, hidden), ("q_heads", "head_dim", "embed"), dtype)
        if cfg.attention_bias:
            self.q_bias = param((heads, d), ("q_heads", "head_dim"), dtype, init="zeros")
            self.k_bias = param((slots, d), ("kv_heads", "head_dim"), dtype, init="zeros")
            self.v_bias = param((slots, d), ("kv_heads", "head_dim"), dtype, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, axis="head_dim")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, axis="head_dim")
        inv_freq, self.rope_factor = rope_frequencies(cfg.rope, d)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: plain floats, not a Variable
        self.has_bias, self.has_qk_norm, self.head_dim = cfg.attention_bias, cfg.qk_norm, d

    def __call__(self, x, batch: StepBatch, kv: KVPools, ctx: StepContext):
        """x [B, T, hidden]; kv: this rank's K/V pools [kv_heads_local, blocks, block_size, head_dim].

        Returns the attention output [B, T, hidden] (replicated) and the updated kv.
        """
        positions = batch.positions
        q = jnp.einsum("bte,ehd->bthd", x, self.q_proj[...])
        k = jnp.einsum("bte,ehd->bthd", x, self.k_proj[...])
        v = jnp.einsum("bte,ehd->bthd", x, self.v_proj[...])
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq, self.rope_factor)
        k = apply_rope(k, positions, self.inv_freq, self.rope_factor)

        flat = lambda a: a.reshape(-1, *a.shape[2:])  # [B, T, H, d] -> [B * T, H, d]
        kv = kv.write(flat(k), flat(v), batch.slots)
        options = dataclasses.replace(ctx.attention, sm_scale=self.head_dim**-0.5)
        out, _ = dcp_attention(q, kv.with_block_tables(batch.block_tables), batch.causal_bounds, ctx.pc, options,
                               batch.page_offsets)
        out = out_projection(out.astype(x.dtype), self.o_proj[...])
        return reduce_model(out), kv


def llama_mlp(cfg: ModelConfig, pc: ParallelConfig, dtype, index: int) -> nnx.Module:
    if index in cfg.sparse_layers:
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, dtype, pc)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, pc)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE causal LM."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype=jnp.float32):
        super().__init__(cfg, pc, dtype, lambda i: DecoderLayer(
            cfg, dtype, LlamaAttention(cfg, pc, dtype), llama_mlp(cfg, pc, dtype, i)))
