"""The scheduler on its own (no model, no device): which rows a step gets, and that it alone
advances a sequence's scheduler state — schedule, add_drafts, update_from_output, finish, reset."""

import numpy as np
import pytest

from dcpjax.engine.config import SchedulerConfig
from dcpjax.engine.kv_cache_manager import KVCacheManager
from dcpjax.engine.scheduler import Scheduler
from dcpjax.models.kv_groups import NULL_BLOCK, KVCacheGroups
from dcpjax.sampling import SamplingParams
from dcpjax.sequence import Sequence
from dcpjax.spec_decode.stats import SpecDecodeStats


def make_scheduler(num_blocks=16, dcp=1, spec_stats=None, **config) -> Scheduler:
    config = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, **config}
    return Scheduler(num_blocks, SchedulerConfig(**config), dcp=dcp, spec_stats=spec_stats)


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 8, first: int = 1, **params) -> Sequence:
    ids = list(range(first, first + prompt_len))
    return Sequence(request_id, None, ids, SamplingParams(max_tokens=max_tokens, **params),
                    max_total=prompt_len + max_tokens, seed=0)


def read(scheduler: Scheduler, rows, tokens: dict, accepted=None) -> None:
    """What the engine does with a step that was read: the scheduler's bookkeeping, then the
    output processor's appends (here: given tokens per request)."""
    scheduler.update_from_output(rows, accepted)
    for row in rows:
        if row.samples and not row.seq.finished:
            row.seq.token_ids += tokens.get(row.seq.request_id, [0])


def test_first_come_first_served_prefill_then_decode():
    scheduler = make_scheduler()
    a, b = make_seq("a", 10), make_seq("b", 10, first=100)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    # the token budget (16) takes a's whole prompt and 6 of b's, in that order
    assert [(r.seq.request_id, r.start, r.count, r.samples) for r in step.prefill] == [("a", 0, 10, True),
                                                                                      ("b", 0, 6, False)]
    assert all(r.admitted for r in step.prefill) and not step.decode
    assert (a.num_computed, a.num_pending, b.num_computed, b.num_pending) == (10, 1, 6, 0)
    assert len(a.blocks[0]) == 3 and len(b.blocks[0]) == 2  # blocks of 4 tokens
    np.testing.assert_array_equal(scheduler.block_tables[a.slot, 0, :3], a.blocks[0])
    read(scheduler, step.prefill, {"a": [77]})
    assert a.num_pending == 0 and a.token_ids[-1] == 77
    step = scheduler.schedule()
    # a decodes its new token; b finishes its prompt
    assert [(r.seq.request_id, r.start, r.count) for r in step.decode] == [("a", 10, 1)]
    assert [(r.seq.request_id, r.start, r.count, r.samples) for r in step.prefill] == [("b", 6, 4, True)]
    assert step.decode[0].input_ids == [77] and not step.decode[0].device_input


def test_a_pending_token_is_decoded_from_the_device():
    """Asynchronous scheduling: the next step is scheduled before the last one is read."""
    scheduler = make_scheduler()
    seq = make_seq("a", 5)
    scheduler.add(seq)
    first = scheduler.schedule()
    second = scheduler.schedule()  # first not read yet
    (row,) = second.decode
    assert row.device_input and row.start == 5 and seq.num_pending == 2 and seq.num_tokens == 7
    scheduler.update_from_output(first.calls[0], None)
    assert seq.num_pending == 1


def test_preemption_frees_the_latest_admitted_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=32)
    a, b = make_seq("a", 12, max_tokens=20), make_seq("b", 11, max_tokens=20, first=100)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    assert scheduler.allocator.num_free == 0
    read(scheduler, step.prefill, {"a": [5], "b": [6]})
    step = scheduler.schedule()  # a needs a fourth block for position 12: b goes back to the queue
    assert step.preempted == 1 and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [b] and b.num_computed == 0 and b.blocks == [] and b.slot is None
    assert [(r.seq.request_id, r.start) for r in step.decode] == [("a", 12)]


def test_preemption_spares_a_sequence_its_token_in_flight_ends():
    """b (max_tokens 1, as a prefill server's handoff) ends when its token is read: preempting it frees
    nothing for long and would lose the KV a decode server is about to pull. a preempts itself."""
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=32)
    a, b = make_seq("a", 12, max_tokens=20), make_seq("b", 11, max_tokens=1, first=100)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    step = scheduler.schedule()  # the first step not read yet: a needs a fourth block
    assert step.preempted == 1 and list(scheduler.waiting) == [a] and a.slot is None
    assert len(b.blocks[0]) == 3 and b.slot is not None and not step.decode


