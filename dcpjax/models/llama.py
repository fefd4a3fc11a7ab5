"""Llama-family decoders under DCP: Llama, Mistral, Qwen2, Qwen3 (Flax NNX).

GQA with RoPE, RMSNorm, SwiGLU; Qwen2's q/k/v bias and Qwen3's per-head q/k
RMSNorm; tied embeddings. Runs inside `shard_map` (see `dcpjax.runner`): query
heads, FFW and vocab split over all TP devices, KV heads over "tp", KV tokens
over "dcp". One forward handles a chunk of T tokens per sequence (prefill
chunks and decode alike): each token's K/V is written on the DCP rank that
owns its position, then every query attends to the distributed cache with its
own causal bound and the exact LSE merge.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.config import ParallelConfig
from dcpjax.models.config import ModelConfig
from dcpjax.models.layers import GatedMLP, LMHead, RMSNorm, VocabEmbedding, gather_vocab, param
from dcpjax.models.rope import apply_rope, rope_frequencies
from dcpjax.sharding.local_ops import dcp_attention, owned_slots, write_tokens
from dcpjax.sharding.mesh import MODEL_AXES


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static facts of one compiled step, shared by every layer."""

    pc: ParallelConfig
    block_size: int
    attention_backend: str = "auto"


def kv_head_slots(num_kv_heads: int, pc: ParallelConfig) -> int:
    """KV heads as stored: repeated when the "tp" axis has more groups than heads."""
    return max(num_kv_heads, pc.kv_head_groups)


def padded_vocab(vocab_size: int, pc: ParallelConfig) -> int:
    return -(-vocab_size // pc.tp) * pc.tp


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

    def __call__(self, x, positions, valid, kv, block_tables, ctx: StepContext):
        """x [B, T, hidden]; positions, valid [B, T]; kv = (k_pool, v_pool) this rank's pages.

        Returns the attention output [B, T, hidden] (replicated) and the updated kv.
        """
        q = jnp.einsum("bte,ehd->bthd", x, self.q_proj[...])
        k = jnp.einsum("bte,ehd->bthd", x, self.k_proj[...])
        v = jnp.einsum("bte,ehd->bthd", x, self.v_proj[...])
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq, self.rope_factor)
        k = apply_rope(k, positions, self.inv_freq, self.rope_factor)

        k_pool, v_pool = kv
        batch, chunk = positions.shape
        slots = owned_slots(positions, ctx.pc, block_tables=block_tables, block_size=ctx.block_size, valid=valid)
        slots = slots.reshape(-1)
        k_pool = write_tokens(k_pool, k.reshape(batch * chunk, *k.shape[2:]), slots, paged=True)
        v_pool = write_tokens(v_pool, v.reshape(batch * chunk, *v.shape[2:]), slots, paged=True)

        lengths = jnp.where(valid, positions + 1, 0)  # causal: position p sees 0..p
        out, _ = dcp_attention(
            q, k_pool, v_pool, lengths, ctx.pc, block_tables=block_tables,
            sm_scale=self.head_dim**-0.5, attention_backend=ctx.attention_backend,
        )
        out = jnp.einsum("bthd,hde->bte", out.astype(x.dtype), self.o_proj[...])
        return jax.lax.psum(out, MODEL_AXES), (k_pool, v_pool)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = LlamaAttention(cfg, pc, dtype)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def __call__(self, x, positions, valid, kv, block_tables, ctx: StepContext):
        attended, kv = self.attention(self.input_norm(x), positions, valid, kv, block_tables, ctx)
        x = x + attended
        return x + self.mlp(self.post_attention_norm(x)), kv


class LlamaForCausalLM(nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype=jnp.float32):
        vocab = padded_vocab(cfg.vocab_size, pc)
        self.embed = VocabEmbedding(vocab, cfg.hidden_size, dtype)
        self.layers = nnx.List([LlamaDecoderLayer(cfg, pc, dtype) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, vocab, dtype)
        self.vocab_size = cfg.vocab_size

    def __call__(self, tokens, positions, valid, last_index, kv_caches, block_tables, ctx: StepContext):
        """One chunk of T tokens per sequence.

        Args:
          tokens, positions, valid: [B, T] (padding has valid False).
          last_index: [B] the chunk index whose next-token logits are wanted.
          kv_caches: per layer (k_pool, v_pool), this rank's [num_blocks, bs, kv_local, d].
          block_tables: [B, P] shared by all ranks.
        Returns:
          logits [B, vocab] float32 (replicated) and the updated kv_caches.
        """
        x = self.embed(tokens)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, positions, valid, kv, block_tables, ctx)
            new_caches.append(kv)
        last = jnp.take_along_axis(x, last_index[:, None, None], axis=1)[:, 0]  # [B, hidden]
        last = self.norm(last)
        local = self.embed.attend(last) if self.lm_head is None else self.lm_head(last)
        return gather_vocab(local, self.vocab_size), tuple(new_caches)
