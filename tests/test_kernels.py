"""Attention kernels (reference and Pallas) against the float64 numpy oracle.

Every implementation takes the chunk form (q [B, T, Hq, dk], a paged `KVCache`,
lengths [B, T]); the decode cases (T = 1) go through `as_decode`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax.kernels import AttentionOptions, KVCache, attention, attention_pallas, decode_attention, quantize_fp8
from dcpjax.kernels.common import check_attention_args
from dcpjax.kernels.dispatch import resolve_backend
from dcpjax.kernels.oracle import assert_close_to_oracle, attention_f64

# name: (q_heads, kv_heads, dk, dv, latent) -- latent: MLA, V = K[..., :dv]
LAYOUTS = {
    "mha": (4, 4, 16, 16, False),
    "gqa": (12, 2, 16, 8, False),  # group of 6: not a power of two
    "mqa": (6, 1, 16, 16, False),
    "mla": (8, 1, 40, 32, True),  # latent 32 + rope 8
}
CHUNK_IMPLS = {
    "reference": lambda q, kv, n, sm_scale=None, starts=None, softcap=None: attention(
        q, kv, n, AttentionOptions(sm_scale, "reference", softcap=softcap), starts),
    "pallas": attention_pallas,  # the GPU (Triton) kernel, interpreted on CPU
    "pallas_tpu": lambda *a, **kw: attention_pallas(*a, target="tpu", **kw),  # Mosaic kernel, interpreted
}


def as_decode(impl):
    """One query per sequence: q [B, Hq, dk], lengths [B] on a chunk-form implementation."""
    def call(q, kv, lengths, **kw):
        out, lse = impl(q[:, None], kv, lengths[:, None], **kw)
        return out[:, 0], lse[:, 0]
    return call


IMPLS = {name: as_decode(impl) for name, impl in CHUNK_IMPLS.items()}


def make_inputs(layout, batch=3, seq=40, lengths=(40, 0, 17), seed=0, dtype=np.float32):
    q_heads, kv_heads, dk, dv, latent = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_heads, dk)).astype(dtype)
    k = rng.standard_normal((batch, seq, kv_heads, dk)).astype(dtype)
    v = None if latent else rng.standard_normal((batch, seq, kv_heads, dv)).astype(dtype)
    return q, k, v, np.array(lengths, np.int32), dv


def to_pages(x, block_size, seed=1):
    """[B, S, H, d] -> pages [N, bs, H, d] in a shuffled pool plus the block table."""
    batch, seq = x.shape[:2]
    per_seq = seq // block_size
    table = np.random.default_rng(seed).permutation(batch * per_seq + 2)[: batch * per_seq].reshape(batch, per_seq)
    pool = np.zeros((batch * per_seq + 2, block_size, *x.shape[2:]), x.dtype)
    for b in range(batch):
        for j in range(per_seq):
            pool[table[b, j]] = x[b, j * block_size : (j + 1) * block_size]
    return pool, table.astype(np.int32)


def make_kv(k, v, dv, paged=False, k_scale=None, v_scale=None) -> KVCache:
    """Contiguous [B, S, H, d] KV as a cache: shuffled pages of 8 (paged) or an identity table."""
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    if not paged:
        return KVCache.from_sequences(*map(as_jnp, (k, v)), v_head_dim=dv, k_scale=as_jnp(k_scale),
                                      v_scale=as_jnp(v_scale))
    heads_first = lambda x: None if x is None else jnp.moveaxis(jnp.asarray(x), 2, 0)  # [H, N, bs, d]
    k_pages, tables = to_pages(np.asarray(k), 8)
    v_pages = None if v is None else to_pages(np.asarray(v), 8)[0]
    return KVCache(heads_first(k_pages), heads_first(v_pages), block_tables=jnp.asarray(tables), v_head_dim=dv)


def run(impl, q, k, v, lengths, dv, paged=False, **kw):
    return IMPLS[impl](jnp.asarray(q), make_kv(k, v, dv, paged), jnp.asarray(lengths), **kw)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_matches_oracle(impl, paged, layout):
    q, k, v, lengths, dv = make_inputs(layout)
    out, lse = run(impl, q, k, v, lengths, dv, paged=paged, sm_scale=0.3)
    assert out.shape == (3, q.shape[1], dv) and lse.dtype == jnp.float32
    want = attention_f64(q, k, k[..., :dv] if v is None else v, lengths, sm_scale=0.3)
    assert_close_to_oracle(out, lse, *want, atol=2e-5)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_logit_softcap_matches_oracle(impl, layout):
    """Gemma 2's attention soft-cap: a scale large enough that tanh bends the scores."""
    q, k, v, lengths, dv = make_inputs(layout)
    out, lse = run(impl, q, k, v, lengths, dv, paged=True, sm_scale=2.0, softcap=5.0)
    values = k[..., :dv] if v is None else v
    assert_close_to_oracle(out, lse, *attention_f64(q, k, values, lengths, sm_scale=2.0, softcap=5.0), atol=2e-5)
    uncapped = attention_f64(q, k, values, lengths, sm_scale=2.0)[1]
    assert np.abs(np.asarray(lse)[lengths > 0] - uncapped[lengths > 0]).max() > 1.0  # the cap changed the answer


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_bfloat16_within_2e_2(impl, layout):
    q, k, v, lengths, dv = make_inputs(layout, dtype=np.float32)
    bf = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    q, k, v = bf(q), bf(k), bf(v)  # oracle sees exactly the bf16 inputs
    bf = lambda x: None if x is None else jnp.asarray(x, jnp.bfloat16)
    out, lse = IMPLS[impl](bf(q), make_kv(bf(k), bf(v), dv), jnp.asarray(lengths))
    assert out.dtype == jnp.bfloat16
    want = attention_f64(q, k, k[..., :dv] if v is None else v, lengths)
    assert_close_to_oracle(np.asarray(out, np.float32), lse, *want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_pallas_kv_splits_merge_exactly(splits):
    q, k, v, lengths, dv = make_inputs("gqa", seq=64, lengths=(64, 9, 0))
    out, lse = run("pallas", q, k, v, lengths, dv, paged=True, num_kv_splits=splits)
    assert_close_to_oracle(out, lse, *attention_f64(q, k, v, lengths), atol=2e-5)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_empty_sequences_give_zero_and_minus_inf(impl):
    q, k, v, lengths, dv = make_inputs("gqa", lengths=(0, 0, 0))
    out, lse = run(impl, q, k, v, lengths, dv)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_contiguous_length_not_a_power_of_two():
    # seq 45 pages as 45 single-token pages
    q, k, v, lengths, dv = make_inputs("mqa", seq=45, lengths=(45, 44, 1))
    out, lse = run("pallas", q, k, v, lengths, dv)
    assert_close_to_oracle(out, lse, *attention_f64(q, k, v, lengths), atol=2e-5)


def test_dispatcher():
    q, k, v, lengths, dv = make_inputs("gqa")
    kv, q, lengths = make_kv(k, v, dv), jnp.asarray(q), jnp.asarray(lengths)
    shapes = check_attention_args(q[:, None], kv, lengths[:, None])
    assert resolve_backend(AttentionOptions(), shapes, kv) == "reference"  # CPU
    ref = decode_attention(q, kv, lengths)
    pal = decode_attention(q, kv, lengths, AttentionOptions(backend="pallas"))
    np.testing.assert_allclose(np.asarray(ref[0]), np.asarray(pal[0]), atol=2e-5)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        decode_attention(q, kv, lengths, AttentionOptions(backend="flash"))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=np.zeros((3, 12))), "q must be"),
        (dict(lengths=np.zeros((2,), np.int32)), "lengths must be"),
        (dict(v=np.zeros((4, 40, 2, 8))), "must match k"),
        (dict(q=np.zeros((3, 11, 16), np.float32)), "multiple of kv_heads"),
        (dict(tables=np.zeros((2, 1), np.int32)), "block_tables must be"),
    ],
)
def test_bad_arguments_are_named(bad, match):
    q, k, v, lengths, dv = make_inputs("gqa")
    kv = make_kv(k, v, dv)
    if "v" in bad:
        kv = KVCache(kv.k, jnp.asarray(bad["v"]), block_tables=kv.block_tables)
    if "tables" in bad:
        kv = kv.with_block_tables(jnp.asarray(bad["tables"]))
    args = dict(q=q, lengths=lengths) | bad
    with pytest.raises(ValueError, match=match):
        decode_attention(jnp.asarray(args["q"]), kv, jnp.asarray(args["lengths"]),
                         AttentionOptions(backend="reference"))