def test_prefix_cache_hits_skip_the_cached_blocks():
    scheduler = make_scheduler()
    a = make_seq("a", 10)
    scheduler.add(a)
    read(scheduler, scheduler.schedule().prefill, {"a": [3]})
    b = make_seq("b", 10)  # the same prompt: its first two full blocks are a's
    scheduler.add(b)
    step = scheduler.schedule()
    (row,) = [r for r in step.prefill if r.seq is b]
    assert (row.start, row.count, b.num_cached_tokens) == (8, 2, 8)
    assert b.blocks[0][:2] == a.blocks[0][:2] and scheduler.allocator.ref_counts[a.blocks[0][0]] == 2


def test_drafts_advance_computed_and_the_step_rolls_them_back():
    stats = SpecDecodeStats(3)
    scheduler = make_scheduler(num_lookahead_tokens=3, spec_stats=stats)
    seq = make_seq("a", 6)
    scheduler.add(seq)
    read(scheduler, scheduler.schedule().prefill, {"a": [9]})
    step = scheduler.schedule()
    (row,) = step.decode
    assert row.lookahead == 3 and row.count == 1
    scheduler.add_drafts(step.decode, [[4, 5, 6, 7]])  # one more than the room: trimmed
    assert row.drafts == [4, 5, 6] and row.count == 4 and seq.num_computed == 10 and row.is_decode
    read(scheduler, step.decode, {"a": [4, 8]}, accepted=np.array([1]))
    # input (position 6) and one accepted draft (7) keep their KV; the rejected two are recomputed
    assert seq.num_computed == 8 and seq.num_pending == 0 and seq.length == 9
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)


def test_finish_and_reset_free_every_block_and_slot():
    scheduler = make_scheduler()
    seqs = [make_seq(str(i), 7, first=10 * i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    scheduler.finish(seqs[0])
    assert seqs[0].blocks == [] and seqs[0].slot is None and seqs[0] not in scheduler.running
    scheduler.reset()
    assert not scheduler.has_unfinished() and scheduler.allocator.num_free == 16
    # (seqs[0]'s token in flight is still read later: finish leaves it pending)
    assert all(seq.num_pending == 0 for seq in seqs[1:]) and sorted(scheduler.free_slots) == [0, 1, 2, 3]


def test_a_bad_token_budget_is_refused():
    with pytest.raises(ValueError, match="an integer >= 1, got 0"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=0)
    assert SchedulerConfig(max_model_len=64, max_num_batched_tokens=12).max_num_batched_tokens == 12  # as vLLM


def test_the_runner_gets_a_message_of_ids_counts_and_copied_block_ids():
    """`runner_call`: no Sequence crosses to the runner; block ids are a read-only copy of the table
    rows; a request's data comes with its first chunk after admission, its id once it finished."""
    scheduler = make_scheduler()
    a, b = make_seq("a", 6, temperature=0.5), make_seq("b", 3, first=50)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    call = scheduler.runner_call(step.prefill)
    assert [(c.request_id, c.slot, c.start, c.count, c.samples, c.input_ids) for c in call.chunks] == [
        ("a", a.slot, 0, 6, True, (1, 2, 3, 4, 5, 6)), ("b", b.slot, 0, 3, True, (50, 51, 52))]
    assert [n.request_id for n in call.new_requests] == ["a", "b"] and call.new_requests[0].params.temperature == 0.5
    assert not any(isinstance(v, Sequence) for c in call.chunks for v in c)
    blocks = call.block_tables
    assert blocks[0, 0, : len(a.blocks[0])].tolist() == a.blocks[0]
    assert blocks[1, 0, : len(b.blocks[0])].tolist() == b.blocks[0]
    assert not blocks.flags.writeable
    scheduler.block_tables[a.slot, 0, 0] = 999  # the scheduler's own table moves on; the message does not
    assert blocks[0, 0, : len(a.blocks[0])].tolist() == a.blocks[0]
    read(scheduler, step.prefill, {"a": [7], "b": [8]})
    scheduler.finish(b)
    step = scheduler.schedule()
    call = scheduler.runner_call(step.decode)
    assert [c.request_id for c in call.chunks] == ["a"] and call.chunks[0].input_ids == (7,)
    assert call.new_requests == () and call.finished_request_ids == {"b"}
    assert scheduler.runner_call(step.decode).finished_request_ids == set()  # told once


def test_a_request_id_already_queued_or_running_is_refused():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 4))
    with pytest.raises(ValueError, match="request id 'a' is already queued or running"):
        scheduler.add(make_seq("a", 4))
    scheduler.finish(scheduler.find("a"))
    scheduler.add(make_seq("a", 4))  # free again once finished


