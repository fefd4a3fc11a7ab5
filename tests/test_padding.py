"""MLP / expert widths and vocabularies the mesh cannot split evenly are zero-padded, exactly.

SmolLM2's intermediate 1536 does not divide by TP 9, its only DCP layout's TP; the same
happens for any width. Padded gate/up columns give silu(0) * 0 = 0 and padded down rows add
0, so a padded mesh gives the tokens of an unpadded one; checkpoints store the true sizes.
"""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dcpjax
from dcpjax.loader.weights import random_checkpoint
from dcpjax.models.config import ModelConfig
from dcpjax.models.layers import padded_size, param, unsplittable_dims
from dcpjax.models.registry import build_model, layout_problems
from dcpjax.sharding.config import ParallelConfig

PARAMS = dcpjax.SamplingParams(temperature=0, max_tokens=10)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 40))}]
# widths no TP of 2..8 divides (but 1): 100 = 4 * 25 divides by 2 and 4 only; 21 by none of 2, 4, 8
DENSE = dict(architectures=["LlamaForCausalLM"], vocab_size=263, hidden_size=64, intermediate_size=100,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=2)
MOE = DENSE | dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=21, norm_topk_prob=True, mlp_only_layers=[0])


def write_folder(folder, config: dict):
    """A Hugging Face folder with random weights for `config` (norms at 1)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf(config)
    source = random_checkpoint(cfg, ParallelConfig(1), seed=3)
    save_file({name: source.tensors[name] for name in source.names()}, folder / "model.safetensors")
    return str(folder)


def make(model, tp, dcp=1, **kw):
    return dcpjax.LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, max_model_len=128,
                      kv_cache_memory_bytes=2 << 20, max_num_batched_tokens=64, **kw)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("config", [DENSE, pytest.param(MOE, marks=pytest.mark.oldest_jax)], ids=["dense", "moe"])
def test_padded_mesh_gives_unpadded_tokens_and_checkpoints_keep_true_sizes(tmp_path, config):
    folder = write_folder(tmp_path / "model", config)
    want = tokens(make(folder, 1))
    padded = make(folder, 8, 2)  # 100 -> 104 (dense), 21 -> 24 (experts), vocab 263 -> 264
    assert tokens(padded) == want
    layer = padded.runner.state["layers"][1]["mlp"]
    width = config.get("moe_intermediate_size") if "num_experts" in config else config["intermediate_size"]
    up = np.asarray(layer["up"].get_value())
    assert up.shape[-1] == padded_size(width, "ffw", ParallelConfig(8, 2)) > width
    assert not up[..., width:].any() and not np.asarray(layer["down"].get_value())[..., width:, :].any()
    padded.save_checkpoint(str(tmp_path / "ckpt"))
    for tp, dcp in [(1, 1), (4, 2), (2, 1)]:
        restored = make(folder, tp, dcp, orbax_checkpoint=str(tmp_path / "ckpt"))
        assert tokens(restored) == want, (tp, dcp)


def test_the_planner_and_the_loader_share_one_check():
    cfg = ModelConfig.from_hf(DENSE)
    assert layout_problems(cfg, ParallelConfig(8, 2)) == []  # padded: valid, and it loads (above)
    broken = layout_problems(cfg, ParallelConfig(3))
    assert broken and "num_attention_heads % tensor_parallel_size" in broken[0]
    with pytest.raises(ValueError, match="num_attention_heads % tensor_parallel_size"):
        build_model(cfg, ParallelConfig(3), np.float32)


def test_a_dimension_that_cannot_be_padded_is_named_before_loading():
    class Heads(nnx.Module):
        def __init__(self):
            self.q = param((64, 9, 16), ("embed", "q_heads", "head_dim"), np.float32, pc=ParallelConfig(6))

    _, state = nnx.split(nnx.eval_shape(Heads))
    problems = unsplittable_dims(state, ParallelConfig(6))
    assert problems == [("parameter q dimension 1 ('q_heads', size 9) cannot be split over 6 devices; split counts "
                         "that divide it: [1, 3, 9]")]
    assert unsplittable_dims(state, ParallelConfig(3)) == []
