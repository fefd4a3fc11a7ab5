"""The batched sampler that runs inside the model step (the request side: `params.SamplingParams`).

The sampler never sorts the whole vocabulary: greedy rows are an argmax; temperature
and min_p are elementwise masks; top_k / top_p rows look at the `candidates` best tokens
(`lax.top_k`) and draw among them; a nucleus that reaches past them (a flat
distribution), or a top_k wider than them, is found by bisection on the cutoff logit over the
whole vocabulary (32 masked sums each) and drawn from there, under a `lax.cond`, so only when it
happens. A step compiles one of two configs (`sampler_config`): greedy, or one that serves every
row, whose optional parts (candidates, logprobs) are skipped at run time when no row uses them.
Tokens whose logits tie at the cutoff are kept or dropped together. Every draw's key depends
only on (seed, counter): a seeded request
reproduces whatever the batch: the Gumbel noise of a draw is a hash of (key, token id),
so it does not depend on the batch, the number of candidates, or which path was taken.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dcpjax.sampling.params import MAX_LOGPROBS, SamplingParams


class SamplerConfig(NamedTuple):
    """The static part of one step's sampling (a compile key; few distinct values).

    all_greedy: every row is greedy (no random draws at all).
    candidates: tokens `lax.top_k` keeps for top_k / top_p rows (0: no such row).
    num_top: top log-probabilities to return (None: no row asked for logprobs).
    processors: a row edits its logits first (penalties, logit_bias, ...: `logits_processors`).
    """

    all_greedy: bool = True
    candidates: int = 0
    num_top: int | None = None
    processors: bool = False


MIN_CANDIDATES = 256  # top_p rows: nuclei wider than this are found by bisection instead


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (the bucket of a compile key)."""
    return 1 << max(0, (n - 1).bit_length())



def sampler_config(params: Sequence[SamplingParams], vocab_size: int, processors: bool = False,
                   max_logprobs: int = MAX_LOGPROBS) -> SamplerConfig:
    """The SamplerConfig for a step whose sampling rows use `params` (`processors`: some row edits
    its logits): one of two, so that a step has two sampler variants to compile, not one per mix of
    requests. GREEDY when every row is greedy and asks for nothing else; else `full_config`."""
    if processors or any(p.temperature > 0 or p.needs_logprobs for p in params):
        return full_config(vocab_size, max_logprobs)
    return GREEDY


def full_config(vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> SamplerConfig:
    """The config that serves any row: random draws among `MIN_CANDIDATES` (a wider top_k or
    nucleus by bisection), `max_logprobs` top logprobs and logits processors. What a row does
    not use is skipped at run time (`lax.cond`s on the rows' values), not compiled out."""
    return SamplerConfig(False, min(vocab_size, MIN_CANDIDATES), min(vocab_size, max(1, max_logprobs)), True)


GREEDY = SamplerConfig()  # every row greedy, no logprobs, no logits processors: argmax only


class SamplingRows(NamedTuple):
    """Per-row sampling inputs, [B] each."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    min_p: jax.Array  # float32, 0 = off
    seeds: jax.Array  # uint32 per-request seeds
    counters: jax.Array  # int32 tokens generated so far (the draw's index)


class Sampled(NamedTuple):
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array | None = None  # [B] float32, log-probability of the chosen token
    ranks: jax.Array | None = None  # [B] int32, 1 = the most likely token
    top_ids: jax.Array | None = None  # [B, num_top] int32
    top_logprobs: jax.Array | None = None  # [B, num_top] float32


def _nucleus_cutoff(scaled, top_k, top_p, candidates: int):
    """Per row, the smallest scaled logit that top_k and top_p keep (-inf: they keep all),
    looking at the best `candidates` tokens only; and whether that was not enough."""
    vocab = scaled.shape[-1]
    values, ids = jax.lax.top_k(scaled, candidates)  # [B, K], descending
    rank = jnp.arange(candidates)[None, :]
    in_k = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
    # top_p is measured on the top_k-renormalised distribution (as vLLM does)
    lse = jnp.where(top_k > 0, jax.nn.logsumexp(jnp.where(in_k, values, -jnp.inf), axis=-1),
                    jax.nn.logsumexp(scaled, axis=-1))
    probs = jnp.where(in_k, jnp.exp(values - lse[:, None]), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = (in_k & (before < top_p[:, None])).at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, values, jnp.inf), axis=-1)
    filtered = (top_k > 0) | (top_p < 1)
    cutoff = jnp.where(filtered, cutoff, -jnp.inf)
    # tokens past the candidates may belong: top_k reaches past them (its renormalisation too), or
    # every candidate is kept and the nucleus is still open
    too_few = filtered & (candidates < vocab) & ((top_k > candidates) | (keep[:, -1] & (top_k <= 0)))
    return cutoff, too_few, values, ids


def _fmix32(x):
    """murmur3's 32-bit finaliser: a bijective avalanche mix of uint32 values."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _gumbel_noise(key_bits, token_ids):
    """Gumbel noise for each (draw key, token id): [B, 2] uint32 keys, [B, N] ids -> [B, N].

    A function of the token id, not of its position in some array, so drawing among a
    row's candidates and drawing from the whole vocabulary pick the same token
    (argmax of logit + noise over the kept tokens) whatever the number of candidates.
    """
    ids = token_ids.astype(jnp.uint32)
    x = _fmix32(ids * jnp.uint32(0x9E3779B9) ^ key_bits[:, :1])
    return _gumbel_from_bits(_fmix32(x ^ key_bits[:, 1:2]))


def _gumbel_from_bits(x):
    """uint32 -> Gumbel noise, always finite: 23 bits make a uniform in (0, 1) that float32
    holds exactly ((2**23 - 1 + 0.5) / 2**23 < 1; with 24 bits it rounds to 1.0 -> +inf)."""
    uniform = ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(uniform))


