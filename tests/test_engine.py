"""Continuous batching: preemption under a full cache, aborts, first come first served."""

import pytest

from dcpjax import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [f"request {i}: " + "kv " * (5 + 3 * i) for i in range(12)]


def make(kv_bytes, **kw):
    return LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory_bytes=kv_bytes, max_model_len=128,
               block_size=16, max_num_batched_tokens=64, **kw)


@pytest.fixture(scope="module")
def alone():
    """Each request on its own, in a roomy cache."""
    llm = make(4 << 20)
    return [llm.generate(p, PARAMS)[0].outputs[0].token_ids for p in PROMPTS]


def test_oversubscribed_cache_preempts_and_loses_nothing(alone):
    llm = make(12 * 4096)  # 12 blocks of 16 tokens: about two of these requests at a time
    assert llm.kv_cache_size_tokens == 192
    outputs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone  # recompute gives the same tokens
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_blocks  # every block back
    assert not llm.engine.has_work()


def test_abort_frees_blocks_at_once():
    llm = make(4 << 20)
    engine = llm.engine
    keep, drop = (llm.make_sequence(p, PARAMS, i) for i, p in enumerate(PROMPTS[:2]))
    engine.add(keep)
    engine.add(drop)
    for _ in range(3):
        engine.step()
    used = engine.scheduler.allocator.num_blocks - engine.scheduler.allocator.num_free
    assert drop.blocks and used == len(keep.blocks[0]) + len(drop.blocks[0])
    assert engine.abort(drop.request_id)
    assert drop.finish_reason == "abort" and drop.blocks == []
    assert engine.scheduler.allocator.num_blocks - engine.scheduler.allocator.num_free == len(keep.blocks[0])
    assert not engine.abort("no-such-request")
    while engine.has_work():
        engine.step()
    assert (keep.finish_reason == "length"
            and engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks)


def test_first_come_first_served_and_row_limit(alone):
    llm = make(4 << 20, max_num_seqs=3)
    engine = llm.engine
    seqs = [llm.make_sequence(p, PARAMS, i) for i, p in enumerate(PROMPTS[:6])]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    assert [s.request_id for s in engine.running] == [s.request_id for s in seqs[:3]]
    finished = []
    while engine.has_work():
        assert len(engine.running) <= 3
        finished += engine.step().finished
    assert [s.output_ids for s in seqs] == alone[:6]
