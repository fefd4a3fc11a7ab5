"""Speculative decoding under DCP: the same tokens as plain decoding (greedy and seeded), exact
rejection sampling, nothing past a stop, every block back when idle."""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax import LLM, SamplingParams
from dcpjax.engine.args import EngineArgs
from dcpjax.engine.requests import RequestError
from dcpjax.kernels.oracle import assert_same_generations
from dcpjax.sampling import SamplerConfig, SamplingRows, sample, sampler_config
from dcpjax.sampling.verify import verify_drafts
from dcpjax.serve.metrics import Metrics
from dcpjax.spec_decode import SpeculativeConfig
from dcpjax.spec_decode.ngram import propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# the same model drafting for itself: (nearly) every draft is accepted, so long runs of accepted
# tokens, rollbacks at stops and the draft cache's bookkeeping are all exercised
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
PROMPTS = ["abcabcabcabcabc abc", "the cat sat on the mat; the cat sat on the", "0101010101", "Hello, world"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)


# -- configuration and proposals --------------------------------------------------------------------
def test_config_checks_name_the_problem():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.from_dict({"model": "tiny-llama", "num_speculative_tokens": 2}).method == "draft_model"
    bad = [({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
           ({"method": "ngram"}, "needs num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min must be <="),
           ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "model must name the draft model"),
           ("ngram", "must be a dict")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(value)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 is not supported"):
        SpeculativeConfig.from_dict({**SELF_DRAFT, "model": "tiny-llama",
                                     "draft_tensor_parallel_size": 2}).check_draft_tp(4)


def test_cli_flag_takes_json_and_names_the_problem(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert args.speculative_config == NGRAM
    assert args.to_cli_args() == ["--speculative-config", json.dumps(NGRAM)]
    for bad, message in [("{", "expected a JSON object"), ("[1]", "expected a JSON object"),
                         ('{"method": "ngram"}', "needs num_speculative_tokens")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
        err = capsys.readouterr().err
        assert "argument --speculative-config" in err and message in err


def test_llm_rejects_a_draft_with_another_vocabulary(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of 100 tokens"):
        LLM("tiny-llama", max_model_len=64, speculative_config={**SELF_DRAFT, "model": str(tmp_path)})


def test_ngram_proposals():
    tokens = lambda *t: np.array(t, np.int32)
    assert propose_ngram(tokens(1, 2, 3, 4, 9, 1, 2, 3), 4, 1, 5).tolist() == [4, 9, 1, 2]
    # the longest match wins over a later shorter one; among equals, the latest
    assert propose_ngram(tokens(7, 1, 2, 5, 0, 2, 6, 1, 2), 1, 1, 3).tolist() == [5]
    assert propose_ngram(tokens(1, 2, 5, 1, 2, 6, 1, 2), 1, 1, 3).tolist() == [6]
    assert propose_ngram(tokens(5, 5, 5), 4, 1, 5).tolist() == [5, 5, 5, 5]  # continues with the period
    assert propose_ngram(tokens(1, 2, 3, 1, 2, 3, 1), 5, 1, 5).tolist() == [2, 3, 1, 2, 3]
    assert propose_ngram(tokens(1, 2, 7, 1, 2), 3, 3, 5).tolist() == []  # no earlier 3-gram
    assert propose_ngram(tokens(4), 3, 1, 5).tolist() == []


# -- verification is exact rejection sampling -------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """A draft d verified at temperature 0.7 with top_p 0.95 over 6 tokens, 40,000 seeds: the first
    emitted token is the plain sampler's token for the same (seed, counter), its frequencies pass a
    chi-square test against the filtered target distribution, and d is accepted with probability p(d)."""
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], jnp.float32)
    n, drafts = 40_000, (0, 2, 5)
    temperature, top_p = 0.7, 0.95
    probs = np.asarray(jax.nn.softmax(logits / temperature), np.float64)
    order = np.argsort(-probs)
    kept = order[: np.searchsorted(np.cumsum(probs[order]), top_p) + 1]
    target = np.zeros_like(probs)
    target[kept] = probs[kept] / probs[kept].sum()
    rows = SamplingRows(jnp.full(n, temperature), jnp.zeros(n, jnp.int32), jnp.full(n, top_p), jnp.zeros(n),
                        jnp.arange(n, dtype=jnp.uint32), jnp.full(n, 5, jnp.int32))
    config = sampler_config([SamplingParams(temperature=temperature, top_p=top_p)], 6)
    plain = np.asarray(jax.jit(lambda x: sample(x, rows, config).tokens)(jnp.broadcast_to(logits, (n, 6))))
    verify = jax.jit(lambda x, tokens: verify_drafts(x, tokens, jnp.full(n, 2), rows, config))
    for d in drafts:
        tokens = jnp.broadcast_to(jnp.array([1, d, 0], jnp.int32), (n, 3))  # [input, draft, padding]
        sampled, last = verify(jnp.broadcast_to(logits, (n, 3, 6)), tokens)
        sampled, last = np.asarray(sampled.tokens), np.asarray(last)
        accepted = sampled[:, 0] == d
        first = np.where(accepted, d, sampled[:, 0])
        assert (first == plain).all()  # token for token what plain sampling draws
        assert (last[~accepted] == sampled[~accepted, 0]).all() and (last[accepted] == sampled[accepted, 1]).all()
        counts = np.bincount(first, minlength=6)
        assert counts[target == 0].sum() == 0
        expected = n * target[target > 0]
        chi2 = float(((counts[target > 0] - expected) ** 2 / expected).sum())
        assert chi2 < 16.27  # chi-square, 3 degrees of freedom at most, p = 0.001
        assert abs(accepted.mean() - target[d]) < 4 * math.sqrt(target[d] * (1 - target[d]) / n) + 1e-9


def test_greedy_verification_accepts_the_matching_prefix():
    logits = jax.nn.one_hot(jnp.array([[4, 5, 6, 7, 1]]), 8) * 10  # the target's argmax per position
    rows = SamplingRows(jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1),
                        jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))
    for drafts, count, expected_last in [([4, 5, 6, 7], 5, 1), ([4, 5, 0, 7], 5, 6), ([0, 5, 6, 7], 5, 4),
                                         ([4, 5, 6, 7], 3, 6)]:
        tokens = jnp.array([[9, *drafts]], jnp.int32)
        _, last = verify_drafts(logits, tokens, jnp.array([count]), rows, SamplerConfig())
        assert int(last[0]) == expected_last


# -- the engine: identical outputs on every layout ---------------------------------------------------
_baselines: dict[str, tuple] = {}


def _stop_params(reference) -> list[SamplingParams]:
    """Stops that fall inside a verify row: a stop token id, a stop string, an odd max_tokens."""
    ids, text = reference[0].outputs[0].token_ids, reference[1].outputs[0].text
    return [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[6]]),
            SamplingParams(temperature=0, max_tokens=24, stop=[text[7:9]]),
            SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)]


def _baseline(model: str):
    if model not in _baselines:
        llm = LLM(model, max_model_len=128, enable_prefix_caching=True)
        greedy = llm.generate(PROMPTS, GREEDY)
        stops = llm.generate(PROMPTS[:3], _stop_params(greedy))
        _baselines[model] = greedy, stops
    return _baselines[model]


def _assert_idle(llm):
    pool = llm.engine.scheduler.allocator
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)
    assert not llm.engine.running and not llm.engine.waiting


# three layouts on every Python cover both methods, both backends, interleave 1 and 2, GQA and MLA;
# two others run in the e2e set (on the newest jax), two on the oldest jax only
@pytest.mark.parametrize("model,tp,dcp,interleave,comm,method", [
    ("tiny-llama", 1, 1, 1, "ag_rs", "ngram"),
    ("tiny-llama", 8, 2, 2, "a2a", "draft_model"),
    pytest.param("tiny-llama", 8, 4, 1, "ag_rs", "ngram", marks=pytest.mark.e2e),
    pytest.param("tiny-deepseek", 1, 1, 1, "ag_rs", "draft_model", marks=pytest.mark.oldest_jax),
    pytest.param("tiny-deepseek", 8, 2, 1, "a2a", "ngram", marks=pytest.mark.e2e),
    pytest.param("tiny-deepseek", 8, 4, 2, "ag_rs", "draft_model", marks=pytest.mark.oldest_jax),
    ("tiny-deepseek", 8, 8, 1, "a2a", "ngram"),
])
def test_greedy_outputs_equal_plain_decoding(model, tp, dcp, interleave, comm, method):
    greedy, stops = _baseline(model)
    spec = NGRAM if method == "ngram" else {**SELF_DRAFT, "model": model}
    llm = LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave,
              dcp_comm_backend=comm, max_model_len=128, block_size=4, enable_prefix_caching=True,
              speculative_config=spec)
    for _ in range(2):  # the second round hits the prefix cache
        out = llm.generate(PROMPTS, GREEDY)
        assert_same_generations(out, greedy)  # logprobs too: the target's
    assert max(o.num_cached_tokens for o in out) > 0
    stopped = llm.generate(PROMPTS[:3], _stop_params(greedy))
    for a, b in zip(stops, stopped):
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason, a.outputs[0].stop_reason) == \
               (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason, b.outputs[0].stop_reason)
    assert len(stopped[2].outputs[0].token_ids) == 11
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    if method == "draft_model":  # the model drafting for itself: all but rounding accepted
        assert stats.acceptance_rate > 0.9
    _assert_idle(llm)


@pytest.mark.oldest_jax  # slow: one Python (marker docs in pyproject.toml)
def test_seeded_sampling_equals_plain_decoding_and_metrics_count():
    """Seeded sampling draws the same tokens with and without speculation (same keys per output
    index); the Prometheus counters follow the engine's."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True, logprobs=1)
              for s in range(len(PROMPTS))]
    plain = LLM("tiny-llama", max_model_len=128).generate(PROMPTS, params)
    llm = LLM("tiny-llama", max_model_len=128, speculative_config={**SELF_DRAFT, "model": "tiny-llama"})
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in spec]
    metrics = Metrics("m")
    metrics.update(llm.engine)
    value = lambda name, **labels: metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    stats = llm.engine.spec_stats
    assert value("dcpjax:spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert value("dcpjax:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value("dcpjax:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens > 0
    assert value("dcpjax:spec_decode_num_accepted_tokens_per_pos_total", position="0") == stats.accepted_per_position[0]
    metrics.update(llm.engine)  # counted once
    assert value("dcpjax:spec_decode_num_drafts_total") == stats.num_drafts
    for field, value in [("presence_penalty", 0.5), ("repetition_penalty", 1.2), ("logit_bias", {5: 1.0}),
                         ("allowed_token_ids", [5, 6]), ("min_tokens", 2)]:
        with pytest.raises(RequestError, match="not supported with speculative decoding") as refused:
            llm.generate("hi", SamplingParams(max_tokens=4, **{field: value}))
        assert refused.value.param == field  # the request's field, the 400's param


@pytest.mark.e2e  # slow: one Python (marker docs in pyproject.toml)
def test_preemption_and_aborts_with_speculation_free_every_block():
    """A cache too small for the batch preempts sequences that hold draft room; outputs still equal
    plain decoding, and aborts mid-run leave every block free."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [p * 2 for p in PROMPTS] * 2
    kw = dict(max_model_len=96, block_size=4, kv_cache_memory_bytes=60 * 4 * 2 * 2 * 2 * 16 * 4, max_num_seqs=8)
    plain = LLM("tiny-llama", **kw).generate(prompts, params)
    llm = LLM("tiny-llama", speculative_config={**SELF_DRAFT, "model": "tiny-llama"}, **kw)
    spec = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in spec]
    _assert_idle(llm)
    engine = llm.engine
    seqs = [llm.make_sequence(p, params, i) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    for _ in range(6):
        engine.step()
    for seq in seqs[::2]:
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
    _assert_idle(llm)
    assert all(s.finish_reason == "length" and s.length == s.max_total for s in seqs[1::2])
