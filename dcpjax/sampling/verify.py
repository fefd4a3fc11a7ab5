"""Verification of drafts inside the target's step: which proposed tokens to keep, exactly.

A verify row holds the sequence's last token and its k drafts, [t, d1 .. dk] at positions
L-1 .. L-1+k; the target computes logits at every position (one chunk step: each query's causal
bound is its own position, on every DCP rank). Position j predicts output token c + j, where c is
the index of the next output token.

Every draft here is a point mass (prompt lookup proposes one token; the draft model proposes its
greedy token), and for a point-mass proposal q = delta(d) rejection sampling is: accept d with
probability min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(p - q, 0),
normalised, which is p with d removed. Drawing x ~ p and accepting iff x == d does exactly that:
P(accept) = p(d), and a rejected draw is x ~ p given x != d. So each position samples the
target distribution with the same sampler (and the same filters: temperature, top_k, top_p,
min_p) and the same (seed, c + j) key a non-speculative step would use for output token c + j;
drafts are accepted while they equal those samples, and the first sample that differs (or the
bonus after k accepted drafts) is the next token. Greedy is the same rule with argmax.

Consequence: speculative decoding emits the very tokens plain decoding would (greedy, and seeded
sampling too), up to floating point differences between the chunk and single-token computations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcpjax.sampling import Sampled, SamplerConfig, SamplingRows, sample


def verify_drafts(logits: jax.Array, tokens: jax.Array, count: jax.Array, rows: SamplingRows,
                  config: SamplerConfig) -> tuple[Sampled, jax.Array]:
    """Sample every position and find each row's next token after its accepted drafts.

    logits [B, T, V] float32 (replicated); tokens [B, T] int32, the row's input [t, d1 .. dk, pad];
    count [B] = 1 + k per row; rows: per-row sampling inputs [B] (counters: the first position's
    output index). Returns (Sampled with [B, T] fields: position j's sample and its logprobs,
    last [B]: the sample after the accepted drafts, the sequence's newest token).
    """
    batch, chunk, vocab = logits.shape
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    per_position = SamplingRows(*(jnp.repeat(x, chunk) for x in rows[:-1]),
                                counters=(rows.counters[:, None] + offsets[None, :]).reshape(-1))
    flat = sample(logits.reshape(batch * chunk, vocab), per_position, config)
    sampled = Sampled(*(None if x is None else x.reshape(batch, chunk, *x.shape[1:]) for x in flat))
    last = sampled.tokens[jnp.arange(batch), num_accepted(sampled.tokens, tokens, count)]
    return sampled, last


def num_accepted(samples: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
    """Leading drafts equal to the target's samples: samples [B, T], tokens [B, T] (drafts from
    column 1), count [B] -> [B] int32 in [0, count - 1]."""
    chunk = samples.shape[1]
    is_draft = jnp.arange(chunk - 1)[None, :] < (count[:, None] - 1)
    match = (samples[:, :-1] == tokens[:, 1:]) & is_draft
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
