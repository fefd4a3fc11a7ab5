"""Offline greedy generation speed through the public API only (`LLM.generate`), so the same
script times any commit: before/after comparisons of the whole loop.

    python benchmarks/offline_generate.py --model /tmp/tiny-hf-llama --num-cpu-devices 1
    # a previous commit, side by side:
    git worktree add /tmp/before <commit> && PYTHONPATH=/tmp/before python benchmarks/offline_generate.py ...

Prints one JSON line: output tokens/s of the second of two identical runs (the first compiles).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("-tp", type=int, default=1)
    p.add_argument("-dcp", type=int, default=1)
    p.add_argument("--num-cpu-devices", type=int, default=1)
    p.add_argument("--max-model-len", type=int, help="default: input + output + 1 (larger: tables wider than needed)")
    args = p.parse_args(argv)
    from dcpjax.sharding.devices import use_cpu_devices

    use_cpu_devices(args.num_cpu_devices)
    import numpy as np

    import dcpjax

    llm = dcpjax.LLM(args.model, tensor_parallel_size=args.tp, decode_context_parallel_size=args.dcp,
                     max_model_len=args.max_model_len or args.input_len + args.output_len + 1,
                     max_num_seqs=args.num_prompts,
                     max_num_batched_tokens=4096, kv_cache_memory_bytes=256 << 20)
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    params = dcpjax.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps(dict(model=args.model, tp=args.tp, dcp=args.dcp, input_len=args.input_len,
                          max_model_len=llm.max_model_len, output_tokens=tokens, seconds=round(seconds, 3),
                          output_throughput=round(tokens / seconds, 1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
