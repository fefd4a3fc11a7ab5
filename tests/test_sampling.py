"""The in-step sampler against a numpy oracle of vLLM's filters, and its bounded-candidate shortcut."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax.sampling import (
    GREEDY,
    MIN_CANDIDATES,
    SamplerConfig,
    SamplingParams,
    SamplingRows,
    full_config,
    sampler_config,
)
from dcpjax.sampling import sample as eager_sample
from dcpjax.sampling.sampler import _gumbel_from_bits

VOCAB = 3000
# jitted as the runner calls it (its own small program); eagerly, the loops below take minutes
sample = jax.jit(eager_sample, static_argnums=2)


def rows_of(temperature, top_k, top_p, min_p, seeds, counters):
    f = lambda x: jnp.asarray(np.asarray(x, np.float32))
    i = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return SamplingRows(f(temperature), i(top_k), f(top_p), f(min_p), jnp.asarray(np.asarray(seeds, np.uint32)),
                        i(counters))


def kept_set(logits, temperature, top_k, top_p, min_p):
    """numpy oracle: the tokens vLLM's filters keep (full sort of the vocabulary)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    values = scaled[order]
    k = top_k if top_k > 0 else len(values)
    in_k = np.arange(len(values)) < k
    probs = np.where(in_k, np.exp(values - values[0]), 0.0)
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = in_k & (before < top_p) & (probs >= min_p * probs[0])
    keep[0] = True
    return set(order[keep].tolist())


def make_logits(seed, flat_rows=()):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(6, VOCAB)).astype(np.float32) * 4
    for r in flat_rows:  # nearly uniform: a top_p nucleus far wider than the candidates
        logits[r] = rng.normal(size=VOCAB).astype(np.float32) * 0.01
    return logits


# rows: greedy, top_k, peaked top_p, flat top_p (falls back to the whole vocabulary), min_p, temperature only
ROWS = dict(temperature=[0.0, 0.8, 1.0, 1.0, 1.3, 0.7], top_k=[0, 20, 0, 0, 0, 0], top_p=[1, 1, 0.6, 0.9, 1, 1],
            min_p=[0, 0, 0, 0, 0.2, 0])


def test_bounded_candidates_give_the_same_tokens_as_sorting_everything():
    logits = jnp.asarray(make_logits(0, flat_rows=(3,)))
    for counter in range(20):
        rows = rows_of(**ROWS, seeds=[7] * 6, counters=[counter] * 6)
        fast = sample(logits, rows, SamplerConfig(False, 64, None)).tokens
        full = sample(logits, rows, SamplerConfig(False, VOCAB, None)).tokens
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(full))


def test_draws_stay_inside_the_oracles_kept_set():
    logits = make_logits(1, flat_rows=(3,))
    draws = {r: set() for r in range(6)}
    for counter in range(60):
        rows = rows_of(**ROWS, seeds=[3] * 6, counters=[counter] * 6)
        tokens = np.asarray(sample(jnp.asarray(logits), rows, SamplerConfig(False, 64, None)).tokens)
        for r, t in enumerate(tokens):
            draws[r].add(int(t))
    assert draws[0] == {int(np.argmax(logits[0]))}  # greedy
    for r in range(1, 6):
        oracle = kept_set(logits[r], ROWS["temperature"][r], ROWS["top_k"][r], ROWS["top_p"][r], ROWS["min_p"][r])
        assert draws[r] <= oracle, r
        assert len(draws[r]) > 1  # actually random


def test_logprobs_only_when_asked_and_match_log_softmax():
    logits = make_logits(2)
    rows = rows_of(**ROWS, seeds=[1] * 6, counters=[0] * 6)
    assert sample(jnp.asarray(logits), rows, SamplerConfig(False, 64, None)).logprobs is None
    out = sample(jnp.asarray(logits), rows, SamplerConfig(False, 64, 4))
    want = jax.nn.log_softmax(jnp.asarray(logits, jnp.float64 if jax.config.x64_enabled else jnp.float32))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(want)[np.arange(6), tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], np.argmax(logits, axis=1))
    assert int(out.ranks[0]) == 1


def test_sampler_config_is_one_of_two_static_keys():
    """A step compiles GREEDY or the full config whatever mix of requests it has (two variants to
    precompile); the full one's candidates and top logprobs are fixed, not bucketed to the rows."""
    greedy = SamplingParams(temperature=0)
    full = full_config(VOCAB, max_logprobs=20)
    assert sampler_config([greedy, greedy], VOCAB) == GREEDY == SamplerConfig(True, 0, None, False)
    assert sampler_config([SamplingParams(temperature=0, prompt_logprobs=2)], VOCAB) == GREEDY  # its own call
    assert sampler_config([greedy, greedy], VOCAB, processors=True) == full
    assert full == SamplerConfig(False, MIN_CANDIDATES, 20, True)
    for params in ([greedy, SamplingParams(temperature=1.0)], [SamplingParams(top_k=50)],
                   [SamplingParams(top_p=0.9), SamplingParams(top_k=300)], [SamplingParams(top_k=5000)],
                   [SamplingParams(logprobs=3), greedy]):
        assert sampler_config(params, VOCAB) == full
    assert full_config(100, max_logprobs=20) == SamplerConfig(False, 100, 20, True)  # both capped at the vocabulary
    assert full_config(VOCAB, max_logprobs=0).num_top == 1


