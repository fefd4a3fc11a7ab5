"""How each dcpjax parameter is read from a Hugging Face checkpoint: one `Rule` per parameter,
mapping the part a device holds (an index of slices into the dcpjax layout) to the slice of the
checkpoint tensor(s) it comes from, and `model_rules`, every parameter's rule for each supported
architecture (fused and permuted tensors split or rearranged here, so the models see one layout).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dcpjax.config import ParallelConfig
from dcpjax.models.config import ModelConfig
from dcpjax.sharding.mesh import kv_head_slots

if TYPE_CHECKING:
    from dcpjax.loader.weights import TensorSource

# rotary caches; Qwen3-Next's multi-token-prediction head (`mtp.*`, which transformers skips too)
IGNORED_CHECKPOINT_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|^mtp\.")


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one dcpjax parameter is read: the checkpoint tensors it comes from (name ->
    shape) and `read(source, index, shape)`, the slice mapping."""

    tensors: dict[str, tuple[int, ...]]
    read: Callable[[TensorSource, tuple[slice, ...], tuple[int, ...]], np.ndarray]


def same(hf_name, hf_shape) -> Rule:
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx))


def transposed(hf_name, hf_shape) -> Rule:
    """dcpjax [in, out] <- torch Linear [out, in]."""
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx[::-1]).T)


def stacked_experts(hf_names: list[str], hf_shape: tuple[int, int]) -> Rule:
    """dcpjax [experts, in, out] <- one torch Linear [out, in] per expert."""

    def read(src, idx, shape):
        (x0, x1), (i0, i1), (o0, o1) = _bounds(idx, shape)
        return np.stack([src.read(hf_names[e], (slice(o0, o1), slice(i0, i1))).T for e in range(x0, x1)])

    return Rule({name: hf_shape for name in hf_names}, read)


def head_rows(hf_name, heads: int, head_dim: int, repeats: int, hidden: int | None) -> Rule:
    """q/k/v projection ([heads*d, hidden] -> [hidden, slots, d]) or bias ([heads*d] -> [slots, d]).

    Slot s holds head s // repeats (KV heads repeated over the "tp" groups).
    """

    def read(src, idx, shape):
        bounds = _bounds(idx, shape)
        (s0, s1), (d0, d1) = bounds[-2], bounds[-1]
        h0, h1 = s0 // repeats, (s1 - 1) // repeats + 1
        rows = slice(h0 * head_dim, h1 * head_dim)
        if hidden is None:  # bias
            block = src.read(hf_name, (rows,)).reshape(h1 - h0, head_dim)
        else:
            e0, e1 = bounds[0]
            block = src.read(hf_name, (rows, slice(e0, e1))).reshape(h1 - h0, head_dim, e1 - e0)
        block = np.repeat(block, repeats, axis=0)[s0 - h0 * repeats : s1 - h0 * repeats, d0:d1]
        return block if hidden is None else np.moveaxis(block, 2, 0)

    hf_shape = (heads * head_dim,) if hidden is None else (heads * head_dim, hidden)
    return Rule({hf_name: hf_shape}, read)


def output_heads(hf_name, heads: int, head_dim: int, hidden: int) -> Rule:
    """O projection: [hidden, heads*d] -> [heads, d, hidden]."""

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (e0, e1) = _bounds(idx, shape)
        block = src.read(hf_name, (slice(e0, e1), slice(h0 * head_dim, h1 * head_dim)))
        return np.moveaxis(block.reshape(e1 - e0, h1 - h0, head_dim), 0, 2)[:, d0:d1]

    return Rule({hf_name: (hidden, heads * head_dim)}, read)


def kv_b_part(hf_name, heads: int, nope: int, v: int, lora: int, part: str) -> Rule:
    """MLA's kv_b_proj [heads*(nope+v), lora] -> W_UK [heads, nope, lora] or W_UV [heads, v, lora]."""
    offset = 0 if part == "k" else nope

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (c0, c1) = _bounds(idx, shape)
        block = src.read(hf_name, (slice(h0 * (nope + v), h1 * (nope + v)), slice(c0, c1)))
        return block.reshape(h1 - h0, nope + v, c1 - c0)[:, offset + d0 : offset + d1]

    return Rule({hf_name: (heads * (nope + v), lora)}, read)


