"""GGUF files written here the way llama.cpp's converter writes them, loaded back by dcpjax.

Each case quantizes a tiny random Hugging Face model with `gguf.quants.quantize`, writes it
under llama.cpp's tensor names (for the `llama` architecture with Q and K rows permuted as
its converter does: each head's two rotary halves interleaved), and writes the dequantized
weights as a Hugging Face folder too. The GGUF must decode exactly as the folder does, on a
mesh that splits every tensor (TP 4, DCP 2): names, the un-permutation, each quantization
type and whole-row slicing all have to be right. The real file is held to transformers in
test_smollm2.py.
"""

import json
import pathlib
import sys

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

import dcpjax
from dcpjax.loader.weights import random_checkpoint
from dcpjax.models.config import ModelConfig
from dcpjax.quantization.gguf_blocks import HELD_TYPES
from dcpjax.sharding.config import ParallelConfig

Q = gguf.GGMLQuantizationType
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 45))}]
PARAMS = dcpjax.SamplingParams(temperature=0, max_tokens=10, logprobs=3)
BASE = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            eos_token_id=257, bos_token_id=256)
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{NAMES[rest]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows [half, d/2] -> [d/2, half] (pairs for its RoPE)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE's base vocabulary)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_stub(path, arch: str) -> str:
    """A GGUF with an embedding and no model metadata (for the errors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish(writer)
    return str(path)


def write_pair(tmp_path, arch: str, qtype, tied: bool, tokenizer_model: str = "gpt2", edit=lambda writer: None):
    """The same model as a GGUF file (quantized) and a Hugging Face folder (its dequantized values).
    `edit(writer)` adds fields or tensors before the file is written."""
    config = BASE | dict(architectures=[ARCH[arch]], tie_word_embeddings=tied, rope_theta=50000.0)
    cfg = ModelConfig.from_hf(config)
    source = random_checkpoint(cfg, ParallelConfig(1), seed=5, std=0.2)
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = byte_tokens() + ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(BASE["vocab_size"] - 258)]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3] + [4] * (len(tokens) - 258))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    hf = {}
    for name in sorted(source.names()):
        value = source.tensors[name]
        if value.ndim == 2:  # matrices are quantized along their rows, as llama.cpp does
            value = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).astype(np.float32)
        hf[name] = value
        stored = value
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            stored = permute_rows(value, heads)
        if stored.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), stored)
    edit(writer)
    finish(writer)
    save_file(hf, folder / "model.safetensors")
    return str(path), str(folder)


def run(model, **kw):
    llm = dcpjax.LLM(model, tensor_parallel_size=4, decode_context_parallel_size=2, max_model_len=128,
                     kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=64, **kw)
    return llm, llm.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("arch, qtype, tied", [
    ("llama", Q.Q8_0, True),  # SmolLM2's embedding type; Q/K rows permuted
    ("llama", Q.Q4_1, False),  # SmolLM2's matrices; an untied output.weight
    ("qwen2", Q.Q5_0, True),  # q/k/v bias, no permutation
    ("qwen3", Q.BF16, False),  # per-head q/k norm
    pytest.param("llama", Q.F16, True, marks=pytest.mark.oldest_jax),  # a second float type (slow: one Python)
])
def test_gguf_decodes_as_the_folder_it_was_written_from(tmp_path, arch, qtype, tied):
    """quantization="gguf": the quantized types held as int8 codes + block scales on the devices
    (exact against the folder's dequantized float weights; Q/K rows un-permuted part by part)."""
    path, folder = write_pair(tmp_path, arch, qtype, tied)
    llm, got = run(path, quantization="gguf")
    assert bool(llm.model_weights.held) == (qtype in HELD_TYPES)
    _, want = run(folder)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            # the held matmul sums each block before its scale: float32 rounding apart, not bit for bit
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 5e-5 for t in a)
    assert llm.model_config == ModelConfig.from_pretrained(folder)
    # its byte-level tokenizer and special tokens came from the metadata
    tokenizer = llm.get_tokenizer()
    text = "Héllo, GGUF! 123"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)


def test_held_without_the_cpu_kernel_takes_the_xla_path(tmp_path, monkeypatch):
    """Where the compiled kernel cannot be built, a held GGUF ("gguf") runs the tiled XLA path and still
    gives the dequantized folder's tokens and logprobs (float32 rounding apart)."""
    from dcpjax.quantization import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    path, folder = write_pair(tmp_path, "llama", Q.Q4_1, True)
    llm, got = run(path, quantization="gguf")
    assert llm.model_weights.held
    _, want = run(folder)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 5e-5 for t in a)


def test_held_through_the_pallas_kernel(tmp_path, monkeypatch):
    """$DCPJAX_QUANTIZED_MATMUL=pallas (the GPU / TPU kernel, interpreted here) at TP 4 / DCP 2 on a model
    whose every local linear and tied head tile (K groups of 32, of 16 where TP cuts a block): no weight takes
    another path, and the tokens and logprobs are the dequantized folder's."""
    from dcpjax.quantization import matmul, pallas_matmul

    shapes, elsewhere = [], []
    original = pallas_matmul.quantized_matmul_pallas
    monkeypatch.setattr(pallas_matmul, "quantized_matmul_pallas",
                        lambda x, v, *a, **kw: shapes.append(v.shape) or original(x, v, *a, **kw))
    monkeypatch.setattr(matmul, "_on_cpu", lambda *a: elsewhere.append(a[1].shape))
    monkeypatch.setitem(BASE, "vocab_size", 320)  # 80 rows of the head per device, 32 columns of the MLP
    monkeypatch.setitem(BASE, "intermediate_size", 128)
    monkeypatch.setenv("DCPJAX_QUANTIZED_MATMUL", "pallas")
    path, folder = write_pair(tmp_path, "llama", Q.Q8_0, True)
    held, got = run(path, quantization="gguf")
    assert held.model_weights.held and (80, 64) in shapes and (16, 64) in shapes and not elsewhere
    monkeypatch.delenv("DCPJAX_QUANTIZED_MATMUL")
    _, want = run(folder)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 5e-5 for t in a)


