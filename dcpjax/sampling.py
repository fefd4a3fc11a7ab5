"""Sampling parameters (vLLM's names) and the batched on-device sampler."""

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SampledBatch(NamedTuple):
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32, log-probability of the chosen token
    ranks: jax.Array  # [B] int32, 1 = the most likely token
    top_ids: jax.Array  # [B, K] int32
    top_logprobs: jax.Array  # [B, K] float32


def _filtered_sorted_logits(scaled, top_k, top_p, min_p):
    """Sort descending and mask what top_k, top_p and min_p exclude (the best token always stays)."""
    vocab = scaled.shape[-1]
    values, order = jax.lax.top_k(scaled, vocab)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    values = jnp.where(rank < k, values, -jnp.inf)
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = (before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    return jnp.where(keep, values, -jnp.inf), order


def sample(logits, temperature, top_k, top_p, min_p, seeds, counters, num_top: int) -> SampledBatch:
    """Pick one token per row.

    Args:
      logits: [B, V] float32 raw model logits.
      temperature, top_p, min_p: [B] float32; top_k: [B] int32 (0 = off).
      seeds: [B] uint32 per-request seeds; counters: [B] int32 tokens generated so far.
        The key of a draw depends only on (seed, counter), so a seeded request
        reproduces whatever else is in the batch.
      num_top: how many top log-probabilities to return (static).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    filtered, order = _filtered_sorted_logits(scaled, top_k, top_p, min_p)
    keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(seeds, counters)
    choice = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=1)[:, 0]
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, max(num_top, 1))
    return SampledBatch(tokens, chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)
