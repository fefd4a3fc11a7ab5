"""config.json parsing (both spellings) and RoPE frequencies against transformers' values."""

import json
import pathlib

import numpy as np
import pytest

from dcpjax.models.config import ModelConfig, RopeConfig
from dcpjax.models.rope import rope_frequencies

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ROPE = json.loads((FIXTURES / "rope_expected.json").read_text())


def published_spelling(config: dict) -> dict:
    """The spelling released checkpoints use: rope_theta + rope_scaling (with 'type')."""
    config = dict(config)
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    config["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    return config


@pytest.mark.parametrize("case", list(ROPE))
@pytest.mark.parametrize("spelling", ["current", "published"])
def test_rope_frequencies_match_transformers(case, spelling):
    config = ROPE[case]["config"]
    if spelling == "published":
        config = published_spelling(config)
    rope = RopeConfig.from_hf(config)
    inv_freq, factor = rope_frequencies(rope, 64)
    np.testing.assert_allclose(inv_freq, ROPE[case]["inv_freq"], rtol=1e-6)
    assert factor == pytest.approx(ROPE[case]["attention_factor"], rel=1e-9)


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2", "qwen3", "qwen3-moe", "deepseek-v3"])
def test_both_spellings_give_the_same_config(name):
    config = json.loads((FIXTURES / name / "config.json").read_text())
    assert ModelConfig.from_hf(config) == ModelConfig.from_hf(published_spelling(config))


def test_fixture_configs():
    llama = ModelConfig.from_pretrained(FIXTURES / "llama3-rope")
    assert (llama.architecture, llama.rope.rope_type, llama.qk_norm) == ("LlamaForCausalLM", "llama3", False)
    qwen = ModelConfig.from_pretrained(FIXTURES / "qwen3")
    assert qwen.qk_norm and qwen.rope.theta == 1e6 and qwen.num_key_value_heads == 2
    moe = ModelConfig.from_pretrained(FIXTURES / "qwen3-moe")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.sparse_layers, moe.norm_topk_prob) == (8, 2, (1,), True)
    ds = ModelConfig.from_pretrained(FIXTURES / "deepseek-v3")
    assert ds.use_mla and ds.num_key_value_heads == 1 and ds.latent_dim == 40 and ds.sparse_layers == (1,)
    assert (ds.rope.rope_type, ds.rope.mscale_all_dim, ds.n_group, ds.topk_group) == ("yarn", 1.0, 4, 2)


def test_unsupported_inputs_are_named():
    config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        ModelConfig.from_hf(config | {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(config | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="RoPE type 'longrope'"):
        ModelConfig.from_hf(config | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}})
    windowed = ModelConfig.from_hf(config | {"sliding_window": 64, "use_sliding_window": True})
    windowed.check_max_model_len(64)
    with pytest.raises(ValueError, match="sliding-window"):
        windowed.check_max_model_len(65)
    deepseek = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    with pytest.raises(ValueError, match="only DeepSeek-V3's routing"):
        ModelConfig.from_hf(deepseek | {"scoring_func": "softmax"})
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(FIXTURES)


def test_mla_softmax_scale_includes_yarn_mscale():
    from dcpjax.models.deepseek import mla_softmax_scale

    ds = ModelConfig.from_pretrained(FIXTURES / "deepseek-v3")
    mscale = 0.1 * 1.0 * np.log(4.0) + 1.0
    assert mla_softmax_scale(ds) == pytest.approx(24**-0.5 * mscale**2)