def _sortable(x):
    """float32 -> int32 keys in the same order (flip the magnitude bits of negatives)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _unsortable(key):
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _bisect(scaled, above, limit):
    """Per row, the smallest logit t with above(t) < limit, by bisection on t's float ordering (32
    masked reductions over the vocabulary, no sort). above: [B] threshold -> [B], non-increasing in t;
    above(best logit) < limit. Ties at t are kept with it: t is always some token's logit."""
    best = jnp.max(scaled, axis=-1)
    low = _sortable(jnp.full_like(best, -jnp.inf))
    high = _sortable(best)

    def halve(_, bounds):
        low, high = bounds
        mid = (low >> 1) + (high >> 1) + (low & high & 1)  # no int32 overflow
        ok = above(_unsortable(mid)) < limit
        return jnp.where(ok, low, mid), jnp.where(ok, mid, high)

    low, high = jax.lax.fori_loop(0, 32, halve, (low, high))
    return _unsortable(high)


def _bisect_cutoff(scaled, top_k, top_p):
    """Per row, the smallest scaled logit that top_k and then top_p (on the top_k-renormalised
    distribution) keep, over the whole vocabulary: [B, V] -> [B] (-inf: they keep all)."""
    count = lambda t: jnp.sum(scaled > t[:, None], axis=-1)
    k_cutoff = jnp.where(top_k > 0, _bisect(scaled, count, top_k), -jnp.inf)
    probs = jax.nn.softmax(jnp.where(scaled >= k_cutoff[:, None], scaled, -jnp.inf), axis=-1)
    mass = lambda t: jnp.sum(jnp.where(scaled > t[:, None], probs, 0.0), axis=-1)
    p_cutoff = jnp.where(top_p < 1, _bisect(scaled, mass, top_p), -jnp.inf)
    return jnp.maximum(k_cutoff, p_cutoff)


