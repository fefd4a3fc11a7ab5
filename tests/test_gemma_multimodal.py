"""The text model of a multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, the 4B to 27B): the
tiny random Gemma 3's weights (tests/fixtures/gemma3-tiny) saved as its text model, in both tensor spellings
(as released, "language_model.model.", and as transformers 5 saves, "model.language_model."), beside a vision
tower dcpjax does not read. Text-only prompts make the text model alone, so its greedy tokens are the tiny
model's, which transformers wrote (expected.json)."""

import json
import pathlib
import shutil

import pytest
from safetensors.numpy import load_file, save_file

import dcpjax

TINY = pathlib.Path(__file__).parent / "fixtures" / "gemma3-tiny"
CASES = json.loads((TINY / "expected.json").read_text())["cases"]


def _multimodal_folder(folder: pathlib.Path, prefix: str) -> pathlib.Path:
    text = json.loads((TINY / "config.json").read_text())
    del text["architectures"]
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
              "vision_config": {"hidden_size": 8, "model_type": "siglip_vision_model"}}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(TINY / "model.safetensors")
    tensors = {prefix + name.removeprefix("model."): value for name, value in weights.items()}
    tensors["model.vision_tower.patch_embedding.weight"] = tensors[prefix + "norm.weight"][:4].copy()
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(TINY / "generation_config.json", folder)
    return folder


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_the_text_model_of_a_multimodal_checkpoint(tmp_path, prefix):
    llm = dcpjax.LLM(str(_multimodal_folder(tmp_path / "gemma3-mm", prefix)), tensor_parallel_size=2,
                     decode_context_parallel_size=2, max_model_len=256, kv_cache_memory_bytes=1 << 20)
    assert llm.model_config.architecture == "Gemma3ForCausalLM"
    params = dcpjax.SamplingParams(temperature=0, max_tokens=20)
    outputs = llm.generate([{"prompt_token_ids": case["prompt"]} for case in CASES], params, use_tqdm=False)
    for case, output in zip(CASES, outputs):
        assert output.outputs[0].token_ids == case["greedy"], f"prompt of {len(case['prompt'])} tokens"
