"""DCP decode attention on the ("tp", "dcp") mesh against the float64 numpy oracle.

Every case builds the unsplit KV, shards it with `shard_kv_cache`, runs
`dcp_decode_attention`, and compares with single-device attention; so DCP = k
is equal to DCP = 1 through the same oracle.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax import ParallelConfig, append_kv, dcp_decode_attention, empty_kv_cache, make_mesh, shard_kv_cache
from dcpjax.kernels.oracle import assert_close_to_oracle, attention_f64

# name: (q_heads, kv_heads, dk, dv, latent)
LAYOUTS = {
    "mha": (8, 8, 16, 16, False),
    "gqa": (24, 2, 16, 8, False),  # 12 q heads per KV head
    "mqa": (24, 1, 16, 16, False),
    "mla": (16, 1, 40, 32, True),  # latent 32 + rope 8; V = K[..., :32]
}
MESHES = [(1, 1), (2, 2), (4, 2), (8, 2), (8, 4), (8, 8), (4, 4), (8, 1), (4, 1)]


def inputs(layout, batch=3, seq=37, lengths=(37, 5, 0), seed=0):
    q_heads, kv_heads, dk, dv, latent = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_heads, dk)).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, dk)).astype(np.float32)
    v = None if latent else rng.standard_normal((batch, seq, kv_heads, dv)).astype(np.float32)
    return q, k, v, np.array(lengths, np.int32), dv


def oracle(q, k, v, lengths, dv, sm_scale=None, window=None):
    return attention_f64(q, k, k[..., :dv] if v is None else v, lengths, sm_scale, window)


def run_dcp(layout, tp, dcp, interleave=1, comm="ag_rs", block_size=None, backend="auto", window=None, **input_kw):
    q, k, v, lengths, dv = inputs(layout, **input_kw)
    pc = ParallelConfig(tp, dcp, interleave, comm)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(k, v, mesh, pc, block_size=block_size, v_head_dim=dv if v is None else None)
    out, lse = dcp_decode_attention(q, cache, lengths, mesh, pc, return_lse=True, attention_backend=backend,
                                    sliding_window=window)
    return (np.asarray(out), np.asarray(lse)), oracle(q, k, v, lengths, dv, window=window)


def is_valid(layout, tp, dcp):
    q_heads, kv_heads, _, _, latent = LAYOUTS[layout]
    return not ParallelConfig(tp, dcp).model_rule_violations(q_heads, kv_heads, latent)


# a2a needs DCP > 1 (rejected at construction, tested in test_config)
MESH_COMMS = [(tp, dcp, comm) for tp, dcp in MESHES for comm in ("ag_rs", "a2a") if dcp > 1 or comm == "ag_rs"]


@pytest.mark.parametrize("tp, dcp, comm", MESH_COMMS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_matrix(layout, tp, dcp, comm):
    if not is_valid(layout, tp, dcp):
        with pytest.raises(ValueError, match="Rule|rule"):
            run_dcp(layout, tp, dcp, comm=comm)
        return
    got, want = run_dcp(layout, tp, dcp, comm=comm)
    assert_close_to_oracle(*got, *want, atol=2e-5)


def test_matrix_covers_every_layout_on_a_dcp_mesh():
    for layout in LAYOUTS:
        if layout != "mha":
            assert any(is_valid(layout, tp, dcp) for tp, dcp in MESHES if dcp > 1), layout


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("interleave", [1, 2, 16, 3])  # 3 does not divide 37
@pytest.mark.parametrize("layout, tp, dcp", [("gqa", 8, 4), ("mla", 8, 8)])
def test_interleave_sizes(layout, tp, dcp, interleave, block_size):
    if block_size is not None and block_size % interleave:
        block_size = interleave * 2
    got, want = run_dcp(layout, tp, dcp, interleave=interleave, block_size=block_size)
    assert_close_to_oracle(*got, *want, atol=2e-5)


@pytest.mark.parametrize("interleave", [1, 2])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("layout", ["mqa", "mla"])
def test_tiny_lengths_leave_shards_empty(layout, comm, interleave):
    got, want = run_dcp(layout, 8, 8, interleave=interleave, comm=comm, batch=4, seq=4, lengths=(0, 1, 2, 3))
    assert_close_to_oracle(*got, *want, atol=2e-5)
    assert np.all(got[0][0] == 0) and np.all(np.isneginf(got[1][0]))


# windows wider than, equal to and narrower than one round of DCP x I positions: with 8 ranks and
# interleave 2 a window of 3 leaves at least 6 ranks with nothing inside it (the merge's identity)
@pytest.mark.parametrize("window", [1, 3, 16, 36, 64])
@pytest.mark.parametrize("layout, tp, dcp, comm, interleave, block_size", [
    ("gqa", 8, 4, "ag_rs", 1, None), ("mqa", 8, 8, "a2a", 2, 4), ("mla", 8, 8, "ag_rs", 16, 16),
    ("mqa", 4, 1, "ag_rs", 1, 8)])
def test_sliding_window(layout, tp, dcp, comm, interleave, block_size, window):
    got, want = run_dcp(layout, tp, dcp, comm=comm, interleave=interleave, block_size=block_size, window=window,
                        batch=4, lengths=(37, 5, 0, 36))
    assert_close_to_oracle(*got, *want, atol=2e-5)


@pytest.mark.parametrize("block_size", [None, 8])
def test_sliding_window_pallas(block_size):
    got, want = run_dcp("gqa", 4, 2, interleave=2, block_size=block_size, backend="pallas", window=9, seq=32,
                        lengths=(32, 7, 0))
    assert_close_to_oracle(*got, *want, atol=2e-5)


def test_sliding_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window"):
        run_dcp("gqa", 4, 2, window=0)


@pytest.mark.parametrize("layout, tp, dcp", [("gqa", 8, 4), ("mla", 8, 8), ("mqa", 4, 2)])
def test_ag_rs_equals_a2a(layout, tp, dcp):
    kw = dict(batch=4, seq=50, lengths=(50, 13, 1, 0), interleave=2)
    (out_ag, lse_ag), _ = run_dcp(layout, tp, dcp, comm="ag_rs", **kw)
    (out_a2a, lse_a2a), _ = run_dcp(layout, tp, dcp, comm="a2a", **kw)
    np.testing.assert_allclose(out_ag, out_a2a, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse_ag), np.isneginf(lse_a2a))


@pytest.mark.parametrize("block_size", [None, 8])
@pytest.mark.parametrize("layout, tp, dcp", [("gqa", 4, 2), ("mla", 8, 8)])
def test_pallas_backend_inside_shard_map(layout, tp, dcp, block_size):
    got, want = run_dcp(layout, tp, dcp, interleave=2, block_size=block_size, backend="pallas", seq=32,
                        lengths=(32, 7, 0))
    assert_close_to_oracle(*got, *want, atol=2e-5)


@pytest.mark.parametrize("layout, tp, dcp", [("gqa", 8, 2), ("mla", 8, 8)])
def test_bfloat16(layout, tp, dcp):
    q, k, v, lengths, dv = inputs(layout)
    bf = lambda x: None if x is None else jnp.asarray(x, jnp.bfloat16)
    pc = ParallelConfig(tp, dcp)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(bf(k), bf(v), mesh, pc, v_head_dim=dv if v is None else None)
    out, lse = dcp_decode_attention(bf(q), cache, lengths, mesh, pc, return_lse=True)
    assert out.dtype == jnp.bfloat16
    f32 = lambda x: None if x is None else np.asarray(bf(x).astype(jnp.float32))
    want = oracle(f32(q), f32(k), f32(v), lengths, dv)
    assert_close_to_oracle(np.asarray(out, np.float32), lse, *want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("layout, tp, dcp, interleave", [("gqa", 8, 4, 2), ("mla", 8, 8, 1), ("gqa", 8, 2, 3)])
def test_append_one_token_at_a_time(layout, tp, dcp, interleave, block_size):
    """Tokens appended one by one across interleave and block boundaries equal full attention."""
    if block_size is not None:
        block_size = interleave * 2
    q, k, v, _, dv = inputs(layout, batch=2, seq=30)
    pc = ParallelConfig(tp, dcp, interleave)
    mesh = make_mesh(pc)
    _, kv_heads, dk, _, latent = LAYOUTS[layout]
    cache = empty_kv_cache(
        mesh, pc, batch=2, capacity=30, num_kv_heads=kv_heads, head_dim=dk, v_head_dim=dv,
        use_mla=latent, dtype=jnp.float32, block_size=block_size,
    )
    offsets = np.array([0, 3])  # ragged: sequence 1 starts 3 tokens later
    for step in range(30):
        positions = np.maximum(step - offsets, 0)
        active = step >= offsets
        new_k = k[np.arange(2), positions]
        new_v = None if v is None else v[np.arange(2), positions]
        # an inactive sequence rewrites its position 0 with its own token: harmless
        cache = append_kv(cache, new_k, new_v, positions.astype(np.int32), mesh, pc)
        lengths = np.where(active, positions + 1, 1).astype(np.int32)
        if step in (0, 1, 2, 5, 7, 8, 13, 29):
            out, lse = dcp_decode_attention(q, cache, lengths, mesh, pc, return_lse=True)
            assert_close_to_oracle(out, lse, *oracle(q, k, v, lengths, dv), atol=2e-5)


def test_kv_bytes_per_device_fall_with_dcp():
    """TP 8 with 2 KV heads duplicates each head 4x; DCP 4 removes the duplicates."""
    _, k, v, _, _ = inputs("gqa", seq=64, lengths=(64, 64, 64))
    sizes = {}
    for dcp in (1, 2, 4):
        pc = ParallelConfig(8, dcp)
        sizes[dcp] = shard_kv_cache(k, v, make_mesh(pc), pc).bytes_per_device()
    assert sizes[1] == 2 * sizes[2] == 4 * sizes[4]


def test_errors_are_named():
    q, k, v, lengths, _ = inputs("gqa")
    pc = ParallelConfig(8, 4)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(k, v, mesh, pc, capacity=40)
    with pytest.raises(ValueError, match="does not match"):
        dcp_decode_attention(q, cache, lengths, make_mesh(ParallelConfig(8, 2)), pc)
    with pytest.raises(ValueError, match="q must be"):
        dcp_decode_attention(q[..., :8], cache, lengths, mesh, pc)
    with pytest.raises(ValueError, match="lengths must be"):
        dcp_decode_attention(q, cache, lengths[:2], mesh, pc)
    with pytest.raises(ValueError, match="attention_backend"):
        dcp_decode_attention(q, cache, lengths, mesh, pc, attention_backend="cuda")
    with pytest.raises(ValueError, match=r"positions must lie in \[0, capacity=40\)"):
        append_kv(cache, k[:, 0], v[:, 0], np.array([40, 0, 0], np.int32), mesh, pc)
    with pytest.raises(ValueError, match="capacity"):
        shard_kv_cache(k, v, mesh, pc, capacity=10)
    with pytest.raises(ValueError, match="block_size % cp_kv_cache_interleave_size"):
        pc2 = ParallelConfig(8, 4, 4)
        shard_kv_cache(k, v, make_mesh(pc2), pc2, block_size=6)
    with pytest.raises(ValueError, match="distinct blocks"):
        shard_kv_cache(k, v, mesh, pc, block_size=4, block_tables=np.zeros((3, 4), np.int32))


@pytest.mark.parametrize("layout, tp, dcp", [("gqa", 8, 2), ("mla", 8, 4)])
def test_fp8_cache_through_the_public_op(layout, tp, dcp):
    """empty_kv_cache(dtype=float8_e4m3fn) + append_kv quantises with a scale per token and head:
    decode stays within fp8's error of the float32 oracle."""
    q, k, v, _, dv = inputs(layout, batch=2, seq=12)
    pc = ParallelConfig(tp, dcp)
    mesh = make_mesh(pc)
    _, kv_heads, dk, _, latent = LAYOUTS[layout]
    cache = empty_kv_cache(mesh, pc, batch=2, capacity=16, num_kv_heads=kv_heads, head_dim=dk, v_head_dim=dv,
                           use_mla=latent, dtype=jnp.float8_e4m3fn)
    assert cache.k.dtype == jnp.float8_e4m3fn and cache.k_scale is not None
    for pos in range(12):
        new_v = None if v is None else v[:, pos]
        cache = append_kv(cache, k[:, pos], new_v, np.full(2, pos, np.int32), mesh, pc)
    lengths = np.array([12, 7], np.int32)
    out = np.asarray(dcp_decode_attention(q, cache, lengths, mesh, pc))
    want, _ = oracle(q, k, v, lengths, dv)
    assert np.sqrt(np.mean((out - want) ** 2) / np.mean(want**2)) < 0.04
