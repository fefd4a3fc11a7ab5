"""fp8 block-scaled checkpoints through the engine: read as DeepSeek-V3 ships them, held fp8 on the
devices at the bytes the file takes, quantized online to the same bytes a file written in that
format holds, bad scales refused before any device is touched, and the planner's count of bytes
equal to the engine's. (Tokens against transformers: tests/test_hf_parity.py, the *-fp8 fixtures.)"""

import json
import logging
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import dcpjax
from dcpjax.loader.holding import path_name
from dcpjax.plan.deployment import Deployment, weight_bytes_per_device

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: np.ndarray, bm: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's recipe written out block by block (the test's own, not the library's): per block
    scale = amax / 448, values = w / scale in float8_e4m3fn."""
    rows, cols = w.shape
    scale = np.ones((-(-rows // bm), -(-cols // bn)), np.float32)
    values = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            amax = np.float32(np.abs(block).max())
            scale[i, j] = amax / np.float32(448) if amax > 0 else 1
            values[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def _write_fp8(folder: pathlib.Path, source: pathlib.Path, block=(128, 128), break_scale: str | None = None):
    """The float fixture at `source` written as an fp8 checkpoint in `block`s (None: one
    `weight_scale` per tensor, the per-tensor form)."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, w in load_file(source / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            values, scale = _quantize(w, *(block or w.shape))
            if name == break_scale:
                scale = scale[:, :-1] if scale.shape[1] > 1 else np.ones((scale.shape[0], 2), np.float32)
            suffix = "_scale_inv" if block else "_scale"
            tensors[name], tensors[f"{name}{suffix}"] = values.view(np.uint8), scale if block else scale.reshape(())
        else:
            tensors[name] = w
    save_file({k: v for k, v in tensors.items() if v.dtype != np.uint8}, folder / "model.safetensors")
    _write_with_fp8(folder / "model.safetensors", tensors)


