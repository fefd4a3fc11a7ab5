"""Orbax save/restore of loaded weights onto a different mesh gives the same tokens."""

import pathlib

import pytest

import dcpjax

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PARAMS = dcpjax.SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 60))}]


def make(model, tp, dcp, **kw):
    return dcpjax.LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                      kv_cache_memory_bytes=4 << 20, max_model_len=256, max_num_batched_tokens=64, **kw)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    "model, source_mesh, target_meshes",
    [
        ("tiny-llama", (8, 4), [(2, 1), (8, 2)]),  # KV heads repeated 4x at (8, 4), not at all at (2, 1)
        (str(FIXTURES / "deepseek-v3"), (8, 8), [(4, 2), (1, 1)]),
        (str(FIXTURES / "qwen3-moe"), (4, 2), [(8, 4)]),
    ],
)
def test_restore_onto_another_mesh(tmp_path, model, source_mesh, target_meshes):
    source = make(model, *source_mesh)
    want = tokens(source)
    source.save_checkpoint(str(tmp_path / "ckpt"))
    for mesh in target_meshes:
        # seed=7: a tiny model would draw other random weights, so equal tokens prove the restore
        restored = make(model, *mesh, orbax_checkpoint=str(tmp_path / "ckpt"), seed=7)
        assert tokens(restored) == want


def test_restore_errors_are_named(tmp_path):
    with pytest.raises(ValueError, match="no orbax checkpoint"):
        make("tiny-llama", 2, 1, orbax_checkpoint=str(tmp_path / "missing"))
    make("tiny-qwen3", 2, 1).save_checkpoint(str(tmp_path / "qwen"))
    with pytest.raises(ValueError, match="does not fit this model config"):
        make("tiny-llama", 2, 1, orbax_checkpoint=str(tmp_path / "qwen"))