def write_tokenizer_folder(folder):
    """A Hugging Face tokenizer over the same byte vocabulary that adds BOS (the GGUF's does not)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir()
    tokens = byte_tokens() + ["<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "add_bos_token": True}))
    return str(folder)


def test_a_tokenizer_folder_replaces_the_files(tmp_path):
    path, _ = write_pair(tmp_path, "qwen3", Q.Q8_0, True)
    folder = write_tokenizer_folder(tmp_path / "tok")
    own = dcpjax.LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20).get_tokenizer()
    replaced = dcpjax.LLM(path, tokenizer=str(folder), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert own.encode("hi") == [ord("h"), ord("i")]  # the file's: no BOS added
    assert replaced.get_tokenizer().encode("hi") == [256, ord("h"), ord("i")]  # the folder's adds one
    with pytest.raises(ValueError, match="not a Hugging Face folder with tokenizer.json"):
        dcpjax.LLM(path, tokenizer=str(tmp_path), max_model_len=64)


def test_a_tokenizer_dcpjax_cannot_rebuild_is_no_obstacle_with_tokenizer(tmp_path):
    path, _ = write_pair(tmp_path, "llama", Q.Q8_0, True, tokenizer_model="llama")  # SentencePiece (Llama 2)
    with pytest.raises(ValueError, match=r"GGUF tokenizer model 'llama' is not supported.*pass tokenizer="):
        dcpjax.LLM(path, max_model_len=64)
    llm = dcpjax.LLM(path, tokenizer=write_tokenizer_folder(tmp_path / "tok"), max_model_len=64,
                     kv_cache_memory_bytes=1 << 20)
    assert llm.generate("hi", dcpjax.SamplingParams(max_tokens=2))[0].prompt_token_ids == [256, ord("h"), ord("i")]


def test_what_dcpjax_cannot_load_is_named(tmp_path):
    moe, _ = write_pair(tmp_path / "a", "llama", Q.Q8_0, True, edit=lambda w: w.add_expert_count(8))
    with pytest.raises(ValueError, match="a mixture-of-experts GGUF .* is not supported"):
        dcpjax.LLM(moe, max_model_len=64)
    extra, _ = write_pair(tmp_path / "b", "llama", Q.Q8_0, True,
                          edit=lambda w: w.add_tensor("blk.0.attn_output.bias", np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match="unexpected tensors: blk.0.attn_output.bias"):
        dcpjax.LLM(extra, max_model_len=64)
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3"):
        dcpjax.LLM(write_stub(tmp_path / "mamba.gguf", "mamba"))
    partial = write_stub(tmp_path / "partial.gguf", "llama")
    with pytest.raises(ValueError, match="GGUF metadata has no 'llama.embedding_length'"):
        dcpjax.LLM(partial)
    (tmp_path / "truncated.gguf").write_bytes(pathlib.Path(partial).read_bytes()[:40])
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        dcpjax.LLM(str(tmp_path / "truncated.gguf"))


def test_missing_gguf_package_names_the_install(tmp_path, monkeypatch):
    from dcpjax.loader import gguf_loader

    monkeypatch.setitem(sys.modules, "gguf", None)
    gguf_loader._parse.cache_clear()
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ImportError, match="pip install gguf"):
        dcpjax.LLM(str(tmp_path / "x.gguf"))


def test_linear_rope_scaling_is_read_and_others_are_named(tmp_path):
    from dcpjax.loader.model_source import load_model_config

    def scaled(kind):
        return lambda w: (w.add_rope_scaling_type(kind), w.add_rope_scaling_factor(2.0))

    linear, _ = write_pair(tmp_path / "a", "llama", Q.F16, True, edit=scaled(gguf.RopeScalingType.LINEAR))
    rope = load_model_config(linear).rope
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 2.0, 50000.0)
    yarn, _ = write_pair(tmp_path / "b", "llama", Q.F16, True, edit=scaled(gguf.RopeScalingType.YARN))
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' in GGUF is not supported"):
        load_model_config(yarn)


# gguf-py reads the 270M's metadata in ~20 s on CI: on the oldest jax only
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", pytest.param("gemma3-270m", marks=pytest.mark.oldest_jax)])
def test_fast_metadata_equals_gguf_py(name):
    """dcpjax's metadata reader gives what gguf-py's own fields give, and the same tensors."""
    import gguf

    from dcpjax.loader.gguf_metadata import open_reader
    from dcpjax.loader.model_source import builtin_gguf_path

    try:
        path = str(builtin_gguf_path(name))
    except ValueError as error:
        pytest.skip(str(error))
    fast, meta = open_reader(gguf, path)
    slow = gguf.GGUFReader(path)
    assert meta == {key: field.contents() for key, field in slow.fields.items() if not key.startswith("GGUF.")}
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in slow.tensors]
