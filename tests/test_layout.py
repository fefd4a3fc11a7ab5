import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpjax.sharding import layout

dcps = st.sampled_from([1, 2, 3, 4, 8])
interleaves = st.sampled_from([1, 2, 3, 16])


@settings(max_examples=60, deadline=None)
@given(dcp=dcps, interleave=interleaves, length=st.integers(0, 300))
def test_one_owner_dense_local_indices_and_lengths(dcp, interleave, length):
    pos = np.arange(length)
    owner = np.asarray(layout.owner_rank(pos, dcp, interleave))
    local = np.asarray(layout.local_index(pos, dcp, interleave))
    assert ((owner >= 0) & (owner < dcp)).all()
    total = 0
    for rank in range(dcp):
        mine = np.sort(local[owner == rank])
        n = int(layout.local_length(length, rank, dcp, interleave))
        # dense: a rank's positions fill local indices 0..n-1 with no gap or repeat
        np.testing.assert_array_equal(mine, np.arange(n))
        # inverse mapping
        back = np.asarray(layout.global_position(np.arange(n), rank, dcp, interleave))
        np.testing.assert_array_equal(np.sort(back), np.sort(pos[owner == rank]))
        total += n
    assert total == length


@settings(max_examples=30, deadline=None)
@given(dcp=dcps, interleave=st.sampled_from([1, 2, 4]), capacity=st.integers(1, 200))
def test_local_capacity_holds_every_position(dcp, interleave, capacity):
    cap = layout.local_capacity(capacity, dcp, interleave)
    assert int(np.max(layout.local_index(np.arange(capacity), dcp, interleave))) < cap


def test_runs_of_interleave_tokens_and_examples():
    # I=2, DCP=4: positions 0,1 -> rank 0; 2,3 -> rank 1; ... 8,9 -> rank 0 at local 2,3
    assert list(np.asarray(layout.owner_rank(np.arange(10), 4, 2))) == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    assert list(np.asarray(layout.local_index(np.arange(10), 4, 2))) == [0, 1, 0, 1, 0, 1, 0, 1, 2, 3]
    assert [int(layout.local_length(3, r, 8, 1)) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(
    dcp=dcps,
    interleave=st.sampled_from([1, 2, 4]),
    blocks_per_interleave=st.integers(1, 3),
    length=st.integers(1, 150),
    seed=st.integers(0, 1000),
)
def test_paged_slot_mapping(dcp, interleave, blocks_per_interleave, length, seed):
    block_size = interleave * blocks_per_interleave
    batch = 2
    need = layout.blocks_needed(length, block_size, dcp)
    table = np.random.default_rng(seed).permutation(batch * need + 3)[: batch * need].reshape(batch, need)
    pos = np.broadcast_to(np.arange(length), (batch, length))
    seen = set()
    for rank in range(dcp):
        slots = np.asarray(layout.paged_slot_mapping(pos, table, rank, block_size, dcp, interleave))
        owned = np.asarray(layout.owner_rank(pos, dcp, interleave)) == rank
        assert (slots[~owned] == layout.PAD_SLOT).all()
        assert (slots[owned] >= 0).all()
        # the slot lies in the table's block for that virtual block, at the local offset
        for b in range(batch):
            for p in np.flatnonzero(owned[b]):
                block, offset = divmod(int(slots[b, p]), block_size)
                assert block == table[b, p // (block_size * dcp)]
                assert offset == int(layout.local_index(p, dcp, interleave)) % block_size
                seen.add((rank, int(slots[b, p])))
    assert len(seen) == batch * length  # every token has exactly one distinct slot


def test_paged_single_sequence_vector_form():
    table = np.array([5, 2])
    slots = np.asarray(layout.paged_slot_mapping(np.array([0, 9]), np.stack([table, table]), 0, 4, 2, 2))
    # pos 0 -> block 5 offset 0; pos 9 -> virtual block 1 (block 2), local index 5 -> offset 1
    assert list(slots) == [20, 9]


def test_block_size_rule():
    with pytest.raises(ValueError, match="block_size % cp_kv_cache_interleave_size == 0"):
        layout.check_block_size(6, 4)
