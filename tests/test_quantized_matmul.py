"""The one quantized matmul (`dcpjax.quantization.matmul`): every backend against a float64 numpy
`x @ dequantize(w)`, for every held format (GGUF int8 codes with float16 / float32 scales, with and
without minimums; fp8 e4m3 with 128-wide blocks along both axes), both layouts, odd shapes, rows of x
on each of the compiled kernel's paths, and a weight cut over TP devices through its blocks. The Pallas kernel
runs interpreted here (its GPU and TPU programs) and is lowered for CUDA and TPU from this CPU host."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax.quantization import cpu_kernel
from dcpjax.quantization.matmul import BACKEND_ENV, quantized_matmul, tile_rows
from dcpjax.quantization.pallas_matmul import gpu_fp8_problem, pallas_problem, quantized_matmul_pallas
from dcpjax.quantization.weight import uniform_group

BACKENDS = ["kernel", "tiled", "dequantize", "pallas"]


def oracle(x, values, scale, offset, transposed):
    """float64 x @ (values * scale + offset), the blocks spread over the elements."""
    (rows, cols), (sr, sc) = values.shape, scale.shape
    spread = lambda a: np.repeat(np.repeat(np.asarray(a, np.float64), rows // sr, 0), cols // sc, 1)
    w = np.asarray(values.astype(np.float32), np.float64) * spread(scale)
    if offset is not None:
        w = w + spread(offset)
    return np.asarray(x, np.float64) @ (w.T if transposed else w)


def bound(x, values, scale, offset, transposed):
    """float32 rounding's scale for each output: |x| @ |w| (a sum of K products, each rounded)."""
    absolute = lambda a: None if a is None else np.abs(np.asarray(a, np.float64))
    return oracle(np.abs(x), np.abs(values.astype(np.float32)), absolute(scale), absolute(offset), transposed)


