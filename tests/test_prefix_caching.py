"""Automatic prefix caching over the DCP cache: same answers, shared blocks never rewritten,
references exact through preemption and aborts, no false hit by construction."""

import numpy as np
import pytest

from dcpjax import LLM, SamplingParams
from dcpjax.engine.block_pool import BlockPool
from dcpjax.kernels.oracle import assert_same_generations
from dcpjax.models.kv_groups import NULL_BLOCK

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)


# -- the block pool on its own ---------------------------------------------------------------------
def test_chained_keys_find_only_the_same_prefix():
    pool = BlockPool(8, virtual_block_size=4)
    a = pool.allocate(3)
    key = 0
    for j, block in enumerate(a):
        key = pool.register([block], key, list(range(4 * j, 4 * j + 4)))
    tokens = list(range(12)) + [99]
    assert pool.lookup(tokens, len(tokens) - 1)[0] == [a]
    assert pool.lookup(tokens, 11)[0] == [a[:2]]  # whole blocks within the limit only
    changed = list(range(12))
    changed[5] = 77  # the second block differs: the third cannot match either, whatever it holds
    assert pool.lookup(changed + [1], 12)[0] == [a[:1]]
    assert pool.lookup(list(range(4, 16)), 12)[0] == [[]]  # the same tokens at other positions: no hit


def test_colliding_hashes_never_give_a_false_hit(monkeypatch):
    """Every key hashes alike: the dict must compare the token ids themselves."""

    class Colliding(bytes):
        def __hash__(self):
            return 0

    original = BlockPool._key
    monkeypatch.setattr(BlockPool, "_key", staticmethod(lambda tokens: Colliding(original(tokens))))
    pool = BlockPool(8, virtual_block_size=4)
    [block] = pool.allocate(1)
    pool.register([block], 0, [1, 2, 3, 4])
    assert pool.lookup([1, 2, 3, 5, 0], 4) == ([[]], 0)
    assert pool.lookup([1, 2, 3, 4, 0], 4)[0] == [[block]]


def test_references_and_least_recently_used_eviction():
    pool = BlockPool(4, virtual_block_size=2)
    first = pool.allocate(2)
    key = pool.register([first[0]], 0, [1, 2])
    pool.register([first[1]], key, [3, 4])
    pool.share(first)  # a second sequence reuses both
    pool.free(first)
    assert pool.num_free == 2 and pool.ref_counts[first[0]] == 1
    pool.free(first)
    assert pool.num_free == 4 and pool.num_cached == 2  # unreferenced, still cached
    pool.allocate(2)  # the never-cached blocks go first
    assert pool.num_cached == 2
    [evicted] = pool.allocate(1)
    assert evicted == first[1]  # freed last block first: the end of the prefix goes before its start
    assert pool.lookup([1, 2, 3, 4, 5], 4)[0] == [[first[0]]]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([first[1], first[1]])


def test_duplicate_blocks_stay_private_and_reset_waits_for_idle():
    pool = BlockPool(4, virtual_block_size=2)
    a, b = pool.allocate(1), pool.allocate(1)
    key_a = pool.register(a, 0, [5, 6])
    assert pool.register(b, 0, [5, 6]) == key_a  # computed side by side: the first one is kept
    assert pool.num_cached == 1
    assert not pool.reset()
    pool.free(a + b)
    assert pool.reset() and pool.num_cached == 0 and pool.lookup([5, 6, 7], 2)[0] == [[]]
    assert len(pool.prefixes) == 0  # no prefix id outlives its blocks


def _register_chain(pool, blocks_per_group, tokens, size):
    """Register each virtual block j of `tokens` with block blocks_per_group[g][j] of each group."""
    key = 0
    for j in range(len(blocks_per_group[0])):
        key = pool.register([g[j] for g in blocks_per_group], key, tokens[j * size : (j + 1) * size])
    return key


