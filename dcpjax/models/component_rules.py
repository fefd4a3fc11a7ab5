"""The checkpoint rules of the parts families share: the decoder frame (embedding, norms, LM
head), GQA, MLA and linear (Gated DeltaNet) attention, dense MLPs and routed experts. A family's
`checkpoint_rules` (its `ModelFamily`) composes these under its own Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Callable

from dcpjax.models.config import ModelConfig
from dcpjax.models.weight_rules import (
    Rule,
    conv_channels,
    grouped_rows,
    head_rows,
    kv_b_part,
    output_heads,
    same,
    squeezed,
    stacked_experts,
    transposed,
)
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import kv_head_slots

# (layer index, dcpjax prefix "layers.i", checkpoint prefix "model.layers.i") -> that layer's mixer and MLP rules
LayerRules = Callable[[int, str, str], dict[str, Rule]]


def decoder_rules(cfg: ModelConfig, layer_rules: LayerRules) -> dict[str, Rule]:
    """dcpjax parameter path -> Rule for a whole decoder: the frame every family shares (embedding,
    final norm, LM head unless tied, each layer's two norms) and each layer's own from `layer_rules`."""
    e = cfg.hidden_size
    rules = {
        "embed.weight": same("model.embed_tokens.weight", (cfg.vocab_size, e)),
        "norm.weight": same("model.norm.weight", (e,)),
    }
    if not cfg.tie_word_embeddings:
        rules["lm_head.weight"] = transposed("lm_head.weight", (cfg.vocab_size, e))
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        rules |= {
            f"{ours}.input_norm.weight": same(f"{hf}.input_layernorm.weight", (e,)),
            f"{ours}.post_attention_norm.weight": same(f"{hf}.post_attention_layernorm.weight", (e,)),
        }
        rules |= layer_rules(i, ours, hf)
    return rules


def dense_or_routed_rules(ours: str, hf: str, cfg: ModelConfig, layer: int) -> dict[str, Rule]:
    """A layer's MLP: routed experts in `cfg.sparse_layers`, a dense SwiGLU MLP elsewhere."""
    if layer in cfg.sparse_layers:
        return expert_rules(ours, hf, cfg)
    return mlp_rules(ours, hf, cfg.hidden_size, cfg.intermediate_size)


def linear_attention_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    """Gated DeltaNet (Qwen3-Next): the fused in_proj_qkvz / in_proj_ba split by part, the conv by channel."""
    e, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, taps, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, nv // nk
    qkvz, ba, conv = f"{hf}.in_proj_qkvz.weight", f"{hf}.in_proj_ba.weight", f"{hf}.conv1d.weight"
    group, channels = 2 * dk + 2 * r * dv, 2 * nk * dk + nv * dv
    return {
        f"{ours}.q_proj": grouped_rows(qkvz, nk, group, 0, 1, dk, e),
        f"{ours}.k_proj": grouped_rows(qkvz, nk, group, dk, 1, dk, e),
        f"{ours}.v_proj": grouped_rows(qkvz, nk, group, 2 * dk, r, dv, e),
        f"{ours}.z_proj": grouped_rows(qkvz, nk, group, 2 * dk + r * dv, r, dv, e),
        f"{ours}.b_proj": squeezed(grouped_rows(ba, nk, 2 * r, 0, r, 1, e)),
        f"{ours}.a_proj": squeezed(grouped_rows(ba, nk, 2 * r, r, r, 1, e)),
        f"{ours}.conv_q": conv_channels(conv, channels, 0, nk, dk, taps),
        f"{ours}.conv_k": conv_channels(conv, channels, nk * dk, nk, dk, taps),
        f"{ours}.conv_v": conv_channels(conv, channels, 2 * nk * dk, nv, dv, taps),
        f"{ours}.dt_bias": same(f"{hf}.dt_bias", (nv,)),
        f"{ours}.a_log": same(f"{hf}.A_log", (nv,)),
        f"{ours}.norm.weight": same(f"{hf}.norm.weight", (dv,)),
        f"{ours}.out_proj": output_heads(f"{hf}.out_proj.weight", nv, dv, e),
    }


def mlp_rules(ours: str, hf: str, hidden: int, intermediate: int) -> dict[str, Rule]:
    return {
        f"{ours}.gate": transposed(f"{hf}.gate_proj.weight", (intermediate, hidden)),
        f"{ours}.up": transposed(f"{hf}.up_proj.weight", (intermediate, hidden)),
        f"{ours}.down": transposed(f"{hf}.down_proj.weight", (hidden, intermediate)),
    }


def expert_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    e, moe, experts = cfg.hidden_size, cfg.moe_intermediate_size, range(cfg.num_experts)
    names = lambda proj: [f"{hf}.experts.{x}.{proj}.weight" for x in experts]
    return {
        f"{ours}.router": transposed(f"{hf}.gate.weight", (cfg.num_experts, e)),
        f"{ours}.gate": stacked_experts(names("gate_proj"), (moe, e)),
        f"{ours}.up": stacked_experts(names("up_proj"), (moe, e)),
        f"{ours}.down": stacked_experts(names("down_proj"), (e, moe)),
    }


def gqa_attention_rules(ours: str, hf: str, cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    e, d, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    repeats = kv_head_slots(kv, pc) // kv
    q_width = 2 * d if cfg.attention_output_gate else d  # each head's query, then its output gate
    rules = {
        f"{ours}.q_proj": head_rows(f"{hf}.q_proj.weight", heads, q_width, 1, e),
        f"{ours}.k_proj": head_rows(f"{hf}.k_proj.weight", kv, d, repeats, e),
        f"{ours}.v_proj": head_rows(f"{hf}.v_proj.weight", kv, d, repeats, e),
        f"{ours}.o_proj": output_heads(f"{hf}.o_proj.weight", heads, d, e),
    }
    if cfg.attention_bias:
        rules |= {
            f"{ours}.q_bias": head_rows(f"{hf}.q_proj.bias", heads, d, 1, None),
            f"{ours}.k_bias": head_rows(f"{hf}.k_proj.bias", kv, d, repeats, None),
            f"{ours}.v_bias": head_rows(f"{hf}.v_proj.bias", kv, d, repeats, None),
        }
    if cfg.qk_norm:
        rules |= {
            f"{ours}.q_norm.weight": same(f"{hf}.q_norm.weight", (d,)),
            f"{ours}.k_norm.weight": same(f"{hf}.k_norm.weight", (d,)),
        }
    return rules


def mla_attention_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    e, heads, lora = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rules = {
        f"{ours}.kv_a": transposed(f"{hf}.kv_a_proj_with_mqa.weight", (lora + rope, e)),
        f"{ours}.kv_a_norm.weight": same(f"{hf}.kv_a_layernorm.weight", (lora,)),
        f"{ours}.w_uk": kv_b_part(f"{hf}.kv_b_proj.weight", heads, nope, v, lora, "k"),
        f"{ours}.w_uv": kv_b_part(f"{hf}.kv_b_proj.weight", heads, nope, v, lora, "v"),
        f"{ours}.o_proj": output_heads(f"{hf}.o_proj.weight", heads, v, e),
    }
    if cfg.q_lora_rank:
        rules |= {
            f"{ours}.q_a": transposed(f"{hf}.q_a_proj.weight", (cfg.q_lora_rank, e)),
            f"{ours}.q_a_norm.weight": same(f"{hf}.q_a_layernorm.weight", (cfg.q_lora_rank,)),
            f"{ours}.q_b": head_rows(f"{hf}.q_b_proj.weight", heads, nope + rope, 1, cfg.q_lora_rank),
        }
    else:
        rules[f"{ours}.q_proj"] = head_rows(f"{hf}.q_proj.weight", heads, nope + rope, 1, e)
    return rules
