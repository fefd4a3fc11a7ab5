"""DeepSeek-V3 under DCP (Flax NNX): multi-head latent attention and grouped routing.

MLA decodes in absorbed form: the cache holds one latent per token (the
normalised compressed KV, kv_lora_rank wide, then the shared rotary key), which
counts as a single KV head, so DCP splits it by token over "dcp" and nothing by
head. Each device absorbs its query heads' W_UK into the query, attends over the
latent with V = the latent's first kv_lora_rank features, and expands its heads'
output with W_UV. YaRN's mscale enters the softmax scale. Experts: sigmoid
scores plus a correction bias choose the top groups, then the top experts inside
them; weights are renormalised and scaled; shared experts are a dense MLP.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.kernels import KVPools
from dcpjax.models.base import CausalLM, DecoderLayer, StepBatch, StepContext
from dcpjax.models.component_rules import decoder_rules, dense_or_routed_rules, mla_attention_rules, mlp_rules
from dcpjax.models.config import BYTE_EOS, BYTE_VOCAB, ModelConfig, RopeConfig
from dcpjax.models.family import ModelFamily
from dcpjax.models.layers import GatedMLP, RMSNorm, expert_axes, linear, out_projection, param, routed_experts
from dcpjax.models.rope import apply_rope_pairs, rope_frequencies
from dcpjax.models.weight_rules import Rule, same
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.local_ops import dcp_attention
from dcpjax.sharding.mesh import reduce_model


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek defines it)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        nope, rope, lora, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a = param((hidden, cfg.q_lora_rank), ("embed", None), dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, axis=None)
            self.q_b = param((cfg.q_lora_rank, heads, nope + rope), (None, "q_heads", "head_dim"), dtype)
        else:
            self.q_proj = param((hidden, heads, nope + rope), ("embed", "q_heads", "head_dim"), dtype)
        self.kv_a = param((hidden, lora + rope), ("embed", None), dtype)
        self.kv_a_norm = RMSNorm(lora, cfg.rms_norm_eps, dtype, axis=None)
        self.w_uk = param((heads, nope, lora), ("q_heads", "head_dim", None), dtype)  # absorbed into q
        self.w_uv = param((heads, v, lora), ("q_heads", "head_dim", None), dtype)  # expands the output
        self.o_proj = param((heads, v, hidden), ("q_heads", "head_dim", "embed"), dtype)
        inv_freq, self.rope_factor = rope_frequencies(cfg.rope, rope)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.sm_scale = mla_softmax_scale(cfg)
        self.nope, self.lora, self.interleave = nope, lora, cfg.rope_interleave
        self.q_lora = bool(cfg.q_lora_rank)

    def _rope(self, x, positions):
        return apply_rope_pairs(x, positions, self.inv_freq, self.rope_factor, self.interleave)

    def __call__(self, x, batch: StepBatch, kv: KVPools, ctx: StepContext):
        """x [B, T, hidden]; kv: this rank's latent pool [1, blocks, block_size, lora + rope] (v None).

        Returns the attention output [B, T, hidden] (replicated) and the updated kv.
        """
        out, kv, _ = self.forward(x, batch, kv, ctx)
        return out, kv

    def forward(self, x, batch: StepBatch, kv: KVPools, ctx: StepContext, selection=None):
        """`__call__`, handing a sparse layer's selection of positions in and out (`attend`): the
        output [B, T, hidden], kv and the selection this layer attended with (None when dense)."""
        positions = batch.positions
        q_resid = self.q_a_norm(linear(x, self.q_a)) if self.q_lora else None
        if self.q_lora:
            q = linear(q_resid, self.q_b)
        else:
            q = linear(x, self.q_proj)
        q_nope, q_rope = q[..., : self.nope], self._rope(q[..., self.nope :], positions)
        compressed = linear(x, self.kv_a)  # [B, T, lora + rope]
        latent = jnp.concatenate(
            [self.kv_a_norm(compressed[..., : self.lora]),
             self._rope(compressed[..., None, self.lora :], positions)[:, :, 0]],
            axis=-1,
        )  # [B, T, lora + rope]

        tokens = latent.shape[0] * latent.shape[1]
        new = jnp.broadcast_to(latent.reshape(tokens, 1, -1), (tokens, kv.kv_heads, latent.shape[-1]))
        kv = kv.write(new, None, batch.slots)

        q_absorbed = jnp.concatenate([jnp.einsum("bthn,hnc->bthc", q_nope, self.w_uk[...]), q_rope], axis=-1)
        options = dataclasses.replace(ctx.attention, sm_scale=self.sm_scale)
        out_latent, kv, selection = self.attend(q_absorbed, x, q_resid, batch, kv, ctx.pc, options, selection)
        out = jnp.einsum("bthc,hvc->bthv", out_latent.astype(x.dtype), self.w_uv[...])
        out = out_projection(out, self.o_proj)
        return reduce_model(out), kv, selection

    def attend(self, q_absorbed, x, q_resid, batch: StepBatch, kv: KVPools, pc: ParallelConfig, options,
               selection=None):
        """Attention over the latent: q_absorbed [B, T, heads / TP, lora + rope] -> [B, T, heads / TP, lora]
        float32, the cache and the selection (None). Dense here; sparse attention (`models.dsa`) selects
        positions first (x [B, T, hidden] and q_resid [B, T, q_lora_rank] feed its indexer)."""
        out, _ = dcp_attention(q_absorbed, kv.with_block_tables(batch.block_tables), batch.causal_bounds, pc, options,
                               batch.page_offsets)
        return out, kv, None


class GroupedTopKMoE(nnx.Module):
    """DeepSeek-V3 experts: routed (grouped top-k of sigmoid scores) + shared."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        hidden, experts, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = param((hidden, experts), ("embed", None), jnp.float32)
        self.correction_bias = param((experts,), (None,), jnp.float32, init="zeros")
        self.gate = param((experts, hidden, inter), expert_axes(pc), dtype, pc=pc)
        self.up = param((experts, hidden, inter), expert_axes(pc), dtype, pc=pc)
        self.down = param((experts, inter, hidden), expert_axes(pc, down=True), dtype, pc=pc)
        self.expert_parallel = pc.enable_expert_parallel
        self.shared = GatedMLP(hidden, inter * cfg.n_shared_experts, dtype, pc) if cfg.n_shared_experts else None
        self.top_k, self.groups, self.top_groups = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def route(self, x):
        """x [N, hidden] -> (weights [N, k] float32, experts [N, k])."""
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router[...])
        choice = scores + self.correction_bias[...]
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, self.groups, experts // self.groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # best two per group
        _, top_groups = jax.lax.top_k(group_scores, self.top_groups)
        group_mask = jnp.zeros((tokens, self.groups), bool).at[jnp.arange(tokens)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(group_mask, experts // self.groups, axis=1), choice, -jnp.inf)
        _, chosen = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, chosen, axis=1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.scaling, chosen

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        routed = routed_experts(flat, chosen, weights, self.gate[...], self.up[...], self.down[...],
                                self.expert_parallel)
        out = reduce_model(routed).reshape(x.shape)
        return out if self.shared is None else out + self.shared(x)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / Kimi K2 causal LM (dense first layers, MLA, routed + shared experts)."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype=jnp.float32):
        def mlp(i):
            if i in cfg.sparse_layers:
                return GroupedTopKMoE(cfg, pc, dtype)
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, pc)

        make = lambda i: self.layer_class(cfg, dtype, self.make_attention(cfg, pc, dtype, i), mlp(i))
        super().__init__(cfg, pc, dtype, make)

    def make_attention(self, cfg: ModelConfig, pc: ParallelConfig, dtype, layer: int) -> MLAttention:
        """Layer `layer`'s attention (DeepSeek-V3.2: MLA with sparse attention, `models.dsa`)."""
        return MLAttention(cfg, pc, dtype)


# -- the family: what config.json and the checkpoint say ----------------------------------
def deepseek_config_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """MLA's ranks and head dims (the latent counts as one KV head) and the grouped routing; only
    DeepSeek-V3's routing (sigmoid scores, noaux_tc) is implemented."""
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("only DeepSeek-V3's routing (scoring_func sigmoid, topk_method noaux_tc) is supported")
    return dict(
        q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], rope_interleave=bool(config.get("rope_interleave", True)),
        n_shared_experts=config.get("n_shared_experts") or 0,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
        head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"], num_key_value_heads=1,
    )