def make(rng, m, k, n, gk, gn, transposed, fmt, scale_dtype, with_offset):
    x = rng.standard_normal((m, k)).astype(np.float32)
    shape, scales = ((n, k), (n // gn, k // gk)) if transposed else ((k, n), (k // gk, n // gn))
    if fmt == "int8":
        values = rng.integers(-32, 32, shape).astype(np.int8)
    else:
        values = np.asarray(jnp.asarray(rng.standard_normal(shape) * 64, jnp.float8_e4m3fn))
    scale = (rng.random(scales) * 0.02 + 0.001).astype(scale_dtype)
    offset = (rng.standard_normal(scales) * 0.02).astype(scale_dtype) if with_offset else None
    return x, values, scale, offset


CASES = [  # m, k, n, gk, gn, transposed, values, scale dtype, offset
    (1, 576, 1536, 32, 1, False, "int8", np.float16, True),  # SmolLM2's Q4_1 gate at decode
    (3, 96, 37, 32, 1, False, "int8", np.float16, True),  # the streaming path's last rows; N past the vectors
    (5, 64, 200, 16, 1, False, "int8", np.float32, False),  # register tiles (4 rows, then 1); Q6_K-like groups
    (9, 96, 61, 32, 1, False, "int8", np.float16, True),  # batch 9: buffered strips (>= 8 rows), minimums
    (17, 256, 45, 128, 15, False, "fp8", np.float32, False),  # buffered strips; fp8 blocks across columns
    (1, 256, 384, 128, 128, False, "fp8", np.float32, False),
    (2, 160, 50, 32, 1, True, "fp8", np.float32, False),  # a tied embedding table [N, K]
    (1, 128, 333, 32, 1, True, "int8", np.float16, True),
    (6, 96, 40, 32, 1, True, "int8", np.float16, False),
    (5, 64, 19, 32, 1, True, "int8", np.float16, True),  # a Q8_0-like table, 4 rows at a time, with minimums
    (4, 40, 24, 20, 8, True, "int8", np.float32, True),  # blocks that are not whole vectors
    (13, 96, 50, 32, 1, True, "int8", np.float16, True),  # a batch through a table: rows dequantized, 3 dotted
    (16, 256, 35, 128, 5, True, "fp8", np.float32, False),  # ... at a time, the last 2 alone; fp8 blocks across rows
    (40, 1024, 70, 32, 1, True, "int8", np.float16, True),  # 3 groups of 30 table rows x 5 blocks of 8 rows of x
    (1, 72, 40, 18, 1, False, "int8", np.float16, True),  # the stream's rows past its passes of four
    (9, 512, 48, 512, 1, False, "int8", np.float32, False),  # a group past the L1 buffer: register tiles
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(getattr(v, "__name__", str(v)) for v in c))
def test_equals_float64_within_float32_rounding(case, backend):
    if backend == "kernel" and not cpu_kernel.available():
        pytest.skip("no C++ compiler here: the compiled CPU kernel is not built")
    m, k, n, gk, gn, transposed, fmt, scale_dtype, with_offset = case
    x, values, scale, offset = make(np.random.default_rng(m * k + n), m, k, n, gk, gn, transposed, fmt,
                                    scale_dtype, with_offset)
    fn = jax.jit(lambda *a: quantized_matmul(*a, transposed=transposed, backend=backend, tile_bytes=4096))
    if backend == "pallas" and pallas_problem(k, n, gk, "gpu"):  # the kernel's tiles: said, not guessed
        with pytest.raises(ValueError, match="Pallas quantized matmul cannot tile"):
            fn(x, values, scale, offset)
        return
    assert_close_to_oracle(fn(x, values, scale, offset), x, values, scale, offset, transposed)


def assert_close_to_oracle(got, x, values, scale, offset, transposed):
    got = np.asarray(got, np.float64)
    assert got.shape == (x.shape[0], values.shape[0] if transposed else values.shape[1])
    np.testing.assert_array_less(np.abs(got - oracle(x, values, scale, offset, transposed)),
                                 4 * x.shape[1] * 2.0 ** -24 * bound(x, values, scale, offset, transposed) + 1e-30)


PALLAS_CASES = [  # m, k, n, gk, gn, transposed, values, scale dtype, offset, GPU K splits
    (1, 576, 1536, 32, 1, False, "int8", np.float16, True, 4),  # SmolLM2's gate; 18 groups as 5, 5, 5, 3
    (70, 512, 128, 64, 1, False, "int8", np.float32, True, 2),  # two blocks of 64 rows (GPU), 72 rows (TPU)
    (17, 256, 256, 128, 128, False, "fp8", np.float32, False, 2),
    (2, 160, 64, 32, 1, True, "fp8", np.float32, False, 5),  # a tied table: a split per group
    (3, 128, 48, 32, 1, True, "int8", np.float16, True, 1),
    (2, 448, 64, 32, 1, False, "int8", np.float16, True, 5),  # 14 groups: 3 a split, so 5 splits, none empty
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("case", PALLAS_CASES, ids=lambda c: "-".join(getattr(v, "__name__", str(v)) for v in c))
def test_pallas_programs_equal_float64(case, target):
    """Both Pallas programs, interpreted: the GPU one with its K splits (uneven ones too), the TPU one in
    one chunk of K (several: the test below)."""
    m, k, n, gk, gn, transposed, fmt, scale_dtype, with_offset, splits = case
    x, values, scale, offset = make(np.random.default_rng(k + n), m, k, n, gk, gn, transposed, fmt, scale_dtype,
                                    with_offset)
    got = quantized_matmul_pallas(jnp.asarray(x), values, scale, offset, transposed=transposed, group_k=gk,
                                  group_n=gn, target=target, interpret=True,
                                  num_splits=splits if target == "gpu" else None)
    assert_close_to_oracle(got, x, values, scale, offset, transposed)


def test_the_tpu_program_over_several_chunks_and_row_blocks():
    """300 rows (two blocks of 256) and K = 1024 in chunks of 256 (4 KiB of codes a step here): the output
    block accumulates over the sequential chunk axis."""
    x, values, scale, offset = make(np.random.default_rng(9), 300, 1024, 16, 32, 1, False, "int8", np.float16,
                                    True)
    got = quantized_matmul_pallas(jnp.asarray(x), values, scale, offset, transposed=False, group_k=32, group_n=1,
                                  target="tpu", interpret=True, tpu_chunk_bytes=256 * 16)
    assert_close_to_oracle(got, x, values, scale, offset, False)


def test_pallas_in_bfloat16_rounds_x_only():
    """bfloat16 activations (GPU / TPU models): the codes convert exactly, so the result is x rounded to
    bfloat16 times the weight, summed in float32."""
    x, values, scale, offset = make(np.random.default_rng(2), 4, 256, 64, 32, 1, False, "int8", np.float16, True)
    rounded = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    got = jax.jit(lambda *a: quantized_matmul(*a, backend="pallas"))(jnp.asarray(x, jnp.bfloat16), values, scale,
                                                                      offset)
    assert_close_to_oracle(got, rounded, values, scale, offset, False)


def test_the_environment_picks_pallas_where_it_tiles(monkeypatch):
    """$DCPJAX_QUANTIZED_MATMUL=pallas: "auto" runs the kernel on each weight it can tile and the
    platform's default on the rest (an engine's weights are cut in many shapes); a bad name is refused."""
    calls = []
    import dcpjax.quantization.pallas_matmul as module

    monkeypatch.setattr(module, "quantized_matmul_pallas",
                        lambda *a, **kw: calls.append(kw["group_k"]) or quantized_matmul_pallas(*a, **kw))
    monkeypatch.setenv(BACKEND_ENV, "pallas")
    rng = np.random.default_rng(4)
    for gk in (32, 20):  # 20: not a power of two, so the default path
        x, values, scale, offset = make(rng, 2, 160, 64, gk, 1, False, "int8", np.float16, True)
        assert_close_to_oracle(quantized_matmul(x, values, scale, offset), x, values, scale, offset, False)
    assert calls == [32]
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="DCPJAX_QUANTIZED_MATMUL must be one of"):
        quantized_matmul(x, values, scale)


def export_for(platform, device_kind, fn, *args):
    """Lower `fn` for another platform from this CPU host (an abstract device stands in)."""
    from test_kernels import export_for as export

    return export(platform, device_kind, fn, *args)


LOWERING_CASES = {  # x, values, scale, values dtype, minimums, transposed, gk, gn, x dtype
    "q4_1-gate-8b": ((1, 4096), (4096, 14336), (128, 14336), jnp.int8, True, False, 32, 1, jnp.bfloat16),
    "fp8-blocks-v3": ((16, 7168), (7168, 2048), (56, 16), jnp.float8_e4m3fn, False, False, 128, 128, jnp.bfloat16),
    "q8_0-tied-head": ((4, 576), (49152, 576), (49152, 18), jnp.int8, False, True, 32, 1, jnp.float32),
}


@pytest.mark.parametrize("platform, device_kind, target, marker", [
    ("cuda", "NVIDIA H200", "gpu", "__gpu$xla.gpu.triton"), ("tpu", "TPU v6 lite", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("case", list(LOWERING_CASES))
def test_pallas_lowers_for_gpu_and_tpu(case, platform, device_kind, target, marker):
    """The compiled (not interpreted) kernels lower at real sizes: Triton for CUDA, Mosaic for TPU."""
    xs, vs, ss, vdtype, minimums, transposed, gk, gn, xdtype = LOWERING_CASES[case]
    S = jax.ShapeDtypeStruct
    fn = lambda x, v, s, o: quantized_matmul_pallas(x, v, s, o, transposed=transposed, group_k=gk, group_n=gn,
                                                    target=target, interpret=False)
    exported = export_for(platform, device_kind, fn, S(xs, xdtype), S(vs, vdtype), S(ss, jnp.float16),
                          S(ss, jnp.float16) if minimums else None)
    assert marker in exported.mlir_module()


def test_the_kernel_builds_where_a_compiler_is():
    """With a C++ compiler on the machine the kernel must build: a broken build would otherwise only skip
    the kernel's cases above and send every held weight down the slower XLA path."""
    if cpu_kernel.DISABLE_ENV in os.environ or cpu_kernel._compiler() is None:
        pytest.skip("no C++ compiler here, or the kernel turned off")
    assert cpu_kernel.available()


@pytest.mark.parametrize("rows, transposed, path", [(2, False, "_kernel"), (32, True, "_kernel"),
                                                     (100, False, "_dequantize"), (100, True, "_kernel")])
def test_auto_backend_on_cpu_and_leading_axes(rows, transposed, path, monkeypatch):
    """"auto" on CPU: the kernel up to KERNEL_MAX_ROWS rows (decode); past them a Linear dequantized whole
    (prefill: XLA's GEMM wins) and a table [N, K] still through the kernel; x keeps its leading axes."""
    from dcpjax.quantization import matmul

    if not cpu_kernel.available():
        pytest.skip("no C++ compiler here: the compiled CPU kernel is not built")
    ran = []
    for name in ("_kernel", "_tiled"):  # platform_dependent traces the default (_dequantize) branch too
        original = getattr(matmul, name)
        monkeypatch.setattr(matmul, name, lambda *a, o=original, n=name: ran.append(n) or o(*a))
    x, values, scale, offset = make(np.random.default_rng(0), rows, 64, 48, 32, 1, transposed, "int8", np.float16,
                                    True)
    fn = jax.jit(lambda *a: quantized_matmul(*a, transposed=transposed))
    got = np.asarray(fn(x.reshape(2, rows // 2, 64), values, scale, offset))
    assert got.shape == (2, rows // 2, 48) and ran == ([] if path == "_dequantize" else [path])
    np.testing.assert_allclose(got.reshape(rows, 48), oracle(x, values, scale, offset, transposed), rtol=1e-5,
                               atol=1e-5)


def test_a_weight_cut_over_tp_devices_through_its_blocks():
    """fp8 [128, 128] blocks on a [256, 96] weight cut over 4 devices: column-parallel (24 columns each,
    inside one block) and row-parallel (64 rows each, half a block, summed by psum), as the loader holds
    them: each device's groups are its share of the block, the block's scale repeated."""
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    x, values, scale, _ = make(rng, 2, 256, 96, 128, 96, False, "fp8", np.float32, False)
    want = oracle(x, values, scale, None, False)
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    columns = np.repeat(scale, 4, axis=1)  # [2, 4]: one scale per device's 24 columns
    rows = np.repeat(scale, 2, axis=0)  # [4, 1]: one scale per device's 64 rows
    column_parallel = jax.jit(jax.shard_map(lambda x, v, s: quantized_matmul(x, v, s), mesh=mesh,
                                            in_specs=(P(), P(None, "tp"), P(None, "tp")), out_specs=P(None, "tp"),
                                            check_vma=False))  # as the model runner's
    row_parallel = jax.jit(jax.shard_map(lambda x, v, s: jax.lax.psum(quantized_matmul(x, v, s), "tp"), mesh=mesh,
                                         in_specs=(P(None, "tp"), P("tp"), P("tp")), out_specs=P(), check_vma=False))
    put = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, P(*spec)))
    got = column_parallel(put(x), put(values, None, "tp"), put(columns, None, "tp"))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = row_parallel(put(x, None, "tp"), put(values, "tp"), put(rows, "tp"))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_flattened_groups_and_tiles():
    assert uniform_group((9, 64), (1, 1)) == 1
    assert uniform_group((9, 64), (1, 32)) == 32  # blocks within each head
    assert uniform_group((8, 64), (2, 64)) == 128  # two whole heads per block
    assert uniform_group((8, 64), (2, 32)) is None  # 2-D blocks: not runs of one length
    assert tile_rows(1536, 576, 32, 1 << 20) == 384  # the most rows whose float32 copy fits 1 MiB, dividing K
    assert tile_rows(96, 1 << 20, 32, 1 << 20) == 32  # at least one group


def test_bad_input_says_what_is_wrong():
    x, values, scale, _ = make(np.random.default_rng(1), 1, 64, 8, 32, 1, False, "int8", np.float16, True)
    with pytest.raises(ValueError, match="x's last axis 63 is not the weight's K 64"):
        quantized_matmul(x[:, :63], values, scale)
    with pytest.raises(ValueError, match="does not divide values"):
        quantized_matmul(x, values, scale[:, :3])
    with pytest.raises(ValueError, match="backend must be one of"):
        quantized_matmul(x, values, scale, backend="cuda")
    assert "power of two >= 16" in pallas_problem(96, 64, 24, "gpu")
    assert "no column block" in pallas_problem(64, 40, 32, "gpu")
    assert "no column block" in pallas_problem(64, 1000, 32, "tpu")
    assert "within VMEM" in pallas_problem(11008, 512, 128, "tpu")  # fp8 groups, K not a multiple of 1024
    assert "compute capability >= 8.9" in gpu_fp8_problem("8.0")  # an A100: Triton cannot convert fp8
    assert gpu_fp8_problem("9.0") is None and gpu_fp8_problem(None) is None
