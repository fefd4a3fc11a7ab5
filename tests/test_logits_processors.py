"""vLLM's sampling parameters beyond the filters, applied on the device: each against an oracle.

- `logits_processors.apply` against a numpy transcription of vLLM's / OpenAI's formulas;
- presence and frequency penalties end to end against the engine's own raw logprobs over the
  whole vocabulary (greedy picks argmax(logprob - penalties of the tokens generated so far)),
  through chunked prefill, a batch shared with unpenalised requests, and preemption;
- repetition_penalty, logit_bias, bad_words and min_tokens on SmolLM2-135M against
  transformers' own logits processors (tests/fixtures/make_processor_fixtures.py);
- allowed_token_ids, multi-token bad words, n and best_of on the tiny model.
"""

import collections
import json
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import dcpjax
from dcpjax.loader.model_source import BUILTIN_GGUF, builtin_gguf_path
from dcpjax.models.config import TINY_MODELS
from dcpjax.runner.kv_layout import kv_block_layout
from dcpjax.sampling import logits_processors as lp

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "smollm2" / "processors.json"
P = dcpjax.SamplingParams


def reference(logits, counts, prompt_mask, stop_mask, bias, presence, frequency, repetition, min_tokens, generated):
    """vLLM's order in numpy: bias (logit_bias / allowed / single bad words), min_tokens, then the
    repetition, frequency and presence penalties."""
    x = logits + bias
    x = np.where(stop_mask & (generated < min_tokens)[:, None], -np.inf, x)
    seen = (counts > 0) | prompt_mask
    rep = repetition[:, None]
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def test_apply_matches_the_reference():
    rng = np.random.default_rng(0)
    rows, vocab = 4, 50
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(rows, vocab)).astype(np.int32) * (rng.random((rows, vocab)) < 0.2)
    prompt = rng.random((rows, vocab)) < 0.1
    stop = np.zeros((rows, vocab), bool)
    stop[:, [7, 9]] = True
    bias = np.where(rng.random((rows, vocab)) < 0.1, rng.normal(size=(rows, vocab)) * 5, 0).astype(np.float32)
    bias[1, 3] = -np.inf
    flags = (prompt * lp.PROMPT + stop * lp.STOP).astype(np.int8)
    state = lp.ProcessorState(counts.astype(np.int32), flags, bias,
                              np.full((rows, lp.MAX_BAD_WORDS, lp.MAX_BAD_WORD_TOKENS), lp.ANY, np.int32),
                              np.full((rows, lp.MAX_BAD_WORD_TOKENS - 1), lp.NONE, np.int32))
    values = dict(presence=np.array([0.5, 0, -1, 2], np.float32), frequency=np.array([0.3, 1.5, 0, -0.5], np.float32),
                  repetition=np.array([1.3, 1, 0.8, 2], np.float32), min_tokens=np.array([0, 5, 0, 2], np.int32),
                  generated=np.array([0, 3, 0, 2], np.int32))
    rows_in = lp.ProcessorRows(np.array([True, True, True, False]), **values)
    got = np.asarray(lp.apply(logits, state, np.arange(rows, dtype=np.int32), rows_in))
    want = reference(logits, counts, prompt, stop, bias, **values)
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])  # a row without a spec samples the model's logits


def test_a_bad_word_bans_its_last_token_after_its_prefix():
    spec = lp.logits_spec(P(bad_words=["x"]), [1, 2], [0], [[5, 6, 7], [9]])
    assert spec.bias_ids.tolist() == [9] and spec.bias_values[0] == -np.inf  # one token: always banned
    state = lp.empty_state(2, 10)
    state = lp.install(state, lp.make_install(spec, 1, [3, 5, 6], 10))
    rows = lp.ProcessorRows(np.array([True]), *(np.zeros(1, np.float32),) * 2, np.ones(1, np.float32),
                            np.zeros(1, np.int32), np.zeros(1, np.int32))
    out = np.asarray(lp.apply(np.zeros((1, 10), np.float32), state, np.array([1], np.int32), rows))
    assert np.isneginf(out[0, [7, 9]]).all() and np.isfinite(np.delete(out[0], [7, 9])).all()
    state = lp.record(state, np.array([1], np.int32), np.array([4], np.int32))  # the prefix is broken
    out = np.asarray(lp.apply(np.zeros((1, 10), np.float32), state, np.array([1], np.int32), rows))
    assert np.isfinite(out[0, 7]) and np.isneginf(out[0, 9])


# -- end to end on the tiny model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    # 40 blocks: eight ~150-token sequences oversubscribe it, so some are preempted and recomputed
    cfg, pc = TINY_MODELS["tiny-llama"], dcpjax.ParallelConfig(1, 1)
    per_block = kv_block_layout(cfg, pc, block_size=16, dtype=jnp.float32).bytes_per_block_per_device(
        cfg.num_hidden_layers, pc.kv_head_groups)
    return dcpjax.LLM("tiny-llama", max_model_len=192, kv_cache_memory_bytes=40 * per_block,
                      max_num_batched_tokens=64, max_logprobs=264)


