"""Gemma 3 (and Gemma 2) text decoders under DCP (Flax NNX).

What Gemma adds to a Llama-style decoder, each a `ModelConfig` field that the shared modules
read (so this module is only the family's declaration):
- sliding-window attention on most layers (`layer_types`: Gemma 3 five of every six, Gemma 2
  every other one) with its own RoPE base (`local_rope`, 10,000; the full layers keep
  `rope_theta` and any rope scaling); under DCP each rank attends to the positions it owns
  inside the window and the LSE merge combines them (`sharding.local_ops.dcp_attention`);
- the softmax scale query_pre_attn_scalar ** -0.5; (1 + w) RMSNorms (weights centred on 0),
  also on each q and k head (Gemma 3) and around both the attention and the MLP ("sandwich");
- GeGLU (gelu, tanh form), embeddings times sqrt(hidden), tied LM head, logits soft-capped
  (`final_logit_softcapping`).
Attention-logit soft-capping (`attn_logit_softcapping`): Gemma 2 soft-caps the scaled scores
inside every attention kernel (`AttentionOptions.softcap`); transformers' Gemma 3 (and vLLM's)
ignore it even when a config sets it, and published Gemma 3 configs leave it null, so dcpjax's
Gemma 3 ignores it too.
"""

from __future__ import annotations

import math
from typing import Any

from dcpjax.models.base import CausalLM, DecoderLayer
from dcpjax.models.component_rules import decoder_rules, gqa_attention_rules, mlp_rules
from dcpjax.models.config import (
    BYTE_EOS,
    BYTE_VOCAB,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeConfig,
    TextPart,
)
from dcpjax.models.family import GGUFArchitecture, ModelFamily
from dcpjax.models.llama import LlamaAttention, llama_mlp
from dcpjax.models.weight_rules import Rule, same
from dcpjax.sharding.config import ParallelConfig

LOCAL_ROPE_THETA = 10000.0  # the sliding layers' RoPE base where a config does not say (transformers' default)
GEMMA3_27B_LAYERS = 62  # llama.cpp tells Gemma 3 27B (softmax scale (hidden / heads) ** -0.5) by its layer count


# Gemma 3's 4B, 12B and 27B checkpoints: a vision tower beside the text model, whose nested `text_config`
# lists only what differs from transformers' Gemma3TextConfig defaults (5.x: these); text-only inputs
# (no image tokens) make the text model alone. Tensors: "language_model.model." as released,
# "model.language_model." as transformers 5 saves them.
GEMMA3_TEXT = TextPart(
    "Gemma3ForCausalLM",
    defaults={"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
              "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
              "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
              "sliding_window": 4096, "sliding_window_pattern": 6},
    prefixes=(("language_model.model.", "model."), ("model.language_model.", "model."),
              ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")))


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 causal LM: `LlamaAttention` (window, scale and RoPE per layer from the
    config) and a GeGLU MLP in sandwich-normed layers."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, dtype):
        super().__init__(cfg, pc, dtype, lambda i: DecoderLayer(
            cfg, dtype, LlamaAttention(cfg, pc, dtype, i), llama_mlp(cfg, pc, dtype, i)))


# -- the family: what config.json, the checkpoint and GGUF files say ----------------------
def _layer_types(architecture: str, config: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's attention: `layer_types` if given, else Gemma 3's pattern (every
    `sliding_window_pattern`-th layer full, default 6) or Gemma 2's (every other layer full)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = 2 if architecture == "Gemma2ForCausalLM" else config.get("sliding_window_pattern") or 6
        types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)]
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if len(types) != layers or unknown:
        raise ValueError(f"layer_types must name each of the {layers} layers {FULL_ATTENTION!r} or "
                         f"{SLIDING_ATTENTION!r}; got {len(types)} entries"
                         f"{', unknown ' + str(unknown) if unknown else ''}")
    if SLIDING_ATTENTION in types and not config.get("sliding_window"):
        raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
    return tuple(types)


def _ropes(architecture: str, config: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(full layers' RoPE, sliding layers' RoPE or None: the same). Gemma 2 has one RoPE for every
    layer. Gemma 3: current transformers writes `rope_parameters` keyed by layer type; published
    checkpoints `rope_theta` + `rope_scaling` (full layers) and `rope_local_base_freq` (sliding
    layers, never scaled)."""
    if architecture == "Gemma2ForCausalLM":
        return RopeConfig.from_hf(config), None
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:
        full = RopeConfig.from_hf({**config, "rope_parameters": dict(params[FULL_ATTENTION])})
        local = params.get(SLIDING_ATTENTION) or {"rope_theta": LOCAL_ROPE_THETA}
        return full, RopeConfig.from_hf({**config, "rope_parameters": dict(local)})
    local_theta = config.get("rope_local_base_freq") or LOCAL_ROPE_THETA
    return RopeConfig.from_hf(config), RopeConfig.from_hf({**config, "rope_parameters": {"rope_theta": local_theta}})


def gemma_config_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's fields (transformers' defaults where a config leaves one out)."""
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma's encoder variant) is not supported: dcpjax decodes "
                         "causally")
    full, local = _ropes(architecture, config)
    gemma2 = architecture == "Gemma2ForCausalLM"
    types = _layer_types(architecture, config)
    return dict(
        layer_types=types,
        sliding_window=config.get("sliding_window") if SLIDING_ATTENTION in types else None,
        rope=full, local_rope=local,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),  # transformers' default
        hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        embed_scale=math.sqrt(config["hidden_size"]),
        sandwich_norms=True, norm_offset=1.0, qk_norm=not gemma2,
        final_logit_softcapping=config.get("final_logit_softcapping") or None,
        attn_logit_softcapping=(config.get("attn_logit_softcapping") or None) if gemma2 else None,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def gemma_checkpoint_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """GQA in `self_attn` (q/k norms in Gemma 3), a GeGLU MLP in `mlp`, and the two norms around
    the MLP beside the shared frame's input and post-attention norms."""
    e = cfg.hidden_size

    def layer(i: int, ours: str, hf: str) -> dict[str, Rule]:
        return (gqa_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg, pc)
                | mlp_rules(f"{ours}.mlp", f"{hf}.mlp", e, cfg.intermediate_size)
                | {f"{ours}.pre_feedforward_norm.weight": same(f"{hf}.pre_feedforward_layernorm.weight", (e,)),
                   f"{ours}.post_feedforward_norm.weight": same(f"{hf}.post_feedforward_layernorm.weight", (e,))})

    return decoder_rules(cfg, layer)


