"""DeepSeek's sparse attention (DSA) under DCP against the float64 numpy oracle.

The lightning indexer scores every visible position, each DCP rank keeps its local top-k, one
all_gather merges them into the exact global top-k, and each rank attends over the selected
positions it owns before the LSE merge. Integer-valued inputs make every score exact in float32
and full of ties (ReLU's zeros, equal sums), so the merged top-k must equal the oracle's, ties
broken to the lowest position, at every DCP size, interleave and merge backend.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax import ParallelConfig, dcp_sparse_decode_attention, make_mesh, shard_kv_cache
from dcpjax.kernels.oracle import assert_close_to_oracle, attention_f64, index_scores_f64, top_k_f64
from dcpjax.sharding.traffic import dcp_collective_bytes, hlo_collective_bytes, top_k_merge_bytes

Q_HEADS, DK, DV = 16, 40, 32  # MLA's absorbed form: latent 32 + rope 8, V = K[..., :32]
INDEX_HEADS, INDEX_DIM, INDEX_SCALE = 4, 8, 0.25
TOP_K = 8
# lengths: 1, k - 1, k + 1, 4k, and longer than the table rounds (37), and an empty sequence
LENGTHS = (1, TOP_K - 1, TOP_K + 1, 4 * TOP_K, 37, 0)
SEQ = 40


def inputs(integer: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    batch = len(LENGTHS)
    if integer:  # small integers: exact scores, many ties
        ints = lambda shape, lo, hi: rng.integers(lo, hi + 1, shape).astype(np.float32)
        index_q, index_k = ints((batch, INDEX_HEADS, INDEX_DIM), -2, 2), ints((batch, SEQ, INDEX_DIM), -1, 1)
        weights = ints((batch, INDEX_HEADS), -1, 2)
    else:
        index_q = rng.standard_normal((batch, INDEX_HEADS, INDEX_DIM)).astype(np.float32)
        index_k = rng.standard_normal((batch, SEQ, INDEX_DIM)).astype(np.float32)
        weights = rng.standard_normal((batch, INDEX_HEADS)).astype(np.float32)
    q = rng.standard_normal((batch, Q_HEADS, DK)).astype(np.float32)
    latent = rng.standard_normal((batch, SEQ, 1, DK)).astype(np.float32)
    return q, latent, index_q, weights, index_k, np.array(LENGTHS, np.int32)


def oracle(q, latent, index_q, weights, index_k, lengths):
    scores = index_scores_f64(index_q, weights, index_k, lengths, INDEX_SCALE)
    top = top_k_f64(scores, TOP_K)
    visible = np.zeros(scores.shape, bool)
    for b, row in enumerate(top):
        visible[b, row[row >= 0]] = True
    out, lse = attention_f64(q, latent, latent[..., :DV], lengths, visible=visible)
    return top, out, lse


def run(tp, dcp, interleave, comm, block_size, integer, seed=0, backend="reference"):
    q, latent, index_q, weights, index_k, lengths = inputs(integer, seed)
    pc = ParallelConfig(tp, dcp, interleave, comm)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(latent, None, mesh, pc, block_size=block_size, v_head_dim=DV)
    index_cache = shard_kv_cache(index_k[:, :, None], None, mesh, pc, block_size=block_size, v_head_dim=INDEX_DIM)
    out, lse, top = dcp_sparse_decode_attention(q, cache, index_q, weights, index_cache, lengths, mesh, pc,
                                                top_k=TOP_K, index_scale=INDEX_SCALE, attention_backend=backend)
    return (np.asarray(out), np.asarray(lse), np.asarray(top)), oracle(q, latent, index_q, weights, index_k, lengths)


# (tp, dcp, interleave, comm, block_size)
LAYOUTS = [(1, 1, 1, "ag_rs", 4), (8, 8, 1, "ag_rs", 2), (8, 8, 1, "a2a", 2), (8, 4, 2, "a2a", 4),
           (4, 2, 1, "ag_rs", 4), (8, 2, 4, "a2a", 8), (2, 2, 1, "ag_rs", None)]


@pytest.mark.parametrize("integer", [True, False], ids=["ties", "random"])
@pytest.mark.parametrize("tp, dcp, interleave, comm, block_size", LAYOUTS)
def test_sparse_decode_matches_the_oracle(tp, dcp, interleave, comm, block_size, integer):
    (out, lse, top), (want_top, want_out, want_lse) = run(tp, dcp, interleave, comm, block_size, integer)
    np.testing.assert_array_equal(top, want_top)
    assert_close_to_oracle(out, lse, want_out, want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tp, dcp, interleave, comm, block_size", [(1, 1, 1, "ag_rs", 4), (8, 4, 2, "a2a", 4)])
def test_the_pallas_kernels_attend_over_the_gathered_selection(tp, dcp, interleave, comm, block_size):
    """The Pallas path: each query's selected tokens gathered into pages of their own, the dense kernel
    over them (interpreted on CPU)."""
    (out, lse, top), (want_top, want_out, want_lse) = run(tp, dcp, interleave, comm, block_size, True,
                                                          backend="pallas")
    np.testing.assert_array_equal(top, want_top)
    assert_close_to_oracle(out, lse, want_out, want_lse, atol=2e-5, rtol=1e-5)


def test_ties_are_broken_to_the_lowest_position():
    """Every score equal (all indexer keys zero: ReLU gives 0 everywhere): the first k positions win,
    whichever ranks own them."""
    q, latent, index_q, weights, index_k, lengths = inputs(integer=True)
    index_k[:] = 0.0
    pc = ParallelConfig(8, 8, 1, "ag_rs")
    mesh = make_mesh(pc)
    cache = shard_kv_cache(latent, None, mesh, pc, block_size=2, v_head_dim=DV)
    index_cache = shard_kv_cache(index_k[:, :, None], None, mesh, pc, block_size=2, v_head_dim=INDEX_DIM)
    _, _, top = dcp_sparse_decode_attention(q, cache, index_q, weights, index_cache, lengths, mesh, pc,
                                            top_k=TOP_K, index_scale=INDEX_SCALE)
    for length, row in zip(LENGTHS, np.asarray(top)):
        want = np.arange(min(length, TOP_K))
        np.testing.assert_array_equal(row[: len(want)], want)
        assert (row[len(want):] == -1).all()


def test_narrow_tables_take_the_dense_path():
    """No row can see more than k positions: the indexer is skipped, every visible position attends."""
    q, latent, index_q, weights, index_k, lengths = inputs(integer=False)
    short = np.minimum(lengths, 6)
    pc = ParallelConfig(2, 2)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(latent[:, :8], None, mesh, pc, block_size=2, v_head_dim=DV)
    index_cache = shard_kv_cache(index_k[:, :8, None], None, mesh, pc, block_size=2, v_head_dim=INDEX_DIM)
    out, lse, top = dcp_sparse_decode_attention(q, cache, index_q, weights, index_cache, short, mesh, pc,
                                                top_k=TOP_K, index_scale=INDEX_SCALE)
    want_out, want_lse = attention_f64(q, latent[:, :8], latent[:, :8, :, :DV], short)
    assert_close_to_oracle(out, lse, want_out, want_lse, atol=2e-5, rtol=1e-5)
    # nothing scored: every visible position in order (the sparse path would list them by score)
    np.testing.assert_array_equal(top, np.where(np.arange(TOP_K) < short[:, None], np.arange(TOP_K), -1))


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
def test_top_k_merge_bytes_are_the_compiled_steps(comm):
    """One sparse decode step, compiled: its collectives move the dense step's (query gather and LSE
    merge) plus the top-k all_gather, as `top_k_merge_bytes` says."""
    tp, dcp = 8, 4
    q, latent, index_q, weights, index_k, lengths = inputs(integer=False)
    pc = ParallelConfig(tp, dcp, 1, comm)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(latent, None, mesh, pc, block_size=4, v_head_dim=DV)
    index_cache = shard_kv_cache(index_k[:, :, None], None, mesh, pc, block_size=4, v_head_dim=INDEX_DIM)
    step = jax.jit(functools.partial(dcp_sparse_decode_attention, mesh=mesh, pc=pc, top_k=TOP_K,
                                     index_scale=INDEX_SCALE))
    hlo = step.lower(jnp.asarray(q), cache, jnp.asarray(index_q), jnp.asarray(weights), index_cache,
                     jnp.asarray(lengths)).compile().as_text()
    moved = sum(b for _, b in hlo_collective_bytes(hlo, dcp))
    batch = len(LENGTHS)
    dense = dcp_collective_bytes(tp=tp, dcp=dcp, q_heads=Q_HEADS, dk=DK, dv=DV, batch=batch, q_bytes=4, comm=comm)
    assert moved == pytest.approx(dense + top_k_merge_bytes(dcp=dcp, batch=batch, top_k=TOP_K))


def test_bad_arguments_are_named():
    q, latent, index_q, weights, index_k, lengths = inputs(integer=False)
    pc = ParallelConfig(2, 2)
    mesh = make_mesh(pc)
    cache = shard_kv_cache(latent, None, mesh, pc, block_size=4, v_head_dim=DV)
    index_cache = shard_kv_cache(index_k[:, :, None], None, mesh, pc, block_size=4, v_head_dim=INDEX_DIM)
    call = functools.partial(dcp_sparse_decode_attention, mesh=mesh, pc=pc, index_scale=INDEX_SCALE)
    with pytest.raises(ValueError, match="top_k must be a positive"):
        call(q, cache, index_q, weights, index_cache, lengths, top_k=0)
    with pytest.raises(ValueError, match="index_weights must be"):
        call(q, cache, index_q, weights[:, :2], index_cache, lengths, top_k=TOP_K)
    other = shard_kv_cache(index_k[:, :, None], None, mesh, pc, block_size=2, v_head_dim=INDEX_DIM)
    with pytest.raises(ValueError, match="index_cache must have the KV cache's blocks"):
        call(q, cache, index_q, weights, other, lengths, top_k=TOP_K)