def check_penalised_greedy(output, prompt_len: int, presence: float, frequency: float):
    """Each generated token is the argmax of its step's raw logprobs minus the penalties of the tokens
    generated before it (logprobs over the whole vocabulary: the engine's own, before any edit)."""
    completion = output.outputs[0]
    counts = collections.Counter()
    for token, entry in zip(completion.token_ids, completion.logprobs):
        scores = np.full(264, -np.inf)
        for tid, logprob in entry.items():
            scores[tid] = logprob.logprob
        assert np.isfinite(scores).all()
        for tid, count in counts.items():
            scores[tid] -= frequency * count + presence
        assert token == int(np.argmax(scores))
        counts[token] += 1


def test_presence_and_frequency_penalties_against_raw_logprobs(llm):
    # distinct prompts (no shared prefix) of 100-149 tokens: chunked prefill
    prompts = [{"prompt_token_ids": [(t * (i + 2) + 7 * i) % 250 + 5 for t in range(100 + 7 * i)]} for i in range(8)]
    penalised = P(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.7,
                  logprobs=264)
    plain = P(temperature=0, max_tokens=40, ignore_eos=True)
    before = llm.engine.num_preemptions
    outs = llm.generate(prompts, [penalised if i % 2 == 0 else plain for i in range(8)])
    assert llm.engine.num_preemptions > before  # the cache is oversubscribed: counts survive a recompute
    for i, out in enumerate(outs):
        if i % 2 == 0:
            check_penalised_greedy(out, len(prompts[i]["prompt_token_ids"]), 0.4, 0.7)
    solo = llm.generate(prompts[1], plain)[0]  # an unpenalised neighbour is untouched
    assert outs[1].outputs[0].token_ids == solo.outputs[0].token_ids
    unpenalised = llm.generate(prompts[0], plain)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != unpenalised  # the penalties changed something


def test_allowed_token_ids_and_a_multi_token_bad_word(llm):
    ab = dict(temperature=1.0, seed=5, max_tokens=48, ignore_eos=True, allowed_token_ids=[ord("a"), ord("b")])
    free = llm.generate("hello", P(**ab))[0].outputs[0].text
    assert set(free) == {"a", "b"} and "ab" in free  # the control: "ab" happens without the ban
    banned = llm.generate("hello", P(**ab, bad_words=["ab"]))[0].outputs[0].text
    assert re.fullmatch(r"b*a*", banned), banned  # once an "a" is out, "b" can never follow


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(llm):
    greedy = llm.generate("hello", P(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = greedy.token_ids[2]
    short = llm.generate("hello", P(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0].outputs[0]
    assert short.token_ids[-1] == stop and len(short.token_ids) <= 3
    held = llm.generate("hello", P(temperature=0, max_tokens=20, stop_token_ids=[stop], min_tokens=10))[0].outputs[0]
    assert len(held.token_ids) >= 10 and stop not in held.token_ids[:10]
    ab = dict(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, allowed_token_ids=[ord("a"), ord("b")])
    early = llm.generate("hello", P(**ab, stop=["b"]))[0].outputs[0]
    late = llm.generate("hello", P(**ab, stop=["b"], min_tokens=6))[0].outputs[0]
    assert early.finish_reason == late.finish_reason == "stop" and len(early.token_ids) <= 6
    assert len(late.token_ids) > 6  # "b" ends it only once the output is longer than min_tokens


def test_n_and_best_of(llm):
    params = P(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, n=3)
    out = llm.generate(["hello", "abc"], params)
    assert [[c.index for c in o.outputs] for o in out] == [[0, 1, 2]] * 2
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 3  # drawn independently
    again = llm.generate("hello", params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]  # seeded: reproducible
    draws = llm.generate("hello", P(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, n=4, logprobs=0))[0]
    best = llm.generate("hello", P(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, n=2, best_of=4))[0]
    ranked = sorted(draws.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert all(c.logprobs is None for c in best.outputs)  # drawn only to rank: not asked for


def test_requests_the_engine_cannot_honour_name_the_field(llm):
    with pytest.raises(ValueError, match="max_logprobs=264"):  # the fixture's --max-logprobs (default 20)
        llm.generate("hi", P(logprobs=265))
    with pytest.raises(ValueError, match=r"SamplingParams.allowed_token_ids .*vocabulary \[0, 264\)"):
        llm.generate("hi", P(allowed_token_ids=[1, 999]))
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        P(logit_bias={3: 101})


# -- SmolLM2 against transformers' logits processors ---------------------------------------------------
@pytest.mark.e2e  # the real model: newest jax only (the processors' own tests run on both)
def test_smollm2_processors_match_transformers():
    try:
        builtin_gguf_path("smollm2-135m-instruct")
    except ValueError:
        pytest.skip(f"needs {BUILTIN_GGUF['smollm2-135m-instruct'].install}")
    data = json.loads(FIXTURES.read_text())
    llm = dcpjax.LLM("smollm2-135m-instruct", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    cases = data["cases"]
    params = [P(temperature=0, max_tokens=data["max_tokens"],
                **{**c["params"], **({"logit_bias": {int(k): v for k, v in c["params"]["logit_bias"].items()}}
                                     if "logit_bias" in c["params"] else {})}) for c in cases]
    outs = llm.generate([{"prompt_token_ids": c["prompt"]} for c in cases], params)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["expected"], case["name"]
    names = {c["name"]: c["expected"] for c in cases}
    assert len(names["min_tokens"]) > len(names["eos"])  # the case exercises what it names
