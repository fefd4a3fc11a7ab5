"""Gemma's config.json in both spellings, its GGUF fields, and what dcpjax refuses (no jax needed)."""

import json
import pathlib

import pytest

from dcpjax.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from dcpjax.models.gemma3 import gemma3_gguf_fields

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
S, F = SLIDING_ATTENTION, FULL_ATTENTION


def tiny_config(**over):
    return json.loads((FIXTURES / "gemma3-tiny" / "config.json").read_text()) | over


def test_transformers_5_and_published_spellings_agree():
    """transformers 5's rope_parameters keyed by layer type and layer_types, and the published
    rope_theta + rope_scaling + rope_local_base_freq + sliding_window_pattern, give one config."""
    new = ModelConfig.from_hf(tiny_config())
    old = tiny_config(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
                      rope_local_base_freq=1e4, sliding_window_pattern=3)
    del old["rope_parameters"], old["layer_types"]
    assert ModelConfig.from_hf(old) == new
    assert new.layer_types == (S, S, F, S, S, F) and new.window_of(0) == 8 and new.window_of(2) is None
    assert new.rope_of(2).rope_type == "linear" and new.rope_of(0).theta == 1e4 and new.rope_of(0).factor == 1.0
    assert new.attention_scale == 24**-0.5 and new.attn_logit_softcapping is None  # Gemma 3 ignores it
    assert new.final_logit_softcapping == 30.0 and new.embed_scale == 8.0


def test_gemma2_alternates_and_keeps_one_rope():
    cfg = json.loads((FIXTURES / "gemma2" / "config.json").read_text())
    del cfg["layer_types"]
    got = ModelConfig.from_hf(cfg)
    assert got.layer_types == (S, F, S, F) and got.local_rope is None and got.rope_of(0) == got.rope_of(1)
    assert got.attn_logit_softcapping == 5.0 and not got.qk_norm


def test_no_sliding_layer_means_no_window_limit():
    got = ModelConfig.from_hf(tiny_config(layer_types=[F] * 6, sliding_window=4096))
    assert got.sliding_window is None
    got.check_max_model_len(100_000)


@pytest.mark.parametrize("over, match", [
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(layer_types=[S] * 5), "each of the 6 layers"),
    (dict(sliding_window=None), "sliding_window is not set"),
])
def test_what_gemma_refuses_is_named(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(tiny_config(**over))


def test_gelu_with_routed_experts_is_refused():
    cfg = json.loads((FIXTURES / "qwen3-moe" / "config.json").read_text()) | {"hidden_act": "gelu_pytorch_tanh"}
    with pytest.raises(ValueError, match="dense models only"):
        ModelConfig.from_hf(cfg)


def test_gguf_fields_as_llama_cpp_hard_codes_them():
    meta = {"gemma3.attention.sliding_window": 512, "gemma3.embedding_length": 640, "gemma3.attention.head_count": 4,
            "gemma3.attention.key_length": 256, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<end_of_turn>"]}
    fields = gemma3_gguf_fields(meta, 18)
    assert fields["sliding_window"] == 512 and fields["sliding_window_pattern"] == 6
    assert fields["query_pre_attn_scalar"] == 256 and fields["eos_token_id"] == [1, 3]
    big = meta | {"gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
                  "gemma3.attention.key_length": 128}
    assert gemma3_gguf_fields(big, 62)["query_pre_attn_scalar"] == 168  # 27B: hidden / heads
    windowless = gemma3_gguf_fields({k: v for k, v in meta.items() if "sliding" not in k}, 18)
    assert windowless["sliding_window_pattern"] == 1 and "sliding_window" not in windowless


def test_a_multimodal_checkpoints_text_config_reads_with_the_text_models_defaults():
    """Gemma 3 4B's config.json as published: `Gemma3ForConditionalGeneration` with a nested text_config
    naming only what differs from Gemma3TextConfig's defaults; the text model is read, the outer eos ids win."""
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                 "model_type": "gemma3", "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024}}
    cfg = ModelConfig.from_hf(published)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.eos_token_id == (1, 106)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == (2560, 34, 8, 4, 256, 262_208)
    assert cfg.layer_types[:6] == (S, S, S, S, S, F) and cfg.window_of(0) == 1024
    assert cfg.rope_of(5).factor == 8.0 and cfg.rope_of(5).theta == 1e6 and cfg.rope_of(0).theta == 1e4