def gemma3_gguf_fields(meta: dict[str, Any], layers: int) -> dict[str, Any]:
    """What llama.cpp's `gemma3` GGUF leaves out and its loader hard-codes: the sliding layers'
    RoPE base (10,000), every sixth layer full (all full without a window), query_pre_attn_scalar
    = head_dim, but hidden / heads for the 27B model (which llama.cpp knows by its 62 layers), and
    `<end_of_turn>` as a second end of generation."""
    window = meta.get("gemma3.attention.sliding_window")
    hidden, heads = meta.get("gemma3.embedding_length"), meta.get("gemma3.attention.head_count")
    head_dim = meta.get("gemma3.attention.key_length")
    fields: dict[str, Any] = {"rope_local_base_freq": LOCAL_ROPE_THETA, "sliding_window_pattern": 6 if window else 1,
                              "hidden_activation": "gelu_pytorch_tanh"}
    if window:
        fields["sliding_window"] = int(window)
    if layers == GEMMA3_27B_LAYERS and hidden and isinstance(heads, int):
        fields["query_pre_attn_scalar"] = int(hidden) // heads
    elif head_dim:
        fields["query_pre_attn_scalar"] = int(head_dim)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and meta.get("tokenizer.ggml.eos_token_id") is not None:
        # a turn ends generation too (Google's generation_config: [1, 106]; llama.cpp's end-of-generation set)
        fields["eos_token_id"] = [int(meta["tokenizer.ggml.eos_token_id"]), tokens.index("<end_of_turn>")]
    softcap = meta.get("gemma3.final_logit_softcapping")
    if softcap:
        fields["final_logit_softcapping"] = float(softcap)
    return fields


FAMILY = ModelFamily(
    name="Gemma",
    architectures=("Gemma3ForCausalLM", "Gemma2ForCausalLM"),
    model_class=GemmaForCausalLM,
    checkpoint_rules=gemma_checkpoint_rules,
    config_fields=gemma_config_fields,
    text_parts={"Gemma3ForConditionalGeneration": GEMMA3_TEXT},
    # llama.cpp's converter stores Gemma's norm weights as 1 + w (`norm_offset` below)
    gguf={"gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", rope_theta=1000000.0, norm_offset=1.0, extra_fields=gemma3_gguf_fields,
        layer_names={"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})},
    tiny_models={
        # 8 query heads / 1 KV head (Gemma 3 270M has 4 / 1): DCP up to 8 at TP 8
        "tiny-gemma3": ModelConfig(
            architecture="Gemma3ForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=1, head_dim=16, qk_norm=True,
            max_position_embeddings=32768, eos_token_id=(BYTE_EOS,), rope=RopeConfig(theta=1000000.0),
            local_rope=RopeConfig(theta=LOCAL_ROPE_THETA), sliding_window=16,
            layer_types=(SLIDING_ATTENTION,) * 2 + (FULL_ATTENTION,) + (SLIDING_ATTENTION,) * 2 + (FULL_ATTENTION,),
            hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=16.0, embed_scale=8.0, sandwich_norms=True,
            norm_offset=1.0, tie_word_embeddings=True,
        ),
    },
)
