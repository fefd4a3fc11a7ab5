"""Write a Llama-shaped Hugging Face folder whose greedy text cycles, and prompts that hold its cycles.

    pip install -e ".[bench]"
    python benchmarks/make_cycle_llama.py /tmp/cycle-llama --prompts /tmp/cycle-prompts.json

The speculative-decoding workload of RESULTS.md: continuations that repeat text already in the
context, where n-gram prompt lookup can propose the right tokens (random-weight models never
repeat themselves, so they cannot show it). The weights are constructed, not trained: the
token ids >= 3 are split into cycles of 8-64 ids, and the next token is a fixed function of the
current one (its successor in its cycle): every attention and MLP output projection is zero, so
the residual stream is the token's embedding, and the LM head row of token y is the embedding of
y's predecessor. Attention and MLPs still run in full (their outputs are multiplied by zero at
run time, not removed), so a step costs what a random model of the same shape costs.

Each prompt is a walk along one cycle, longer than the cycle: its greedy continuation repeats it.
Acceptance on this workload is the machinery's ceiling (every proposal right once the cycle is in
the context), not the rate of a real model.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from make_hf_llama import add_shape_args, random_llama  # run as a script: benchmarks/ is on sys.path


def cycles(vocab: int, rng: np.random.Generator, min_len: int, max_len: int) -> list[np.ndarray]:
    """The ids >= 3, shuffled and cut into cycles of min_len..max_len ids (the last may be shorter)."""
    ids, out, at = rng.permutation(np.arange(3, vocab)), [], 0
    while at < len(ids):
        size = int(rng.integers(min_len, max_len + 1))
        out.append(ids[at : at + size])
        at += size
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.set_defaults(hidden=128)
    p.add_argument("--prompts", required=True, help="write the prompts (a JSON list of token id lists) here")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--min-cycle", type=int, default=8)
    p.add_argument("--max-cycle", type=int, default=64)
    args = p.parse_args(argv)
    import torch

    model = random_llama(args)  # seeds torch; the weights below replace the projections that matter
    rng = np.random.default_rng(args.seed)
    successor = np.full(args.vocab, 3)  # the special ids lead into the first cycle
    loops = cycles(args.vocab, rng, args.min_cycle, args.max_cycle)
    for loop in loops:
        successor[loop] = np.roll(loop, -1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.randn(args.vocab, args.hidden)
        model.model.embed_tokens.weight.copy_(embed)
        head = torch.zeros(args.vocab, args.hidden)
        head[torch.from_numpy(successor[3:])] = embed[3:]  # row y = embedding of y's predecessor
        model.lm_head.weight.copy_(4.0 * head)
    model.save_pretrained(args.out, safe_serialization=True)
    long_enough = [loop for loop in loops if len(loop) >= args.min_cycle]
    prompts = []
    for i in range(args.num_prompts):
        loop = long_enough[i % len(long_enough)]
        start = int(rng.integers(len(loop)))
        prompts.append(np.resize(np.roll(loop, -start), args.input_len).tolist())
    # check: greedy decoding continues every prompt's cycle
    with torch.no_grad():
        ids = torch.tensor(prompts)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, pad_token_id=0)[:, ids.shape[1]:]
    expected = [[int(x) for x in _walk(successor, prompt[-1], 16)] for prompt in prompts]
    if out.tolist() != expected:
        print("the constructed model does not follow its cycles", file=sys.stderr)
        return 1
    with open(args.prompts, "w") as f:
        json.dump(prompts, f)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters, {len(loops)} cycles) "
          f"and {len(prompts)} prompts of {args.input_len} tokens to {args.prompts}")
    return 0


def _walk(successor: np.ndarray, token: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = int(successor[token])
        out.append(token)
    return out


if __name__ == "__main__":
    sys.exit(main())