def test_sliding_groups_hit_with_their_window_only():
    """A full group and a sliding one (window 5, blocks of 2): a hit of m blocks needs the full
    group's m blocks and the sliding group's blocks of positions 2m - 4 .. 2m - 1 (what the next query
    sees); the earlier
    entries of its hit are null (`NULL_BLOCK`), and block 0 is never handed out."""
    pool = BlockPool(16, virtual_block_size=2, windows=(None, 5))
    assert 0 not in pool.allocate(pool.num_free)
    pool.free(list(range(1, 16)))
    full, sliding = pool.allocate(4), pool.allocate(4)
    tokens = list(range(100, 108))
    _register_chain(pool, [full, sliding], tokens, 2)
    hits, _ = pool.lookup(tokens + [1], 8)
    assert hits == [full, [NULL_BLOCK, NULL_BLOCK, sliding[2], sliding[3]]]  # the query at 8 sees 4 .. 8
    pool.free(sliding[2:3])  # the window's first block evicted: the hit falls back to where a window is whole
    pool.allocate(pool.num_free)
    hits, key = pool.lookup(tokens + [1], 8)
    assert hits == [full[:2], sliding[:2]] and key != 0  # the query at 4 sees 0 .. 4


def test_prefix_ids_outlive_the_blocks_at_the_start_of_their_prefix():
    """A sliding group frees the start of a long prefix; its window's blocks must still be found:
    prefix ids live in their own table, not on blocks (evicting the first blocks loses nothing)."""
    pool = BlockPool(12, virtual_block_size=2, windows=(3,))
    blocks = pool.allocate(5)
    tokens = list(range(10))
    key = _register_chain(pool, [blocks], tokens, 2)
    pool.retain(key)  # the sequence holds its chain's end
    pool.free(blocks[:3])  # behind the window: back to the pool, still cached ...
    pool.allocate(pool.num_free)  # ... then evicted
    hits, found = pool.lookup(tokens + [0], 10)
    assert hits == [[NULL_BLOCK] * 4 + [blocks[4]]] and found == key  # 10 + 1 - 3 = 8: the last block
    pool.release(key)


# -- the engine: same outputs, blocks never rewritten ------------------------------------------------
def _pool_blocks(llm, blocks):
    """Every layer's KV of physical `blocks` on every DCP rank, as numpy."""
    num_blocks, dcp = llm.runner.kv_layout.num_blocks, llm.parallel_config.dcp
    rows = [rank * num_blocks + b for rank in range(dcp) for b in blocks]
    return [np.asarray(pool)[:, rows] for cache in llm.runner.kv_caches for pool in (cache.k, cache.v, cache.k_scale)
            if pool is not None]


