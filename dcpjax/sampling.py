"""Sampling parameters (vLLM's names) and the batched sampler that runs inside the model step.

The sampler never sorts the whole vocabulary unless a row needs it: greedy rows are an
argmax; temperature and min_p are elementwise masks; top_k / top_p rows look at the
`candidates` best tokens (`lax.top_k`) and fall back to the whole vocabulary (under a
`lax.cond`, so only when it happens) if a nucleus may reach beyond them. Every draw's
key depends only on (seed, counter): a seeded request reproduces whatever the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's fields and defaults).

    temperature 0 is greedy. top_k 0 or -1 and top_p 1 disable those filters.
    logprobs: how many top log-probabilities to return per generated token
    (the sampled token's is always included); None returns none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(field, rule):
            raise ValueError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 is greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None: up to max_model_len)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            bad("stop", "must be a non-empty string or a list of them")
        self.stop = stops
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        self.stop_token_ids = ids


class SamplerConfig(NamedTuple):
    """The static part of one step's sampling (a compile key; few distinct values).

    all_greedy: every row is greedy (no random draws at all).
    candidates: tokens `lax.top_k` keeps for top_k / top_p rows (0: no such row).
    num_top: top log-probabilities to return (None: no row asked for logprobs).
    """

    all_greedy: bool = True
    candidates: int = 0
    num_top: int | None = None


MIN_CANDIDATES = 256  # top_p rows: nuclei wider than this fall back to the whole vocabulary


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def sampler_config(params: Sequence[SamplingParams], vocab_size: int) -> SamplerConfig:
    """The SamplerConfig for a step whose sampling rows use `params`."""
    random = [p for p in params if p.temperature > 0]
    limits = [p.top_k for p in random if p.top_k > 0] + [MIN_CANDIDATES for p in random if p.top_p < 1]
    candidates = min(vocab_size, _pow2_at_least(max(limits))) if limits else 0
    asked = [p.logprobs for p in params if p.logprobs is not None]
    num_top = _pow2_at_least(max(max(asked), 1)) if asked else None
    return SamplerConfig(not random, candidates, num_top)


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
    values, _ = jax.lax.top_k(scaled, candidates)  # [B, K], descending
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
    # every candidate kept and the nucleus still open: tokens past the candidates may belong
    too_few = filtered & keep[:, -1] & (top_k <= 0) & (candidates < vocab)
    return cutoff, too_few


def sample(logits: jax.Array, rows: SamplingRows, config: SamplerConfig) -> Sampled:
    """Pick one token per row of `logits` [B, V] float32 (raw model logits).

    Filters apply as in vLLM: temperature, then top_k, then top_p on the top_k-renormalised
    distribution, and min_p relative to the best token; the best token always stays.
    Returned log-probabilities are of the raw logits (log_softmax), as vLLM reports them.
    """
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if config.all_greedy:
        tokens = greedy_tokens
    else:
        greedy = rows.temperature <= 0
        scaled = logits / jnp.where(greedy, 1.0, rows.temperature)[:, None]
        best = jnp.max(scaled, axis=-1)
        cutoff = jnp.where(rows.min_p > 0, best + jnp.log(jnp.maximum(rows.min_p, 1e-30)), -jnp.inf)
        if config.candidates:
            vocab = logits.shape[-1]
            nucleus, too_few = _nucleus_cutoff(scaled, rows.top_k, rows.top_p, config.candidates)
            nucleus = jax.lax.cond(  # the whole vocabulary only when some row needs it
                jnp.any(too_few & ~greedy),
                lambda: _nucleus_cutoff(scaled, rows.top_k, rows.top_p, vocab)[0],
                lambda: nucleus,
            )
            cutoff = jnp.maximum(cutoff, nucleus)
        masked = jnp.where(scaled >= jnp.minimum(cutoff, best)[:, None], scaled, -jnp.inf)
        keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(rows.seeds, rows.counters)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        tokens = jnp.where(greedy, greedy_tokens, drawn)
    if config.num_top is None:
        return Sampled(tokens)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, config.num_top)
    return Sampled(tokens, chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)
