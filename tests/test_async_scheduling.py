"""Asynchronous scheduling: the host reads each step one step late, and nothing leaks or is lost."""

import pytest

from dcpjax import LLM, SamplingParams

PROMPTS = [f"async {i}: " + "tok " * (2 + 5 * i) for i in range(6)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20, max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8)


def generate(llm, prompts, params, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    try:
        return llm.generate(prompts, params)
    finally:
        llm.engine.async_scheduling = True


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def base(llm):
    """Greedy continuations with nothing stopping them early."""
    return ids(generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), False))


def test_async_equals_sync_for_mixed_requests(llm):
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, logprobs=2 if i % 2 else None) for i in range(3)]
    params += [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=17) for i in range(3)]
    sync, async_ = (generate(llm, PROMPTS, params, mode) for mode in (False, True))
    assert ids(async_) == ids(sync)
    for a, b in zip(async_, sync):
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "length"
        if a.outputs[0].logprobs is not None:
            assert [list(e) for e in a.outputs[0].logprobs] == [list(e) for e in b.outputs[0].logprobs]
    assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_blocks


@pytest.mark.parametrize("at", [0, 3, 10])
def test_stop_token_seen_a_step_late_leaks_nothing(llm, base, at):
    """Each request stops at a token of its own greedy run; the step already scheduled for it
    must not add a token."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[b[at]]) for b in base]
    for out, want, p in zip(generate(llm, PROMPTS, params, True), base, params):
        cut = want.index(p.stop_token_ids[0]) + 1
        assert out.outputs[0].token_ids == want[:cut]
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", p.stop_token_ids[0])
    assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_blocks


def test_eos_seen_a_step_late_leaks_nothing(llm, base):
    eos = base[0][6]
    processor = llm.engine.processor
    saved = processor.eos
    processor.eos = frozenset({eos})
    try:
        out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24), True)[0].outputs[0]
    finally:
        processor.eos = saved
    assert out.token_ids == base[0][: base[0].index(eos) + 1] and out.finish_reason == "stop"


def test_stop_string_and_max_tokens_exact(llm, base):
    text = generate(llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), True)[0].outputs[0]
    stop = text.text[6:8]
    out = generate(llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop), True)
    completion = out[0].outputs[0]
    assert completion.text == text.text[: text.text.index(stop)] and completion.stop_reason == stop
    assert completion.token_ids == base[2][: len(completion.token_ids)]
    # the tokens end where the stop string completed: none after it
    assert stop in llm.tokenizer.decode(completion.token_ids)
    assert stop not in llm.tokenizer.decode(completion.token_ids[:-1])
    for n in (1, 2, 7):
        got = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), True)
        assert ids(got) == [b[:n] for b in base]


def test_abort_with_a_token_in_flight_frees_every_block(llm, base):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    keep, drop = (llm.make_sequence(p, params, i) for i, p in enumerate(PROMPTS[:2]))
    engine.add(keep)
    engine.add(drop)
    for _ in range(4):
        engine.step()
    assert engine.in_flight and drop.num_pending  # a step of it is still on the device
    emitted = drop.output_ids
    assert engine.abort(drop.request_id)
    assert drop.blocks == [] and drop.finish_reason == "abort"
    while engine.has_work():
        engine.step()
    assert drop.output_ids == emitted  # the in-flight token was dropped
    assert keep.output_ids == base[0]
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    assert sorted(engine.scheduler.free_slots) == list(range(8))


def test_preemption_under_async_loses_nothing_and_frees_every_block(base):
    tight = LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory_bytes=10 * 4096, max_model_len=160,
                max_num_batched_tokens=64, max_num_seqs=8, block_size=16)
    outs = tight.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert tight.engine.num_preemptions > 0
    assert ids(outs) == base
    assert tight.engine.scheduler.allocator.num_free == tight.engine.scheduler.allocator.num_blocks
    assert sorted(tight.engine.scheduler.free_slots) == list(range(8))


def test_an_error_mid_step_leaves_a_clean_engine(llm, base):
    """An exception (or Ctrl-C) inside a step aborts what was in flight; the next call works."""
    runner = llm.runner
    launch, calls = runner.launch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected")
        return launch(*args, **kwargs)

    runner.launch = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finally:
        runner.launch = launch
    engine = llm.engine
    assert not engine.has_work() and engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    assert sorted(engine.scheduler.free_slots) == list(range(8))
    assert ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))) == base