def _run_rounds(llm, unit, after_first=lambda: None):
    """Shared-prefix rounds: a first request, then others reusing its prefix (one exactly on a block
    boundary, one a multi-turn follow-up holding the first answer). Returns the outputs."""
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(2 * unit + unit // 2))  # 2.5 virtual blocks
    first = llm.generate([prefix + " first?"], GREEDY)
    after_first()
    follow_up = {"prompt_token_ids": first[0].prompt_token_ids + first[0].outputs[0].token_ids + [32, 63]}
    second = llm.generate([prefix + " second?", prefix[: 2 * unit], prefix + " third, longer question?",
                           follow_up], GREEDY)
    return first + second


def _common_blocks(a, b, unit):
    """Tokens of the longest common prefix of a and b, in whole blocks of `unit`."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same // unit * unit


@pytest.mark.parametrize("model, tp, dcp, interleave, comm, kv_dtype", [
    pytest.param("tiny-llama", 1, 1, 1, "ag_rs", "auto", marks=pytest.mark.e2e),  # e2e: the newest jax only
    ("tiny-llama", 4, 2, 2, "a2a", "auto"),
    ("tiny-llama", 8, 2, 1, "ag_rs", "fp8"),
    pytest.param("tiny-llama", 8, 4, 2, "ag_rs", "auto", marks=pytest.mark.e2e),
    ("tiny-deepseek", 8, 8, 1, "a2a", "auto"),
])
def test_cached_equals_uncached(model, tp, dcp, interleave, comm, kv_dtype):
    llm = LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave,
              dcp_comm_backend=comm, kv_cache_dtype=kv_dtype, block_size=4 * interleave, max_model_len=512,
              kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=32, enable_prefix_caching=False)
    unit = 4 * interleave * dcp  # tokens per virtual block
    pool = llm.engine.scheduler.allocator
    uncached = _run_rounds(llm, unit)
    assert pool.num_cached == 0 and all(o.num_cached_tokens == 0 for o in uncached)

    pool.enable_caching = True  # the flag LLM(enable_prefix_caching=True) sets
    snapshot = {}

    def after_first():
        snapshot["blocks"] = list(pool._block_of.values())
        snapshot["kv"] = _pool_blocks(llm, snapshot["blocks"])

    cached = _run_rounds(llm, unit, after_first)
    assert_same_generations(cached, uncached)
    # each reuses the whole blocks it shares with the first request's computed tokens (the follow-up
    # its answer too, all but the last token), leaving at least its own last token to compute
    first = cached[0].prompt_token_ids + cached[0].outputs[0].token_ids[:-1]
    expected = [_common_blocks(o.prompt_token_ids[:-1], first, unit) for o in cached[1:]]
    assert [o.num_cached_tokens for o in cached] == [0, *expected]
    assert min(expected) > 0
    assert len(snapshot["blocks"]) == len(first) // unit
    for was, now in zip(snapshot["kv"], _pool_blocks(llm, snapshot["blocks"])):
        np.testing.assert_array_equal(was, now)  # shared blocks are never written again
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)


def test_preemption_and_aborts_keep_references_exact():
    """A cache of a few blocks, many requests sharing prefixes: preemptions recompute through the
    cache, aborts drop references, and when idle every block is free again."""
    llm = LLM("tiny-llama", tensor_parallel_size=4, decode_context_parallel_size=2, block_size=8,
              kv_cache_memory_bytes=14 * 2048, max_model_len=128, max_num_batched_tokens=32)
    assert llm.engine.scheduler.allocator.num_blocks == 14  # 224 tokens
    prompts = [("shared prefix " * 4)[: 32 + 8 * (i % 3)] + f" {i}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    pool = llm.engine.scheduler.allocator
    pool.enable_caching = False
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    pool.enable_caching = True
    got = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0 and pool.stats.hits > 0
    assert [o.outputs[0].token_ids for o in got] == want
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)

    engine = llm.engine
    sequences = [llm.make_sequence(p, params, i, request_id=f"r{i}") for i, p in enumerate(prompts)]
    for seq in sequences:
        engine.add(seq)
    for _ in range(6):
        engine.step()
    for seq in sequences[::3]:
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)
    for seq in sequences:
        if seq.finish_reason != "abort":
            assert seq.output_ids == want[sequences.index(seq)]


def test_reset_prefix_cache_and_disabled_cache():
    llm = LLM("tiny-llama", block_size=4, kv_cache_memory_bytes=1 << 20, max_model_len=256, max_num_batched_tokens=32)
    prompt = "reset me, please, " * 3
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params)
    assert llm.generate(prompt, params)[0].num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert llm.reset_prefix_cache() and llm.engine.num_cached_blocks == 0
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0


def test_prompt_logprobs_requests_compute_every_prompt_position(monkeypatch):
    """They skip the cache (every position's logits are needed) and take their own smaller
    per-step budget; the logprobs are the same however the prompt is cut into chunks."""
    from dcpjax.engine import scheduler

    llm = LLM("tiny-llama", block_size=4, kv_cache_memory_bytes=1 << 20, max_model_len=256, max_num_batched_tokens=32)
    prompt = "prompt logprobs over a prompt cut into many chunks " * 2
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    whole = llm.generate(prompt, params)[0]
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_TOKENS", 8)
    again = llm.generate(prompt, params)[0]  # its prefix is cached now, and chunks are 8 tokens
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(again.prompt_token_ids)
    for a, b in zip(whole.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert {t: lp.logprob for t, lp in a.items()} == pytest.approx({t: lp.logprob for t, lp in b.items()}, abs=1e-4)
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens > 0