ARGMAX_CHUNK = 64


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; a NaN counts as +inf), in two
    short reductions: the best of each chunk of 64 entries, then the best inside the winning
    chunk. XLA:CPU's one-pass argmax over a long axis is several times slower (a greedy row of
    640 logits: 97 -> 18 us; 64 rows of 151,936: 42 -> 2.7 ms, `benchmarks/sampling.py`)."""
    *lead, vocab = x.shape
    if vocab <= ARGMAX_CHUNK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    pad = -vocab % ARGMAX_CHUNK
    if pad:  # -inf never wins over a real entry
        x = jnp.concatenate([x, jnp.full((*lead, pad), -jnp.inf, x.dtype)], axis=-1)
    chunks = x.reshape(*lead, -1, ARGMAX_CHUNK)
    # XLA:CPU's max skips NaN. A chunk's sum is NaN if it holds a NaN, or both infinities (and then
    # +inf is its max anyway); finite logits never overflow to infinity.
    chunk_max = jnp.where(jnp.isnan(jnp.sum(chunks, axis=-1)), jnp.inf, jnp.max(chunks, axis=-1))
    best_chunk = jnp.argmax(chunk_max, axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(chunks, best_chunk[..., None, None], axis=-2)[..., 0, :]
    return best_chunk * ARGMAX_CHUNK + jnp.argmax(inside, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, rows: SamplingRows, config: SamplerConfig, raw_logits: jax.Array | None = None,
           wants_logprobs: jax.Array | None = None) -> Sampled:
    """Pick one token per row of `logits` [B, V] float32 (the model's, after any logits processors).

    Filters apply as in vLLM: temperature, then top_k, then top_p on the top_k-renormalised
    distribution, and min_p relative to the best token; the best token always stays.
    Returned log-probabilities are of the raw logits (`raw_logits`, default `logits`; log_softmax),
    as vLLM reports them, for `config.num_top` top tokens; `wants_logprobs` [B] (optional): when
    no row asks, they are zeros and cost nothing.
    """
    greedy_tokens = argmax(logits)
    tokens = greedy_tokens if config.all_greedy else _draw_random(logits, rows, config, greedy_tokens)
    if config.num_top is None:
        return Sampled(tokens)
    raw = logits if raw_logits is None else raw_logits
    reported = lambda: token_logprobs(raw, tokens, config.num_top)
    if wants_logprobs is not None:
        shapes = jax.eval_shape(reported)
        reported = functools.partial(jax.lax.cond, jnp.any(wants_logprobs > 0), reported,
                                     lambda: tuple(jnp.zeros(x.shape, x.dtype) for x in shapes))
    return Sampled(tokens, *reported())


def _draw_random(logits, rows: SamplingRows, config: SamplerConfig, greedy_tokens):
    """[B] tokens: the greedy rows' `greedy_tokens`, the others a seeded draw under their filters."""
    greedy = rows.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, rows.temperature)[:, None]
    best = jnp.max(scaled, axis=-1)
    cutoff = jnp.where(rows.min_p > 0, best + jnp.log(jnp.maximum(rows.min_p, 1e-30)), -jnp.inf)
    key_bits = jax.vmap(lambda seed, count: jax.random.bits(jax.random.fold_in(jax.random.key(seed), count), (2,)))(
        rows.seeds, rows.counters)  # [B, 2] uint32: the draw's key

    def draw_from_vocabulary(cutoff):
        ids = jnp.broadcast_to(jnp.arange(scaled.shape[-1], dtype=jnp.int32), scaled.shape)
        keep = scaled >= jnp.minimum(cutoff, best)[:, None]  # masked after the noise: never -inf + noise
        return argmax(jnp.where(keep, scaled + _gumbel_noise(key_bits, ids), -jnp.inf))

    if not config.candidates:
        return jnp.where(greedy, greedy_tokens, draw_from_vocabulary(cutoff))
    # A row whose kept set lies inside its candidates draws among them (K values, not V); the
    # others draw from the whole vocabulary. Each part runs under a cond, so that it costs only
    # when some row needs it. Which draw a row gets depends on that row alone, so a seeded
    # request still reproduces whatever shares its batch.
    filtered = ((rows.top_k > 0) | (rows.top_p < 1)) & ~greedy
    batch = logits.shape[0]

    def among_candidates():
        nucleus, too_few, values, ids = _nucleus_cutoff(scaled, rows.top_k, rows.top_p, config.candidates)
        kept = jnp.minimum(jnp.maximum(cutoff, nucleus), best)[:, None]
        noisy = jnp.where(values >= kept, values + _gumbel_noise(key_bits, ids), -jnp.inf)
        among = jnp.take_along_axis(ids, jnp.argmax(noisy, axis=-1)[:, None], axis=1)[:, 0]
        return among.astype(jnp.int32), nucleus, too_few

    among, nucleus, too_few = jax.lax.cond(
        jnp.any(filtered), among_candidates,
        lambda: (jnp.zeros(batch, jnp.int32), jnp.full(batch, -jnp.inf, scaled.dtype), jnp.zeros(batch, bool)))
    inside = filtered & ~too_few
    drawn = jax.lax.cond(
        jnp.any(~inside & ~greedy),
        lambda: draw_from_vocabulary(jnp.maximum(
            cutoff, jnp.where(too_few, _bisect_cutoff(scaled, rows.top_k, rows.top_p), nucleus))),
        lambda: jnp.zeros(batch, jnp.int32),
    )
    return jnp.where(greedy, greedy_tokens, jnp.where(inside, among, drawn))


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int):
    """Log-probabilities (log_softmax of raw logits, as vLLM reports them) of `tokens`.

    logits [..., V] float32, tokens [...] int32 -> (logprob [...], rank [...] int32 with 1
    the most likely, top_ids [..., num_top] int32, top_logprobs [..., num_top]).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    ranks = 1 + jnp.sum(logprobs > chosen[..., None], axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs
