"""Sampler cost at a large vocabulary: the in-step sampler against sorting the whole vocabulary.

    python benchmarks/sampling.py                       # Qwen's vocabulary (151,936), batch 64
    python benchmarks/sampling.py --vocab 32000 --batch 128

"sort everything" is the sampler dcpjax used before issue 7 (one `lax.top_k(vocab)` for
every row, greedy or not, and log-probabilities always), kept here as the baseline. Both
run jitted on the same logits in the same process; medians of --iters calls. "peaked"
logits put most of the mass on a few dozen tokens, as a trained LM's next-token
distribution does; "flat" logits (random normal) have a top-p nucleus of thousands of
tokens, past the sampler's candidates, so it takes its bisection path.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from dcpjax.bench.timing import median_seconds
from dcpjax.sampling import SamplingParams, SamplingRows, sample, sampler_config
from dcpjax.sampling import logits_processors as lp


def sort_everything(logits, temperature, top_k, top_p, min_p, seeds, counters):
    """The previous sampler: sort the whole vocabulary for every row; logprobs always."""
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    values, order = jax.lax.top_k(scaled, vocab)
    rank = jnp.arange(vocab)[None, :]
    values = jnp.where(rank < jnp.where(top_k > 0, top_k, vocab)[:, None], values, -jnp.inf)
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = ((before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])).at[:, 0].set(True)
    filtered = jnp.where(keep, values, -jnp.inf)
    keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(seeds, counters)
    choice = jax.vmap(jax.random.categorical)(keys, filtered)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=1)[:, 0]
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, 1)
    return tokens, chosen, top_ids, top_logprobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    flat = rng.normal(size=(args.batch, args.vocab)).astype(np.float32) * 3
    peaked = rng.normal(size=(args.batch, args.vocab)).astype(np.float32)
    for row in peaked:  # a few dozen likely tokens, Zipf-like: the nucleus fits the candidates
        row[rng.choice(args.vocab, 40, replace=False)] += 24 - 2 * np.log1p(np.arange(40))
    peaked, flat = jnp.asarray(peaked), jnp.asarray(flat)
    greedy, top_p = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95)
    mixes = {"all greedy": ([greedy] * args.batch, peaked),
             "half greedy, half top-p 0.95 (peaked)": ([greedy, top_p] * (args.batch // 2), peaked),
             "all top-p 0.95 (peaked)": ([top_p] * args.batch, peaked),
             "all top-p 0.95 (flat: bisection)": ([top_p] * args.batch, flat)}
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, vocab {args.vocab:,}, batch {args.batch}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| rows | sort everything (ms) | in-step sampler (ms) | speed-up |")
    print("|---|---:|---:|---:|")
    for name, (params, logits) in mixes.items():
        f32 = lambda xs: jnp.asarray(np.asarray(xs, np.float32))
        i32 = lambda xs: jnp.asarray(np.asarray(xs, np.int32))
        args_ = (f32([q.temperature for q in params]), i32([q.top_k for q in params]), f32([q.top_p for q in params]),
                 f32([q.min_p for q in params]), jnp.arange(args.batch, dtype=jnp.uint32), i32([0] * args.batch))
        old = jax.jit(sort_everything)
        config = sampler_config(params, args.vocab)
        new = jax.jit(lambda x, *a, config=config: sample(x, SamplingRows(*a), config).tokens)
        old_ms = 1e3 * median_seconds(functools.partial(old, logits, *args_), args.iters)
        new_ms = 1e3 * median_seconds(functools.partial(new, logits, *args_), args.iters)
        print(f"| {name} | {old_ms:.1f} | {new_ms:.2f} | {old_ms / new_ms:.0f}x |", flush=True)
    processors_cost(peaked, args)
    return 0


def processors_cost(logits, args) -> None:
    """What penalties, logit_bias and bad words add to a greedy step: `logits_processors.apply` before
    the sampler and `record` after it, every row with its own slot state, against the sampler alone."""
    batch, vocab = logits.shape
    state = lp.empty_state(batch, vocab)
    rows = lp.ProcessorRows(jnp.ones(batch, bool), jnp.full(batch, 0.5), jnp.full(batch, 0.3), jnp.full(batch, 1.2),
                            jnp.full(batch, 4, jnp.int32), jnp.zeros(batch, jnp.int32))
    config = sampler_config([SamplingParams(temperature=0)] * batch, vocab, processors=True)
    sampling = SamplingRows(temperature=jnp.zeros(batch), top_k=jnp.zeros(batch, jnp.int32), top_p=jnp.ones(batch),
                            min_p=jnp.zeros(batch), seeds=jnp.arange(batch, dtype=jnp.uint32),
                            counters=jnp.zeros(batch, jnp.int32))
    slots = jnp.arange(batch, dtype=jnp.int32)
    alone = jax.jit(lambda x: sample(x, sampling, config).tokens)

    @functools.partial(jax.jit, donate_argnums=1)  # as in the engine's step: the counts update in place
    def edited(x, state):
        tokens = sample(lp.apply(x, state, slots, rows), sampling, config, raw_logits=x).tokens
        return tokens, lp.record(state, slots, tokens)

    held = [state]

    def step():
        tokens, held[0] = edited(logits, held[0])
        return tokens

    alone_ms = 1e3 * median_seconds(functools.partial(alone, logits), args.iters)
    edited_ms = 1e3 * median_seconds(step, args.iters)
    print(f"\n| greedy rows, {batch} x {vocab:,} | sampler alone (ms) | + logits processors (ms) | added |")
    print("|---|---:|---:|---:|")
    print(f"| penalties + bias + bad words, every row | {alone_ms:.2f} | {edited_ms:.2f} | "
          f"{edited_ms - alone_ms:.2f} ms |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
