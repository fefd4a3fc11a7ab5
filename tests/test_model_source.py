"""vLLM's --generation-config and --load-format, on their own (no model runs)."""

import json

import pytest

from dcpjax.loader.model_source import generation_defaults, model_source
from dcpjax.sharding.config import ParallelConfig

PC = ParallelConfig(1, 1)


def test_generation_config_defaults_come_only_from_keys_the_file_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "top_k": None, "eos_token_id": 2}))
    assert generation_defaults(str(tmp_path), "auto") == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(None, "auto") == {}  # a GGUF or a built-in model: no generation_config.json
    assert generation_defaults(None, str(tmp_path))["temperature"] == 0.6  # a folder given explicitly
    with pytest.raises(ValueError, match="is not 'auto', 'vllm' or a folder with generation_config.json"):
        generation_defaults(None, str(tmp_path / "nope"))


def test_load_format_insists_or_gives_random_weights(tmp_path):
    with pytest.raises(ValueError, match="load_format='gguf' but model 'tiny-llama' is a built-in tiny model"):
        model_source("tiny-llama", PC, 0, load_format="gguf")
    with pytest.raises(ValueError, match="load_format must be one of"):
        model_source("tiny-llama", PC, 0, load_format="pt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                  "vocab_size": 300, "max_position_embeddings": 128}))
    with pytest.raises(ValueError, match="load_format='dummy' for random weights"):
        model_source(str(config), PC, 0)
    source = model_source(str(config), PC, 0, load_format="dummy")  # a JSON config runs with random weights
    assert source.config.vocab_size == 300 and source.tokenizer is None and source.folder is None
    assert "model.embed_tokens.weight" in source.weights().names()