# rows whose top_k reaches past 64 candidates: alone, with a top_p that closes early, on a flat row
WIDE = dict(temperature=[1.0, 0.9, 1.0, 0.0, 1.2, 1.0], top_k=[300, 300, 2000, 300, 65, 64],
            top_p=[1, 0.5, 0.95, 1, 1, 0.9], min_p=[0, 0, 0, 0, 0.05, 0])


def test_a_top_k_wider_than_the_candidates_is_drawn_over_the_whole_vocabulary():
    logits = make_logits(4, flat_rows=(2,))
    draws = {r: set() for r in range(6)}
    for counter in range(40):
        rows = rows_of(**WIDE, seeds=[13] * 6, counters=[counter] * 6)
        fast = np.asarray(sample(jnp.asarray(logits), rows, SamplerConfig(False, 64, None)).tokens)
        full = np.asarray(sample(jnp.asarray(logits), rows, SamplerConfig(False, VOCAB, None)).tokens)
        np.testing.assert_array_equal(fast, full)
        for r, t in enumerate(fast):
            draws[r].add(int(t))
    for r in (0, 1, 2, 4, 5):
        oracle = kept_set(logits[r], WIDE["temperature"][r], WIDE["top_k"][r], WIDE["top_p"][r], WIDE["min_p"][r])
        assert draws[r] <= oracle and len(draws[r]) > 1, r
    rank = np.argsort(np.argsort(-logits[2]))  # the flat row: its draws reach far past the 64 candidates
    assert max(rank[t] for t in draws[2]) > 64


def test_logprobs_are_skipped_when_no_row_wants_them():
    logits = jnp.asarray(make_logits(5))
    rows = rows_of(**ROWS, seeds=[1] * 6, counters=[0] * 6)
    config = SamplerConfig(False, 64, 4)
    asked = sample(logits, rows, config, wants_logprobs=jnp.asarray([0, 0, 1, 0, 0, 0]))
    everything = sample(logits, rows, config)
    np.testing.assert_allclose(np.asarray(asked.top_logprobs), np.asarray(everything.top_logprobs))
    none = sample(logits, rows, config, wants_logprobs=jnp.zeros(6, jnp.int32))
    np.testing.assert_array_equal(np.asarray(none.tokens), np.asarray(everything.tokens))
    assert not np.asarray(none.top_logprobs).any() and not np.asarray(none.logprobs).any()


@pytest.mark.parametrize("counter", [0, 5])
def test_a_seeded_draw_depends_on_seed_and_counter_only(counter):
    logits = make_logits(3)
    one = rows_of(**{k: v[2:3] for k, v in ROWS.items()}, seeds=[11], counters=[counter])
    alone = int(sample(jnp.asarray(logits[2:3]), one, SamplerConfig(False, 8, None)).tokens[0])  # fewer candidates
    batch = rows_of(**ROWS, seeds=[5, 5, 11, 5, 5, 5], counters=[1, 2, counter, 3, 4, 5])
    assert int(sample(jnp.asarray(logits), batch, SamplerConfig(False, 64, None)).tokens[2]) == alone


def test_draw_frequencies_follow_the_distribution():
    """The hashed Gumbel noise samples softmax(logits / T): 4,000 draws of a 4-token row."""
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = jnp.asarray(np.tile(np.log(probs).astype(np.float32), (4000, 1)))
    n = 4000
    rows = rows_of([1.0] * n, [0] * n, [1.0] * n, [0.0] * n, seeds=[9] * n, counters=list(range(n)))
    tokens = np.asarray(sample(logits, rows, SamplerConfig(False, 0, None)).tokens)
    np.testing.assert_allclose(np.bincount(tokens, minlength=4) / n, probs, atol=0.025)


def test_gumbel_noise_is_finite_at_the_extremes():
    """An infinite noise value would pick its token whatever the filters (-inf + inf = NaN wins argmax)."""
    bits = jnp.asarray(np.array([0, 1, 2**31, 2**32 - 512, 2**32 - 1], np.uint32))
    noise = np.asarray(_gumbel_from_bits(bits))
    assert np.all(np.isfinite(noise)), noise


@pytest.mark.parametrize("shape", [(3, 640), (2, 3, 1000), (4, 64), (4, 65), (5, 1), (2, 151936)])
def test_argmax_is_jnp_argmax(shape):
    """The two-level argmax picks what jnp.argmax picks: the first of tied maxima, across and
    inside chunks, with padding, infinities and -inf rows; a NaN wins like +inf."""
    from dcpjax.sampling import argmax

    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[:, -1] = flat.max(axis=-1)  # a tie with the last entry: the earlier one wins
    if shape[-1] > 70:
        flat[0, 66] = flat[0, 3] = np.inf  # +inf in two chunks
        flat[1, 69] = np.nan
        flat[-1] = -np.inf  # nothing but -inf: index 0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