def test_sliding_groups_free_the_blocks_behind_their_windows():
    """A full group and a sliding one (window 6), blocks of 4: before each step the sliding group frees
    the blocks wholly before n + 1 - 6 (n: the row's first position), its entries becoming the null
    block; the full group keeps everything; a finished sequence gives every block back."""
    groups = KVCacheGroups(((0,), (1,)), (None, 6), 2)
    scheduler = Scheduler(16, SchedulerConfig(64, 4, 4, 8), dcp=1, groups=groups)
    a = make_seq("a", 14, max_tokens=10)
    scheduler.add(a)
    step = scheduler.schedule()  # positions 0 .. 7: nothing is behind the window of position 0
    assert [len(b) for b in a.blocks] == [2, 2] and NULL_BLOCK not in a.blocks[1]
    read(scheduler, step.prefill, {})
    step = scheduler.schedule()  # 8 .. 13: the query at 8 sees 3 .. 8, so block 0 (0 .. 3) stays
    assert a.blocks[1][0] != NULL_BLOCK and len(a.blocks[0]) == 4
    read(scheduler, step.prefill, {"a": [5]})
    for n in range(14, 18):  # decode: the query at 14 sees 9 .. 14: blocks 0 and 1 are dead
        step = scheduler.schedule()
        (row,) = step.decode
        assert row.start == n
        read(scheduler, step.decode, {"a": [5]})
    assert a.blocks[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in a.blocks[1][3:]  # n = 17 sees 12 .. 17
    assert NULL_BLOCK not in a.blocks[0] and scheduler.num_dead_blocks_freed == 3
    np.testing.assert_array_equal(scheduler.block_tables[a.slot, 1, :3], [NULL_BLOCK] * 3)
    held = sum(b != NULL_BLOCK for group in a.blocks for b in group)
    assert scheduler.allocator.num_free == scheduler.allocator.num_usable - held
    a.finish_reason = "abort"
    scheduler.finish(a)
    assert scheduler.allocator.num_free == scheduler.allocator.num_usable == 15  # block 0 is the null block


def test_a_loaded_prompt_gets_only_its_windows_and_caches_only_whole_ones():
    """A decode server's load (P/D): the sliding group gets the window of the first generated token only, in
    a cache sized for one max_model_len sequence (`KVCacheGroups.blocks_for`); the window's first block may
    hold positions the producer had freed, so it is not registered for other sequences to take."""
    groups = KVCacheGroups(((0,), (1,)), (None, 8), 2)
    config = SchedulerConfig(64, 4, 2, 16)
    usable = groups.blocks_for(64, 4, 16)
    kv = KVCacheManager(usable + 1, config, dcp=1, groups=groups)  # + the null block
    seq = make_seq("a", 62, max_tokens=2)
    seq.token_ids.append(7)  # its first token, from the prefill server
    seq.slot = 0
    assert kv.blocks_for_load(seq)  # 63 tokens: the query at 62 sees 55 .. 62, blocks 13 .. 15
    assert len(seq.blocks[0]) == 16 and NULL_BLOCK not in seq.blocks[0]
    assert seq.blocks[1][:13] == [NULL_BLOCK] * 13 and NULL_BLOCK not in seq.blocks[1][13:]
    assert kv.pool.num_free == usable - 16 - 3 and seq.sliding_cache_from == 14
    seq.num_computed = 62  # loaded: the prompt's KV is in place
    kv.cache_full_blocks(seq)  # 15 full blocks: the full group's all, the sliding group's 14th only
    assert kv.pool.num_cached == 15 + 1
    kv.release(seq)
    assert kv.pool.num_free == usable and seq.sliding_cache_from == 0