def test_mla_needs_v_head_dim():
    q, k, _, lengths, _ = make_inputs("mla")
    kv = KVCache.from_sequences(jnp.asarray(k), None, v_head_dim=0)
    with pytest.raises(ValueError, match="v_head_dim"):
        decode_attention(jnp.asarray(q), kv, jnp.asarray(lengths))


def export_for(platform, device_kind, fn, *args):
    """Lower `fn` for another platform from this CPU host (an abstract device stands in)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    # Triton custom calls carry no serialization guarantee; we only inspect the module.
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


def lower_case(case, platform, device_kind, target):
    """Export the compiled kernel for (q [B, T, Hq, dk], k pool, v pool or None) shapes."""
    shapes, dtype, kw = case[0], case[1], dict(case[2])
    S = jax.ShapeDtypeStruct
    q, k, v = (None if s is None else S(s, dtype) for s in shapes)
    batch, queries = shapes[0][:2]
    dv = kw.pop("v_head_dim", 0) if v is None else shapes[2][-1]

    def fn(q, k, v, n, t):
        return attention_pallas(q, KVCache(k, v, block_tables=t, v_head_dim=dv), n, interpret=False, target=target,
                                **kw)

    return export_for(platform, device_kind, fn, q, k, v, S((batch, queries), jnp.int32), S((batch, 64), jnp.int32))


GPU_CASES = {
    # Qwen3-235B-like group of 16 (64 q heads / 4 KV heads), decode
    "gqa-bf16": (((4, 1, 64, 128), (4, 256, 16, 128), (4, 256, 16, 128)), jnp.bfloat16, {}),
    "gqa-f32": (((4, 1, 64, 128), (4, 256, 16, 128), (4, 256, 16, 128)), jnp.float32, {}),
    # a 16-token chunk: 1024 (query, head) rows per KV head, several row blocks
    "gqa-chunk-16-bf16": (((2, 16, 64, 128), (4, 256, 16, 128), (4, 256, 16, 128)), jnp.bfloat16, {}),
    # DeepSeek-V3-like latent 512 + rope 64, decode and a 4-token chunk
    "mla-bf16": (((4, 1, 16, 576), (1, 256, 16, 576), None), jnp.bfloat16, dict(v_head_dim=512, sm_scale=0.1)),
    "mla-chunk-4-bf16": (((4, 4, 16, 576), (1, 256, 16, 576), None), jnp.bfloat16, dict(v_head_dim=512)),
}


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_pallas_lowers_for_gpu_with_triton(case):
    """The compiled (non-interpret) kernel lowers to a Triton GPU kernel at real sizes."""
    exported = lower_case(GPU_CASES[case], "cuda", "NVIDIA H200", "gpu")
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


TPU_CASES = {
    "gqa-8-heads-bf16": (((4, 1, 64, 128), (8, 256, 16, 128), (8, 256, 16, 128)), jnp.bfloat16, {}),
    "dcp-rank-1-head-f32": (((4, 1, 16, 128), (1, 256, 16, 128), (1, 256, 16, 128)), jnp.float32, {}),
    "gqa-chunk-16-bf16": (((2, 16, 64, 128), (8, 256, 16, 128), (8, 256, 16, 128)), jnp.bfloat16, {}),
    # heads-first pools: 4 KV heads of width 64 tile too (the block spans the two minor axes)
    "gqa-4-heads-d64-bf16": (((4, 1, 32, 64), (4, 256, 16, 64), (4, 256, 16, 64)), jnp.bfloat16, {}),
    "mla-bf16": (((4, 1, 128, 576), (1, 256, 16, 576), None), jnp.bfloat16, dict(v_head_dim=512, sm_scale=0.1)),
    # 1024 rows of width 576: several row blocks of 224
    "mla-chunk-8-bf16": (((2, 8, 128, 576), (1, 256, 16, 576), None), jnp.bfloat16, dict(v_head_dim=512)),
}


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("case", list(TPU_CASES))
def test_pallas_lowers_for_tpu_with_mosaic(case, device_kind):
    exported = lower_case(TPU_CASES[case], "tpu", device_kind, "tpu")
    assert "tpu_custom_call" in exported.mlir_module()


def test_tpu_tiling_rules_are_explained():
    q, k, v, lengths, _ = make_inputs("gqa")
    pages_of_4 = KVCache.from_sequences(jnp.asarray(k), jnp.asarray(v), page=4)
    with pytest.raises(ValueError, match="block_size must be a multiple of 8"):
        IMPLS["pallas_tpu"](jnp.asarray(q), pages_of_4, jnp.asarray(lengths), interpret=False)


def test_oracle_against_a_hand_computed_case():
    """The oracle itself: two tokens, one head, scores 0 and log 3 -> weights 1/4, 3/4."""
    q = np.array([[[1.0, 0.0]]])
    k = np.array([[[[0.0, 0.0]], [[np.log(3.0), 0.0]], [[9.0, 9.0]]]])
    v = np.array([[[[4.0]], [[8.0]], [[100.0]]]])
    out, lse = attention_f64(q, k, v, np.array([2]), sm_scale=1.0)
    np.testing.assert_allclose(out, [[[4.0 * 0.25 + 8.0 * 0.75]]])
    np.testing.assert_allclose(lse, [[np.log(4.0)]])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("impl", list(CHUNK_IMPLS))
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_chunk_form_gives_each_query_its_own_causal_bound(layout, impl, paged):
    """A prefill chunk: query t of sequence b sees tokens < lengths[b, t] (0 for padding)."""
    q, k, v, _, dv = make_inputs(layout, seq=40)
    chunk = np.random.default_rng(3).standard_normal((3, 5, *q.shape[1:])).astype(np.float32)
    lengths = np.array([[36, 37, 38, 39, 40], [1, 2, 3, 0, 0], [0, 0, 0, 0, 0]], np.int32)
    out, lse = CHUNK_IMPLS[impl](jnp.asarray(chunk), make_kv(k, v, dv, paged), jnp.asarray(lengths))
    assert out.shape == (3, 5, q.shape[1], dv) and lse.shape == (3, 5, q.shape[1])
    values = k[..., :dv] if v is None else v
    want = attention_f64(chunk.reshape(15, *q.shape[1:]), np.repeat(k, 5, axis=0), np.repeat(values, 5, axis=0),
                         lengths.reshape(-1))
    assert_close_to_oracle(np.asarray(out).reshape(15, *out.shape[2:]), np.asarray(lse).reshape(15, -1), *want,
                           atol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("impl", list(CHUNK_IMPLS))
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_starts_give_each_query_of_a_packed_row_its_own_sequence(layout, impl, paged):
    """A packed row: three sequences' KV back to back in one row's pages ([0, 16), [16, 24),
    [24, 40)); each query sees only its own sequence's tokens, [start, bound), and a padding
    query nothing. Each query checked against the oracle over its own sequence alone."""
    q, k, v, _, dv = make_inputs(layout, batch=1, seq=40)
    values = k[..., :dv] if v is None else v
    chunk = np.random.default_rng(6).standard_normal((1, 8, *q.shape[1:])).astype(np.float32)
    starts = np.array([[0, 0, 0, 16, 16, 24, 24, 0]], np.int32)
    bounds = np.array([[14, 15, 16, 21, 24, 34, 40, 0]], np.int32)
    out, lse = CHUNK_IMPLS[impl](jnp.asarray(chunk), make_kv(k, v, dv, paged), jnp.asarray(bounds),
                                 starts=jnp.asarray(starts))
    for t in range(8):
        s, b = starts[0, t], bounds[0, t]
        want = attention_f64(chunk[:, t], k[:, s:], values[:, s:], np.array([b - s]))
        assert_close_to_oracle(np.asarray(out)[:, t], np.asarray(lse)[:, t], *want, atol=2e-5)


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
def test_query_tiles_split_into_row_blocks(impl):
    """A 16-token chunk of a 12-head group (192 rows) in blocks of 16 or 24 rows: each block
    walks the pages up to its own longest bound; every row still gets its own causal bound."""
    q, k, v, _, dv = make_inputs("gqa", seq=64)
    chunk = np.random.default_rng(4).standard_normal((3, 16, *q.shape[1:])).astype(np.float32)
    lengths = np.stack([np.arange(49, 65), np.arange(1, 17), np.where(np.arange(16) < 5, np.arange(1, 17), 0)])
    block_rows = 16 if impl == "pallas" else 24
    out, lse = CHUNK_IMPLS[impl](jnp.asarray(chunk), make_kv(k, v, dv, paged=True), jnp.asarray(lengths, jnp.int32),
                                 block_rows=block_rows)
    want = attention_f64(chunk.reshape(48, *q.shape[1:]), np.repeat(k, 16, axis=0), np.repeat(v, 16, axis=0),
                         lengths.reshape(-1))
    assert_close_to_oracle(np.asarray(out).reshape(48, *out.shape[2:]), np.asarray(lse).reshape(48, -1), *want,
                           atol=2e-5)


def _quantize(x):
    values, scales = quantize_fp8(jnp.asarray(x))
    return values, scales


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_fp8_cache_accuracy_against_float32(layout):
    """e4m3 K/V with a scale per token and head: every implementation within 4% relative RMS of
    float32, and all of them equal to each other (they dequantise the same way)."""
    q, k, v, _, dv = make_inputs(layout, seq=64)
    chunk = np.random.default_rng(5).standard_normal((3, 4, *q.shape[1:])).astype(np.float32)
    lengths = jnp.asarray([[61, 62, 63, 64], [1, 2, 3, 4], [0, 9, 0, 17]], jnp.int32)
    k8, k_scale = _quantize(k)
    v8, v_scale = (None, None) if v is None else _quantize(v)
    exact, _ = CHUNK_IMPLS["reference"](jnp.asarray(chunk), make_kv(k, v, dv), lengths)
    quantized = make_kv(k8, v8, dv, k_scale=k_scale, v_scale=v_scale)
    results = {name: impl(jnp.asarray(chunk), quantized, lengths)[0] for name, impl in CHUNK_IMPLS.items()}
    for name, out in results.items():
        error = np.sqrt(np.mean((np.asarray(out) - np.asarray(exact)) ** 2) / np.mean(np.asarray(exact) ** 2))
        assert error < 0.04, (name, error)
        np.testing.assert_allclose(np.asarray(out), np.asarray(results["reference"]), atol=2e-5)


def test_fp8_pallas_lowers_for_gpu_and_tpu():
    S = jax.ShapeDtypeStruct
    args = (S((4, 2, 16, 576), jnp.bfloat16), S((1, 256, 16, 576), jnp.float8_e4m3fn), S((4, 2), jnp.int32),
            S((4, 64), jnp.int32), S((1, 256, 16), jnp.float32))
    for platform, kind, target, marker in (("cuda", "NVIDIA H200", "gpu", "__gpu$xla.gpu.triton"),
                                           ("tpu", "TPU v6 lite", "tpu", "tpu_custom_call")):
        def fn(q, k, n, t, s, target=target):
            return attention_pallas(q, KVCache(k, None, k_scale=s, block_tables=t, v_head_dim=512), n,
                                    interpret=False, target=target)
        assert marker in export_for(platform, kind, fn, *args).mlir_module()


def test_fp8_scales_and_tiles_are_checked():
    """A cache whose fp8 scales do not match its pools, or a tile that cannot split the rows,
    is an error naming it, never a silent mix-up."""
    q, k, v, lengths, dv = make_inputs("gqa", seq=64)
    k8, k_scale = _quantize(k)
    v8, _ = _quantize(v)
    q, lengths = jnp.asarray(q), jnp.asarray(lengths)
    with pytest.raises(ValueError, match="needs v_scale"):
        decode_attention(q, make_kv(k8, v8, dv, k_scale=k_scale), lengths)
    with pytest.raises(ValueError, match="fp8 cache needs k_scale"):
        decode_attention(q, make_kv(k8, v8, dv), lengths)
    with pytest.raises(ValueError, match="needs k_scale"):
        make_kv(k8, v8, dv).write(jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 8)), jnp.zeros((1,), jnp.int32))
    kv, chunk, bounds = make_kv(k, v, dv, paged=True), jnp.repeat(q[:, None], 8, axis=1), jnp.full((3, 8), 5)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):  # 8 x 6 rows, padded to 64
        CHUNK_IMPLS["pallas"](chunk, kv, bounds, block_rows=24)
    with pytest.raises(ValueError, match="multiple of 8"):
        CHUNK_IMPLS["pallas_tpu"](chunk, kv, bounds, block_rows=12)