def deepseek_checkpoint_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """MLA in `self_attn`; routed layers add the routing bias and the shared experts."""

    def layer(i: int, ours: str, hf: str) -> dict[str, Rule]:
        rules = mla_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg)
        rules |= dense_or_routed_rules(f"{ours}.mlp", f"{hf}.mlp", cfg, i)
        if i in cfg.sparse_layers:
            rules[f"{ours}.mlp.correction_bias"] = same(f"{hf}.mlp.gate.e_score_correction_bias", (cfg.num_experts,))
            if cfg.n_shared_experts:
                rules |= mlp_rules(f"{ours}.mlp.shared", f"{hf}.mlp.shared_experts", cfg.hidden_size,
                                   cfg.moe_intermediate_size * cfg.n_shared_experts)
        return rules

    return decoder_rules(cfg, layer)


FAMILY = ModelFamily(
    name="DeepSeek-V3",
    architectures=("DeepseekV3ForCausalLM",),
    model_class=DeepseekV3ForCausalLM,
    checkpoint_rules=deepseek_checkpoint_rules,
    config_fields=deepseek_config_fields,
    tiny_models={
        # MLA + grouped routing with a shared expert: DCP up to TP (the latent counts as one KV head)
        "tiny-deepseek": ModelConfig(
            architecture="DeepseekV3ForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=24,
            max_position_embeddings=32768, eos_token_id=(BYTE_EOS,),
            rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
                            mscale=1.0, mscale_all_dim=1.0),
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_interleave=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, sparse_layers=(1,), n_shared_experts=1, routed_scaling_factor=2.5, n_group=4,
            topk_group=2,
        ),
    },
)