def grouped_rows(hf_name, groups: int, group_rows: int, offset: int, heads_per_group: int, head_dim: int,
                 hidden: int) -> Rule:
    """One part of a fused projection whose rows come in groups (Qwen3-Next's in_proj_qkvz: per key
    head [q, k, v of its value heads, z of them]): [groups * group_rows, hidden] -> [hidden, heads,
    head_dim], head j being head j % heads_per_group of group j // heads_per_group's part, which
    starts `offset` rows into the group."""

    def read(src, idx, shape):
        (e0, e1), (h0, h1), (d0, d1) = _bounds(idx, shape)
        g0, g1 = h0 // heads_per_group, (h1 - 1) // heads_per_group + 1
        block = src.read(hf_name, (slice(g0 * group_rows, g1 * group_rows), slice(e0, e1)))
        part = block.reshape(g1 - g0, group_rows, e1 - e0)[:, offset : offset + heads_per_group * head_dim]
        heads = part.reshape((g1 - g0) * heads_per_group, head_dim, e1 - e0)
        first = h0 - g0 * heads_per_group
        return np.moveaxis(heads[first : first + h1 - h0, d0:d1], 2, 0)

    return Rule({hf_name: (groups * group_rows, hidden)}, read)


def squeezed(rule: Rule) -> Rule:
    """A [hidden, heads, 1] rule read as [hidden, heads]."""
    return Rule(rule.tensors, lambda src, idx, shape: rule.read(src, (*idx, slice(0, 1)), (*shape, 1))[..., 0])


def conv_channels(hf_name, channels: int, offset: int, heads: int, head_dim: int, taps: int) -> Rule:
    """A depthwise conv1d [channels, 1, K] -> [heads, head_dim, K] of the channels from `offset`."""

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (t0, t1) = _bounds(idx, shape)
        rows = slice(offset + h0 * head_dim, offset + h1 * head_dim)
        block = src.read(hf_name, (rows, slice(0, 1), slice(t0, t1)))[:, 0]
        return block.reshape(h1 - h0, head_dim, t1 - t0)[:, d0:d1]

    return Rule({hf_name: (channels, 1, taps)}, read)


def linear_attention_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    """Qwen3-Next's Gated DeltaNet: the fused in_proj_qkvz / in_proj_ba split by part, the conv by channel."""
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


def model_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """dcpjax parameter path -> Rule, for every supported architecture."""
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
        if cfg.use_mla:
            rules |= mla_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg)
        elif cfg.is_linear(i):
            rules |= linear_attention_rules(f"{ours}.attention", f"{hf}.linear_attn", cfg)
        else:
            rules |= gqa_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg, pc)
        if i not in cfg.sparse_layers:
            rules |= mlp_rules(f"{ours}.mlp", f"{hf}.mlp", e, cfg.intermediate_size)
            continue
        rules |= expert_rules(f"{ours}.mlp", f"{hf}.mlp", cfg)
        if cfg.shared_expert_intermediate_size:  # Qwen3-Next: a shared expert behind a sigmoid gate
            rules |= mlp_rules(f"{ours}.mlp.shared", f"{hf}.mlp.shared_expert", e, cfg.shared_expert_intermediate_size)
            rules[f"{ours}.mlp.shared_gate"] = transposed(f"{hf}.mlp.shared_expert_gate.weight", (1, e))
        if cfg.use_mla:  # DeepSeek-V3: routing bias and shared experts
            rules[f"{ours}.mlp.correction_bias"] = same(f"{hf}.mlp.gate.e_score_correction_bias", (cfg.num_experts,))
            if cfg.n_shared_experts:
                rules |= mlp_rules(f"{ours}.mlp.shared", f"{hf}.mlp.shared_experts", e,
                                   cfg.moe_intermediate_size * cfg.n_shared_experts)
    return rules


def ignored_checkpoint_tensor(cfg: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may carry that dcpjax does not use: rotary caches and multi-token-prediction
    layers (Qwen3-Next's `mtp.*`, DeepSeek-V3's layers past num_hidden_layers)."""
    if IGNORED_CHECKPOINT_TENSORS.match(name):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers  # DeepSeek's next-token layers
