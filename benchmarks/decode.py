"""Decode speed of a whole model at DCP 1/2/4 (same TP), side by side, on fake CPU devices.

    python benchmarks/decode.py                    # tiny-llama at TP 8, contexts 1k and 8k
    python benchmarks/decode.py --model tiny-deepseek --dcp 1 2 4 8

For each DCP size it builds the LLM once, prefills a batch of long prompts and
times greedy decode steps (compiled once; the first step is excluded), reporting
the step time, tokens/s and the KV capacity. Ratios against DCP 1 are measured
in the same run. On fake CPU devices the 8 "devices" share the host's cores, so
the time tracks the total work of all devices; the KV each device reads per step
falls DCP-fold (duplicates removed), the FLOPs do not.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dcpjax.sharding.devices import use_cpu_devices

use_cpu_devices(8)

import numpy as np

import dcpjax


def run(model: str, tp: int, dcp: int, context: int, batch: int, steps: int, max_model_len: int | None = None) -> dict:
    llm = dcpjax.LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                     kv_cache_memory_bytes=256 << 20, max_model_len=max_model_len or context + steps + 8,
                     max_num_seqs=batch, max_num_batched_tokens=1024)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, context).tolist()} for _ in range(batch)]
    params = dcpjax.SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    runner = llm.runner
    times = []
    original = runner.launch

    def timed_launch(call):  # time decode steps (one token per sequence)
        start = time.perf_counter()
        result = original(call)
        result.output.block_until_ready()
        if call.shape.kind == "decode":
            times.append(time.perf_counter() - start)
        return result

    runner.launch = timed_launch
    llm.generate(prompts, params)
    decode = sorted(times[1:])  # the first decode step compiles
    step = decode[len(decode) // 2]
    return dict(dcp=dcp, step_ms=step * 1e3, tokens_per_s=batch / step, kv_tokens=llm.kv_cache_size_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--max-model-len", type=int, help="default: context + steps + 8; larger shows that a step "
                   "reads only the blocks its sequences reach")
    args = p.parse_args(argv)
    print(f"{args.model}, TP {args.tp}, batch {args.batch}, {args.steps} greedy steps, 8 fake CPU devices, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| context | DCP | decode step ms (median) | tokens/s | speed-up vs DCP 1 | KV cache size (tokens) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        base = None
        for dcp in args.dcp:
            r = run(args.model, args.tp, dcp, context, args.batch, args.steps, args.max_model_len)
            base = base or r
            print(f"| {context:,} | {dcp} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{base['step_ms'] / r['step_ms']:.2f}x | {r['kv_tokens']:,} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
