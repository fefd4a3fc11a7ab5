"""Weights held quantized on the devices (`dcpjax.quantization`, `dcpjax.loader.holding`):
every parameter's held values and scales dequantize exactly to the float weight the same
checkpoint gives when dequantized at load, on every mesh the families allow, for block sizes that
divide nothing (partial edge blocks, TP splits through blocks)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dcpjax.loader.holding import held_quantized, hold_quantized, pad_multiple, path_name
from dcpjax.loader.model_source import load_model_config
from dcpjax.loader.quantized_source import FloatSource, OnlineFp8Source
from dcpjax.loader.rules import model_rules
from dcpjax.loader.weights import load_state, random_checkpoint
from dcpjax.models.registry import build_model
from dcpjax.quantization.fp8 import dequantize_blocks, quantize_blocks
from dcpjax.quantization.weight import dequantize
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import make_mesh

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def _load_both(cfg, pc, block=None, source=None):
    """(held state, held, float state) of one checkpoint: `source`, or a random one quantized online
    in `block`s."""
    mesh = make_mesh(pc)
    source = source or OnlineFp8Source(random_checkpoint(cfg, pc, 0), block)
    rules = model_rules(cfg, pc)
    multiple = pad_multiple({source.format(name) for name in source.names()})
    graphdef, state = build_model(cfg, pc, jnp.float32, pad_multiple=multiple)
    held = held_quantized(rules, lambda name, shape: source.format(name), state, pc)
    _, held_state = hold_quantized(graphdef, state, held)
    held_state = load_state(held_state, rules, source, mesh, progress=False, held=held)
    float_state = load_state(build_model(cfg, pc, jnp.float32, pad_multiple=multiple)[1], rules, FloatSource(source),
                             mesh, progress=False)
    return held_state, held, float_state


def assert_held_equals_float(held_state, held, float_state):
    """Every held parameter dequantizes (jitted, as the model does) exactly to the float one, with
    the same sharding; every other parameter is the same array."""
    assert held, "nothing held quantized"
    floats = {path_name(p): v.get_value() for p, v in nnx.to_flat_state(float_state)}
    parts = {path_name(p): v.get_value() for p, v in nnx.to_flat_state(held_state)}
    for name, want in floats.items():
        if name in held:
            offset = parts.get(f"{name}.offset")
            got = jax.jit(dequantize, static_argnums=3)(parts[f"{name}.values"], parts[f"{name}.scale"], offset,
                                                        jnp.float32)
            assert got.sharding.is_equivalent_to(want.sharding, want.ndim), name
        else:
            got = parts[name]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("model, tp, dcp, block", [
    ("tiny-llama", 1, 1, (16, 24)),
    ("tiny-llama", 8, 2, (24, 16)),
    ("tiny-deepseek", 8, 8, (16, 24)),
    ("tiny-deepseek", 4, 2, (7, 5)),
    ("qwen3-next", 8, 4, (16, 24)),
    ("qwen3-next", 4, 2, (128, 128)),
    ("qwen3-moe", 8, 4, (24, 16)),
    ("ffw-90", 4, 2, (16, 24)),  # an FFW of 90 at TP 4: padded to 4 x 24 (not 4 x 23), whole blocks per device
])
def test_held_weights_dequantize_exactly_to_the_float_weights(model, tp, dcp, block):
    if model == "ffw-90":
        cfg = dataclasses.replace(load_model_config("tiny-llama"), intermediate_size=90)
    else:
        cfg = load_model_config(str(FIXTURES / model) if model.startswith("qwen") else model)
    pc = ParallelConfig(tp, dcp)
    held_state, held, float_state = _load_both(cfg, pc, block)
    assert_held_equals_float(held_state, held, float_state)
    if model == "ffw-90":
        assert held["layers.0.mlp.down"].groups == (24, 16)
        assert parts_shape(held_state, "layers.0.mlp.down.values") == (96, 64)
    # what the published files quantize is held so: every linear projection, nothing else
    assert all(".norm" not in name and "router" not in name and "embed" not in name for name in held)


def parts_shape(state, name):
    return next(tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state) if path_name(p) == name)


def test_fp8_blocks_round_trip_with_partial_edge_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70)).astype(np.float32) * np.linspace(0.01, 10, 70, dtype=np.float32)
    w[:16, :24] = 0  # an all-zero block keeps scale 1
    values, scale = quantize_blocks(w, (16, 24))
    assert values.dtype == jnp.float8_e4m3fn and values.shape == w.shape and scale.shape == (3, 3)
    assert scale[0, 0] == 1 and np.abs(values.astype(np.float32)).max() <= 448
    back = dequantize_blocks(values, scale, (16, 24))
    np.testing.assert_allclose(back, w, rtol=2 ** -3, atol=1e-6)  # e4m3 keeps 3 mantissa bits
    assert np.array_equal(dequantize_blocks(*quantize_blocks(back, (16, 24)), (16, 24)), back)  # a fixed point


@pytest.mark.parametrize("quantization, is_gguf, platform, kernel, level, held", [
    ("gguf", True, "cpu", False, "WARNING", True),  # asked for without the kernel: slower, said where it shows
    ("fp8", False, "cpu", False, "WARNING", True),
    ("auto", True, "cpu", False, None, False),  # auto dequantizes a GGUF on a CPU without the kernel
    ("auto", True, "cpu", True, None, True),  # with it, held: 1.45x at batch 1, 0.8-1.1x at 16 (RESULTS.md)
    ("gguf", True, "cpu", True, None, True),
    ("gguf", True, "gpu", False, None, True),
])
def test_a_slower_holding_on_cpu_says_why(quantization, is_gguf, platform, kernel, level, held, caplog, monkeypatch):
    from dcpjax.loader.quantized_source import FloatSource, quantized_source
    from dcpjax.loader.weights import DictSource
    from dcpjax.quantization import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "available", lambda: kernel)
    with caplog.at_level("INFO", logger="dcpjax.loader.quantized_source"):
        source = quantized_source(DictSource({}), quantization, is_gguf, None, None, platform)
    said = [r for r in caplog.records if "slower than quantization='none'" in r.getMessage()]
    assert [r.levelname for r in said] == ([level] if level else [])
    assert isinstance(source, FloatSource) != held
    if level:
        assert "without the compiled kernel" in said[0].getMessage()
