"""Loading Hugging Face folders: sharded safetensors with an index, tokenizer files, dtypes."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dcpjax
from dcpjax.text.tokenizer import HFTokenizer, decode_stream

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PARAMS = dcpjax.SamplingParams(temperature=0, max_tokens=8)


def make(folder, **kw):
    return dcpjax.LLM(str(folder), tensor_parallel_size=4, decode_context_parallel_size=2,
                      kv_cache_memory_bytes=4 << 20, max_model_len=256, **kw)


def split_with_index(source: pathlib.Path, target: pathlib.Path) -> None:
    """The same weights as two shards plus model.safetensors.index.json (as large checkpoints ship)."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, target / file)
    weight_map = {n: f for f, members in shards.items() for n in members}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_indexed_shards_load_like_one_file(tmp_path):
    split_with_index(FIXTURES / "qwen3", tmp_path / "indexed")
    prompt = [{"prompt_token_ids": [5, 9, 14, 3]}]
    want = make(FIXTURES / "qwen3").generate(prompt, PARAMS)[0].outputs[0].token_ids
    assert make(tmp_path / "indexed").generate(prompt, PARAMS)[0].outputs[0].token_ids == want


def write_tokenizer(folder: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, decode context parallelism splits the KV cache"] * 50, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def test_folder_with_tokenizer_takes_text_prompts(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama3-rope", folder)
    write_tokenizer(folder)
    tokenizer = HFTokenizer(folder)
    ids = tokenizer.encode("hello world")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == "hello world"
    llm = make(folder)
    out = llm.generate("hello world", PARAMS)[0]
    assert out.prompt_token_ids == ids
    completion = out.outputs[0]
    assert completion.text == tokenizer.decode(completion.token_ids)
    # the same ids given directly give the same tokens
    assert llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0].token_ids == completion.token_ids


def test_folder_without_tokenizer_needs_token_ids():
    with pytest.raises(ValueError, match="no tokenizer.json"):
        make(FIXTURES / "qwen3").generate("hello")


def test_bfloat16_weights_on_cpu():
    llm = make(FIXTURES / "qwen3", dtype="bfloat16")
    leaves = [v for _, v in __import__("flax").nnx.to_flat_state(llm.runner.state)]
    assert all(v.get_value().dtype == np.dtype("bfloat16") for v in leaves)
    expected = json.loads((FIXTURES / "qwen3" / "expected.json").read_text())["cases"][1]
    out = llm.generate({"prompt_token_ids": expected["prompt"]}, PARAMS)[0].outputs[0]
    assert out.token_ids[:2] == expected["greedy"][:2]  # bf16 weights: the first tokens still agree


def test_incremental_detokenization_matches_decode(tmp_path):
    """The streamed text is what `decode` gives, token by token (a partial character waits)."""
    write_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    rng = np.random.default_rng(0)
    words = ["hello", " world", ",", " decode", " context", " KV", " cache", " é", "✓"]
    for _ in range(10):
        ids = tokenizer.encode("".join(rng.choice(words, 12)), add_special_tokens=False)
        stream = decode_stream(tokenizer)
        pieces = [stream.step(i) for i in ids]
        for n in range(1, len(ids) + 1):
            assert tokenizer.decode(ids[:n]).startswith("".join(pieces[:n]))
        assert "".join(pieces) == tokenizer.decode(ids)


def test_decode_stream_restarts_after_an_invalid_prefix(tmp_path):
    """tokenizers raises "Invalid prefix encountered" on non-monotonic decoding; the stream
    restarts from its last tokens instead of failing the request."""
    write_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    ids = tokenizer.encode("hello world, decode", add_special_tokens=False)
    stream = decode_stream(tokenizer)
    text = stream.step(ids[0])

    class Broken:
        def step(self, *args):
            raise Exception("Invalid prefix encountered while decoding")  # noqa: TRY002 (as tokenizers raises it)

    stream.stream = Broken()
    text += "".join(stream.step(i) for i in ids[1:])
    assert text == "hello world, decode"
