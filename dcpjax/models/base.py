"""The decoder-only skeleton every model family shares (Flax NNX).

A family supplies its attention module and its MLP per layer; embedding,
pre-norm residual layers, final norm and the vocab-parallel LM head are common.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.kernels import AttentionOptions, KVPools
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.models.layers import LMHead, RMSNorm, VocabEmbedding, gather_vocab
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.local_ops import owned_slots


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static facts of one compiled step, shared by every layer.

    attention: backend and the mesh's platform; each attention layer sets its own scale.
    """

    pc: ParallelConfig
    attention: AttentionOptions = dataclasses.field(default_factory=AttentionOptions)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "positions", "valid", "sample_index", "block_tables", "seq_slots", "page_offsets",
                 "slots"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's rows, from the runner through the model to attention (replicated arrays).

    tokens, positions, valid: [B, T] (padding has valid False); positions are each token's
    position in its own sequence. sample_index: [R], the flat indices (b * T + t) of the tokens
    whose next-token logits are wanted. block_tables: [G, B, P], one table per KV cache group
    (`models.kv_groups`), shared by all DCP ranks; a layer sees its group's (`for_group`).
    seq_slots: [B, T], the engine slot of each token's sequence (num_slots for padding): where
    a linear-attention layer keeps that sequence's state.
    page_offsets: None, or [B, T] for packed rows (several sequences' chunks in one row, their
    block tables back to back in the row's): where each token's sequence's blocks begin.
    slots: [G, B * T], where this DCP rank stores each token in each group's blocks (`PAD_SLOT` if
    it does not own it): computed once per step inside `shard_map` (`on_rank`), not once per layer;
    [B * T] in a group's view.
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    sample_index: jax.Array
    block_tables: jax.Array
    seq_slots: jax.Array
    page_offsets: jax.Array | None = None
    slots: jax.Array | None = None

    @property
    def packed(self) -> bool:
        """One row holds several sequences' chunks (a packed prefill call), not one sequence a row."""
        return self.page_offsets is not None

    @property
    def causal_bounds(self) -> jax.Array:
        """[B, T] attention bounds: the token at position p sees positions 0..p; padding nothing."""
        return jnp.where(self.valid, self.positions + 1, 0)

    def on_rank(self, block_size: int, pc: ParallelConfig) -> StepBatch:
        """This DCP rank's slots for the step's tokens in every group's blocks (inside shard_map)."""
        slots = jnp.stack([owned_slots(self.positions, table, block_size, pc, valid=self.valid,
                                       page_offsets=self.page_offsets).reshape(-1) for table in self.block_tables])
        return dataclasses.replace(self, slots=slots)

    def for_group(self, group: int) -> StepBatch:
        """The batch as a layer of KV cache group `group` sees it: block_tables [B, P], slots [B * T]."""
        return dataclasses.replace(self, block_tables=self.block_tables[group], slots=self.slots[group])


class DecoderLayer(nnx.Module):
    """x + attention(norm(x)), then + mlp(norm(x)). With `cfg.sandwich_norms` (Gemma) the
    attention's and the MLP's outputs are normed too before they join the residual:
    x + norm(attention(norm(x))), then + norm(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, dtype, attention: nnx.Module, mlp: nnx.Module):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=cfg.norm_offset)
        self.input_norm = norm()
        self.attention = attention  # or another token mixer with the same call (linear attention)
        # Llama's pre-MLP norm (Hugging Face's "post_attention_layernorm"); with sandwich norms the
        # norm of the attention's output (the same Hugging Face name), and two more around the MLP
        self.post_attention_norm = norm()
        self.pre_feedforward_norm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_norm = norm() if cfg.sandwich_norms else None
        self.mlp = mlp

    def __call__(self, x, batch: StepBatch, kv, ctx: StepContext):
        """kv: the layer's cache (`KVPools`, or a linear-attention layer's `LinearState`)."""
        attended, kv = self.attention(self.input_norm(x), batch, kv, ctx)
        if self.pre_feedforward_norm is not None:
            x = x + self.post_attention_norm(attended)
            return x + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(x))), kv
        x = x + attended
        return x + self.mlp(self.post_attention_norm(x)), kv


class CausalLM(nnx.Module):
    """Embedding, layers, final norm, LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype, make_layer: Callable[[int], DecoderLayer]):
        vocab = cfg.vocab_size  # padded for the mesh by the parameters (PADDABLE_AXES)
        self.embed = VocabEmbedding(vocab, cfg.hidden_size, dtype, pc)
        self.layers = nnx.List([make_layer(i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=cfg.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, vocab, dtype, pc)
        self.vocab_size = cfg.vocab_size
        self.embed_scale, self.final_softcap = cfg.embed_scale, cfg.final_logit_softcapping
        groups = KVCacheGroups.of(cfg)  # which cache and which block tables each layer uses
        self.layer_cache = groups.cache_index
        self.layer_group = tuple(groups.group_of.get(i, 0) for i in range(cfg.num_hidden_layers))

    def __call__(self, batch: StepBatch, kv_caches: tuple[KVPools, ...], ctx: StepContext,
                 all_positions: bool = False):
        """One chunk of T tokens per sequence.

        Args:
          batch: the step's rows (`StepBatch`).
          kv_caches: this rank's caches, one per owner layer (`models.kv_groups.KVCacheGroups.owners`:
            per layer without sliding-window layers): `KVPools` pools [kv_heads_local, num_blocks,
            block_size, d], heads first (MLA: one latent pool, kv_heads_local 1, v None); fp8 scales
            [kv_heads_local, num_blocks, block_size] or None; the step's block tables come with the batch.
            A linear-attention layer's is its `LinearState` (per slot).
          all_positions: logits at every position (prompt logprobs, drafts), not only at sample_index.
        Returns:
          logits [R, vocab] (or [B, T, vocab] with all_positions) float32 (replicated) and the
          updated kv_caches.
        """
        batch = batch.on_rank(next(c.block_size for c in kv_caches if isinstance(c, KVPools)), ctx.pc)
        x = self.embed(batch.tokens)
        if self.embed_scale != 1.0:  # Gemma: times sqrt(hidden), rounded to the weights' dtype first
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        x, caches = self.run_layers(x, batch, list(kv_caches), ctx)
        if not all_positions:
            x = x.reshape(-1, x.shape[-1])[batch.sample_index]  # [R, hidden]
        last = self.norm(x)
        local = self.embed.attend(last) if self.lm_head is None else self.lm_head(last)
        logits = gather_vocab(local, self.vocab_size)
        if self.final_softcap:  # Gemma 2 / 3: logits squashed into (-cap, cap), in float32
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)
        return logits, tuple(caches)

    def run_layers(self, x: jax.Array, batch: StepBatch, caches: list, ctx: StepContext) -> tuple[jax.Array, list]:
        """The decoder layers in order, each on its cache and its group's tables: x [B, T, hidden]."""
        for i, layer in enumerate(self.layers):
            c = self.layer_cache[i]
            x, caches[c] = layer(x, batch.for_group(self.layer_group[i]), caches[c], ctx)
        return x, caches