def _write_with_fp8(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file with F8_E4M3 tensors (safetensors' numpy writer has no fp8): the header
    names the dtype, the bytes follow."""
    header, chunks, offset = {}, [], 0
    for name, array in sorted(tensors.items()):
        kind = "F8_E4M3" if array.dtype == np.uint8 else {"float32": "F32"}[str(array.dtype)]
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(chunks))


def _held(llm) -> dict[str, np.ndarray]:
    return {path_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(llm.model_weights.state)}


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "qwen3-moe-fp8-128"
    _write_fp8(folder, FIXTURES / "qwen3-moe")
    return folder


def test_online_fp8_holds_the_bytes_of_a_checkpoint_written_in_that_format(fp8_folder):
    kwargs = dict(tensor_parallel_size=4, decode_context_parallel_size=2, kv_cache_memory_bytes=1 << 20)
    offline = _held(dcpjax.LLM(str(fp8_folder), **kwargs))
    online = _held(dcpjax.LLM(str(FIXTURES / "qwen3-moe"), quantization="fp8", **kwargs))
    assert offline.keys() == online.keys() and any(k.endswith(".scale") for k in offline)
    for name, values in offline.items():
        assert values.dtype == online[name].dtype and values.tobytes() == online[name].tobytes(), name


def test_device_bytes_stay_within_the_fp8_files_bytes(caplog):
    folder = FIXTURES / "deepseek-v3-fp8"
    with caplog.at_level(logging.INFO, logger="dcpjax.loader.model_loader"):
        llm = dcpjax.LLM(str(folder), kv_cache_memory_bytes=1 << 20)
    file_bytes = sum(v.nbytes for v in _file_tensors(folder / "model.safetensors").values())
    assert llm.weight_bytes_per_device <= 1.15 * file_bytes, (llm.weight_bytes_per_device, file_bytes)
    float_llm = dcpjax.LLM(str(folder), quantization="none", kv_cache_memory_bytes=1 << 20)
    # the float32 embeddings and LM head are two thirds of the fp8 file: its linear weights a quarter of float32
    assert llm.weight_bytes_per_device < 0.55 * float_llm.weight_bytes_per_device
    assert any(r.getMessage().startswith("Model weights: ") and "fp8 x" in r.getMessage() for r in caplog.records)


def _file_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    size = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + size])
    header.pop("__metadata__", None)
    return {name: np.empty(e["data_offsets"][1] - e["data_offsets"][0], np.uint8) for name, e in header.items()}


def test_a_scale_of_the_wrong_shape_is_refused_before_loading(tmp_path):
    bad = "model.layers.0.self_attn.o_proj.weight"
    _write_fp8(tmp_path / "bad", FIXTURES / "qwen3-moe", block=(16, 24), break_scale=bad)
    with pytest.raises(ValueError) as error:
        dcpjax.LLM(str(tmp_path / "bad"), kv_cache_memory_bytes=1 << 20)
    message = str(error.value)
    assert f"{bad}_scale_inv has shape (4, 5)" in message and "(64, 128)" in message
    assert "[16, 24]" in message and "(4, 6)" in message


def test_an_fp8_tensor_without_its_scale_is_refused(tmp_path):
    _write_fp8(tmp_path / "ok", FIXTURES / "qwen3-moe", block=(16, 24))
    path = tmp_path / "ok" / "model.safetensors"
    tensors = {name: array for name, array in _read_all(path).items() if name != "lm_head.weight_scale_inv"}
    drop = "model.layers.1.self_attn.v_proj.weight_scale_inv"
    _write_with_fp8(path, {k: v for k, v in tensors.items() if k != drop})
    with pytest.raises(ValueError, match="float8_e4m3fn tensors without their X.weight_scale_inv: .*v_proj.weight"):
        dcpjax.LLM(str(tmp_path / "ok"), kv_cache_memory_bytes=1 << 20)


def _read_all(path: pathlib.Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    out = {}
    for name, e in header.items():
        data = np.frombuffer(raw[8 + size + e["data_offsets"][0]:8 + size + e["data_offsets"][1]],
                             np.uint8 if e["dtype"] == "F8_E4M3" else np.float32)
        out[name] = data.reshape(e["shape"])
    return out


def test_an_unsupported_quantization_method_is_named(tmp_path):
    shutil.copytree(FIXTURES / "qwen3-moe", tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "awq", "bits": 4}}))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported; dcpjax reads fp8"):
        dcpjax.LLM(str(tmp_path / "awq"))


def test_the_planner_and_the_engine_count_the_same_bytes(tmp_path):
    """configs/deepseek-v3-tp8-dcp8.json at tiny scale: the planner's bytes per device (fp8 weights in
    its 128 x 128 blocks) equal what the engine holds on each device, measured from its arrays."""
    data = json.loads((pathlib.Path(dcpjax.__file__).parent / "configs" / "deepseek-v3-tp8-dcp8.json").read_text())
    tiny = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16,
                kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4,
                topk_group=2, first_k_dense_replace=1, max_position_embeddings=4096)
    data["model"] |= tiny
    path = tmp_path / "deepseek-v3-tiny.json"
    path.write_text(json.dumps(data))
    deployment = Deployment.from_file(path)
    assert deployment.weight_dtype == "float8_e4m3fn" and deployment.model.quantization.weight_block_size == (128, 128)
    planned = weight_bytes_per_device(deployment.model, deployment.parallel, deployment.weight_dtype)
    llm = dcpjax.LLM(str(path), load_format="dummy", quantization="fp8", dtype="bfloat16", tensor_parallel_size=8,
                     decode_context_parallel_size=8, kv_cache_memory_bytes=1 << 20)
    held = llm.weight_bytes_by_device()
    assert len(held) == 8 and len(set(held.values())) == 1
    assert abs(llm.weight_bytes_per_device - planned) <= 0.01 * planned
    assert llm.model_weights.weight_bytes_per_device == planned
    assert jax.numpy.dtype(llm.model_weights.state["layers"][2]["mlp"]["gate"]["values"].get_value().dtype) == \
        jax.numpy.float8_e4m3fn


def test_every_scaled_tensor_of_the_fixtures_is_held_fp8():
    """Nothing the fp8 files quantize is dequantized at load (a rule without groups would be)."""
    for name in ("deepseek-v3-fp8", "qwen3-moe-fp8"):
        folder = FIXTURES / name
        scaled = {n.removesuffix("_scale_inv") for n in _file_tensors(folder / "model.safetensors")
                  if n.endswith("_scale_inv")}
        llm = dcpjax.LLM(str(folder), tensor_parallel_size=8, decode_context_parallel_size=2,
                         kv_cache_memory_bytes=1 << 20)
        from dcpjax.loader.rules import model_rules

        rules = model_rules(llm.model_config, llm.parallel_config)
        read_by_held = {tensor for param in llm.model_weights.held for tensor in rules[param].tensors}
        assert scaled <= read_by_held, sorted(scaled - read_by_held)


def test_per_tensor_scales_are_read(tmp_path):
    """The per-tensor form (`X.weight_scale`, one float32 per tensor, no weight_block_size): held fp8,
    the same tokens as the same weights dequantized at load."""
    _write_fp8(tmp_path / "per-tensor", FIXTURES / "qwen3-moe", block=None)
    kwargs = dict(tensor_parallel_size=4, decode_context_parallel_size=2, kv_cache_memory_bytes=1 << 20)
    held = dcpjax.LLM(str(tmp_path / "per-tensor"), **kwargs)
    assert held.model_weights.held and all(h.format.per_tensor for h in held.model_weights.held.values())
    floats = dcpjax.LLM(str(tmp_path / "per-tensor"), quantization="none", **kwargs)
    params = dcpjax.SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42]}]
    got, want = held.generate(prompts, params)[0].outputs[0], floats.generate(prompts, params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        # the held matmul sums each block before its scale: float32 rounding apart, not bit for bit
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 5e-5 for t in a)


def test_random_weights_of_an_fp8_model_are_held_as_its_checkpoint_would_be():
    """load_format="dummy" on a config that ships fp8 holds fp8 under "auto", in its own blocks."""
    path = pathlib.Path(dcpjax.__file__).parent / "configs" / "deepseek-v3-tp8-dcp8.json"
    data = json.loads(path.read_text())
    cfg = Deployment.from_file(path).model
    assert cfg.quantization.weight_block_size == tuple(data["model"]["quantization_config"]["weight_block_size"])
    folder = FIXTURES / "deepseek-v3-fp8"  # its config ships fp8 in [16, 24] blocks
    llm = dcpjax.LLM(str(folder), load_format="dummy", kv_cache_memory_bytes=1 << 20)
    assert {h.format.block for h in llm.model_weights.held.values()} == {(16, 24)}


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int4"), "quantization must be one of"),
    (dict(quantization="gguf"), "quantization='gguf' holds a GGUF file's own quantized types"),
    (dict(quantization="fp8", orbax_checkpoint="/nonexistent"), "an orbax checkpoint holds the weights in the model"),
])
def test_quantization_mistakes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dcpjax.LLM(str(FIXTURES / "qwen3-moe"), kv_cache_memory_bytes=1 << 20, **kwargs)


def test_a_model_holding_quantized_weights_is_not_saved_as_floats(tmp_path):
    llm = dcpjax.LLM("tiny-llama", quantization="fp8", max_model_len=256, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="load it with quantization='none' to save it"):
        llm.save_checkpoint(str(tmp_path / "ckpt"))
