"""The decoder-only skeleton every model family shares (Flax NNX).

A family supplies its attention module and its MLP per layer; embedding,
pre-norm residual layers, final norm and the vocab-parallel LM head are common.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from dcpjax.config import ParallelConfig
from dcpjax.models.config import ModelConfig
from dcpjax.models.layers import LMHead, RMSNorm, VocabEmbedding, gather_vocab


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static facts of one compiled step, shared by every layer."""

    pc: ParallelConfig
    block_size: int
    attention_backend: str = "auto"
    platform: str = "cpu"  # of the mesh's devices: picks the attention kernel


def kv_head_slots(num_kv_heads: int, pc: ParallelConfig) -> int:
    """KV heads as stored: repeated when the "tp" axis has more groups than heads (MLA: 1 head)."""
    return max(num_kv_heads, pc.kv_head_groups)


def padded_vocab(vocab_size: int, pc: ParallelConfig) -> int:
    """Vocabulary rows rounded up so every TP device holds the same number."""
    return -(-vocab_size // pc.tp) * pc.tp


class DecoderLayer(nnx.Module):
    """x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, dtype, attention: nnx.Module, mlp: nnx.Module):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = attention
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def __call__(self, x, positions, valid, kv, block_tables, ctx: StepContext):
        attended, kv = self.attention(self.input_norm(x), positions, valid, kv, block_tables, ctx)
        x = x + attended
        return x + self.mlp(self.post_attention_norm(x)), kv


class CausalLM(nnx.Module):
    """Embedding, layers, final norm, LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype, make_layer: Callable[[int], DecoderLayer]):
        vocab = padded_vocab(cfg.vocab_size, pc)
        self.embed = VocabEmbedding(vocab, cfg.hidden_size, dtype)
        self.layers = nnx.List([make_layer(i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, vocab, dtype)
        self.vocab_size = cfg.vocab_size

    def __call__(self, tokens, positions, valid, last_index, kv_caches, block_tables, ctx: StepContext):
        """One chunk of T tokens per sequence.

        Args:
          tokens, positions, valid: [B, T] (padding has valid False).
          last_index: [B] the chunk index whose next-token logits are wanted.
          kv_caches: per layer, a tuple of this rank's KV pools ((k, v) for GQA, (latent,) for
            MLA), each (pages [num_blocks, bs, kv_local, d], fp8 scales [num_blocks, bs, kv_local]
            or None).
          block_tables: [B, P] shared by all ranks.
        Returns:
          logits [B, vocab] float32 (replicated) and the updated kv_caches.
        """
        x = self.embed(tokens)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, positions, valid, kv, block_tables, ctx)
            new_caches.append(kv)
        last = self.norm(jnp.take_along_axis(x, last_index[:, None, None], axis=1)[:, 0])  # [B, hidden]
        local = self.embed.attend(last) if self.lm_head is None else self.lm_head(last)
        return gather_vocab(local, self.vocab_size), tuple(new_caches)
