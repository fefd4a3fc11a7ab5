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
