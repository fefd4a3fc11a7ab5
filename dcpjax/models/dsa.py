"""DeepSeek-V3.2 under DCP (Flax NNX): MLA over the top-k positions a lightning indexer picks (DSA).

Each layer's indexer projects the query's q_lora residual to `index_n_heads` queries and the
hidden state to one key per token (LayerNorm, then RoPE on its first `qk_rope_head_dim` dims:
half-split in V3.2, interleaved in GLM-5), scores every visible position
sum_h w_h * H^-0.5 * relu(q_h . k * d^-0.5) in float32, and the MLA query attends only to the
`index_topk` best (`dcpjax.sharding.sparse`: an exact global top-k over DCP ranks, then the LSE
merge). The keys live beside the latent in the same blocks (`KVPools.index_k`), split by DCP like
it. The indexer's weights are replicated: every rank scores all its heads over its own positions,
so the selection needs no reduction over "tp" (context-long score rows would cost more to sum than
the small projections cost to hold).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from dcpjax.kernels import KVPools
from dcpjax.models.base import DecoderLayer, StepBatch, StepContext
from dcpjax.models.config import ModelConfig
from dcpjax.models.deepseek import FAMILY as DEEPSEEK_FAMILY
from dcpjax.models.deepseek import DeepseekV3ForCausalLM, MLAttention, deepseek_checkpoint_rules, deepseek_config_fields
from dcpjax.models.family import ModelFamily
from dcpjax.models.layers import LayerNorm, linear, param
from dcpjax.models.rope import apply_rope_pairs
from dcpjax.models.weight_rules import Rule, head_rows, same, transposed
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.sparse import Selection, dcp_attend_selected, dcp_top_k, is_dense

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (DeepSeek's reference and transformers)


class Indexer(nnx.Module):
    """The lightning indexer of one layer: its queries, head weights and keys."""

    def __init__(self, cfg: ModelConfig, dtype, inv_freq: tuple[float, ...], rope_factor: float):
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = param((cfg.q_lora_rank, heads, dim), (None, None, None), dtype)
        self.wk = param((cfg.hidden_size, dim), ("embed", None), dtype)
        self.k_norm = LayerNorm(dim, INDEX_NORM_EPS, dtype)
        self.weights_proj = param((cfg.hidden_size, heads), ("embed", None), jnp.float32)  # float32 as shipped
        self.rope_dim, self.interleave = cfg.qk_rope_head_dim, cfg.index_rope_interleave
        self.inv_freq, self.rope_factor = inv_freq, rope_factor
        self.weight_scale, self.score_scale = heads**-0.5, dim**-0.5

    def _rope(self, x, positions):
        """RoPE on the first rope_dim dims of x [B, T, heads, dim]; the rest pass."""
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        rot = apply_rope_pairs(rot, positions, self.inv_freq, self.rope_factor, self.interleave)  # GLM-5: pairs
        return jnp.concatenate([rot, rest], axis=-1)

    def keys(self, x, positions):
        """x [B, T, hidden] -> one key per token [B, T, index_dim]."""
        return self._rope(self.k_norm(linear(x, self.wk))[:, :, None], positions)[:, :, 0]

    def queries(self, x, q_resid, positions):
        """-> queries [B, T, index_heads, index_dim] and head weights [B, T, index_heads] float32."""
        q = self._rope(linear(q_resid, self.wq_b), positions)
        weights = x.astype(jnp.float32) @ self.weights_proj[...] * self.weight_scale
        return q, weights


class SparseMLAttention(MLAttention):
    """DeepSeek-V3.2's attention: MLA whose queries attend to the indexer's top-k positions. With
    `shared` (GLM-5's "shared" indexer layers) it has no indexer and attends with the previous layer's
    selection."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype, shared: bool = False):
        if not cfg.q_lora_rank:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank: its indexer reads the query's lora residual")
        super().__init__(cfg, pc, dtype)
        self.indexer = None if shared else Indexer(cfg, dtype, self.inv_freq, self.rope_factor)
        self.top_k = cfg.index_topk

    def attend(self, q_absorbed, x, q_resid, batch: StepBatch, kv: KVPools, pc: ParallelConfig, options,
               selection: Selection | None = None):
        """Store this step's indexer keys and select each query's top-k positions (or take the previous
        layer's `selection` when shared), then attend over them (`MLAttention.attend`)."""
        if self.indexer is not None:  # the keys go in even when this call is dense: longer steps score them
            keys = self.indexer.keys(x, batch.positions)
            kv = kv.write_index(keys.reshape(-1, keys.shape[-1]), batch.slots)
        cache = kv.with_block_tables(batch.block_tables)
        if is_dense(cache, pc, self.top_k):
            return super().attend(q_absorbed, x, q_resid, batch, kv, pc, options)
        if self.indexer is not None:
            index_q, weights = self.indexer.queries(x, q_resid, batch.positions)
            selection = dcp_top_k(index_q, weights, cache.index_keys, batch.causal_bounds, pc, self.top_k,
                                  self.indexer.score_scale, batch.page_offsets)
        elif selection is None:
            raise ValueError("a shared sparse-attention layer needs an earlier layer's selection (indexer_types "
                             "must start with 'full')")
        out, _ = dcp_attend_selected(q_absorbed, cache, selection, pc, options)
        return out, kv, selection


class SelectionSharingLayer(DecoderLayer):
    """A decoder layer that hands its attention's selection of positions to the next (GLM-5's "shared"
    indexer layers attend with the previous layer's). DeepSeek's pre-norm residual layer: no sandwich
    norms (Gemma's), which no sparse-attention model has."""

    def __call__(self, x, batch: StepBatch, kv, ctx: StepContext, selection: Selection | None = None):
        attended, kv, selection = self.attention.forward(self.input_norm(x), batch, kv, ctx, selection)
        x = x + attended
        return x + self.mlp(self.post_attention_norm(x)), kv, selection


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 and GLM-5: DeepSeek-V3 with sparse attention (DSA) in every layer; GLM-5's
    `index_shared_layers` reuse the previous layer's top-k instead of running an indexer."""

    layer_class = SelectionSharingLayer

    def make_attention(self, cfg: ModelConfig, pc: ParallelConfig, dtype, layer: int) -> SparseMLAttention:
        return SparseMLAttention(cfg, pc, dtype, shared=layer in cfg.index_shared_layers)

    def run_layers(self, x, batch: StepBatch, caches: list, ctx: StepContext):
        selection = None  # every layer of a step reads the same tables, so a selection serves the next
        for i, layer in enumerate(self.layers):
            c = self.layer_cache[i]
            x, caches[c], selection = layer(x, batch.for_group(self.layer_group[i]), caches[c], ctx, selection)
        return x, caches


# -- the family: what config.json and the checkpoint say ----------------------------------
def dsa_config_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's fields and the indexer's: its heads, their width and the top-k."""
    fields = deepseek_config_fields(architecture, config)
    topk, heads, dim = config.get("index_topk"), config.get("index_n_heads"), config.get("index_head_dim")
    if not all(isinstance(x, int) and x > 0 for x in (topk, heads, dim)):
        raise ValueError(f"{architecture} needs positive index_topk, index_n_heads and index_head_dim in config.json, "
                         f"got {topk!r}, {heads!r}, {dim!r}")
    if not config.get("q_lora_rank"):
        raise ValueError(f"{architecture} needs q_lora_rank: the indexer reads the query's lora residual")
    if dim < config["qk_rope_head_dim"]:
        raise ValueError(f"index_head_dim ({dim}) must hold the qk_rope_head_dim ({config['qk_rope_head_dim']}) "
                         "rotary dims")
    glm = architecture == GLM5
    return fields | dict(index_topk=topk, index_n_heads=heads, index_head_dim=dim, index_rope_interleave=glm,
                         rope_interleave=fields["rope_interleave"] or glm,
                         index_shared_layers=_shared_indexer_layers(config) if glm else ())


GLM5 = "GlmMoeDsaForCausalLM"  # its indexer's RoPE is interleaved (V3.2's rotates halves), as its MLA's always is


def _shared_indexer_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """GLM-5's layers that reuse the previous layer's top-k: `indexer_types` ("full" / "shared"), else
    `index_topk_pattern` ("FSSF..."), else every `index_topk_freq`-th layer from `index_skip_topk_offset`
    runs its indexer (transformers' GlmMoeDsaConfig rule; the default: all of them)."""
    layers = config["num_hidden_layers"]
    types = config.get("indexer_types")
    if types is None and (pattern := config.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(config.get("index_topk_freq", 1), 1), config.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise ValueError(f"indexer_types must name each of the {layers} layers 'full' or 'shared', the first "
                         f"'full', got {list(types)}")
    return tuple(i for i, kind in enumerate(types) if kind == "shared")


def dsa_checkpoint_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """DeepSeek-V3's rules and each layer's indexer (`self_attn.indexer`), read whole (replicated); GLM-5's
    shared layers have none."""
    rules = deepseek_checkpoint_rules(cfg, pc)
    heads, dim, e = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    for i in sorted(set(range(cfg.num_hidden_layers)) - set(cfg.index_shared_layers)):
        ours, hf = f"layers.{i}.attention.indexer", f"model.layers.{i}.self_attn.indexer"
        rules |= {
            f"{ours}.wq_b": head_rows(f"{hf}.wq_b.weight", heads, dim, 1, cfg.q_lora_rank),
            f"{ours}.wk": transposed(f"{hf}.wk.weight", (dim, e)),
            f"{ours}.k_norm.weight": same(f"{hf}.k_norm.weight", (dim,)),
            f"{ours}.k_norm.bias": same(f"{hf}.k_norm.bias", (dim,)),
            f"{ours}.weights_proj": transposed(f"{hf}.weights_proj.weight", (heads, e)),
        }
    return rules


FAMILY = ModelFamily(
    name="DeepSeek-V3.2 and GLM-5",
    architectures=("DeepseekV32ForCausalLM", GLM5),
    model_class=DeepseekV32ForCausalLM,
    checkpoint_rules=dsa_checkpoint_rules,
    config_fields=dsa_config_fields,
    tiny_models={
        # DeepSeek-V3's tiny model with an indexer of 4 heads of 16 and a top-k of 16 (prompts longer select)
        "tiny-deepseek-v32": dataclasses.replace(
            DEEPSEEK_FAMILY.tiny_models["tiny-deepseek"], architecture="DeepseekV32ForCausalLM", index_topk=16,
            index_n_heads=4, index_head_dim=16),
    },
)
