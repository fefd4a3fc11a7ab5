"""Where a decode step's time goes: a jax.profiler trace of greedy decoding, and the XLA ops
that took longest in it, summed by name.

    python benchmarks/profile_decode.py                                   # SmolLM2, 1 CPU device, batch 1
    python benchmarks/profile_decode.py --batch 16 --dtype bfloat16 --trace-dir /tmp/trace
    python benchmarks/profile_decode.py --quantization gguf                # the GGUF held quantized

The trace (TensorBoard / Perfetto format) stays in --trace-dir. The speed itself, side by side
with transformers and against the weight-read floor, is `python -m dcpjax.bench throughput`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import sys
import tempfile
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def top_events(folder: str, top: int) -> list[tuple[str, float, int]]:
    """(name, total ms, count) of the trace's complete events, longest first (nested events overlap)."""
    traces = sorted(pathlib.Path(folder).glob("**/*.trace.json.gz"), key=os.path.getmtime)
    with gzip.open(traces[-1]) as f:
        events = json.load(f)["traceEvents"]
    spent, count = Counter(), Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            spent[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    return [(name, ms, count[name]) for name, ms in spent.most_common(top)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--quantization", default=None, help="as LLM(quantization=...): gguf holds the GGUF quantized")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--trace-dir", default=None, help="default: a temporary folder")
    args = p.parse_args(argv)
    from dcpjax.sharding.devices import use_cpu_devices

    use_cpu_devices(1)
    import jax
    import numpy as np

    import dcpjax

    llm = dcpjax.LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.new_tokens + 1,
                     max_num_seqs=args.batch, compilation_cache_dir="none", quantization=args.quantization)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, llm.model_config.vocab_size - 1, args.input_len).tolist()}
               for _ in range(args.batch)]
    params = dcpjax.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # compiles
    folder = args.trace_dir or tempfile.mkdtemp(prefix="dcpjax-trace-")
    with jax.profiler.trace(folder):
        llm.generate(prompts, params)
    print(f"{args.model} {args.dtype}, batch {args.batch}, {args.new_tokens} new tokens; trace in {folder}")
    print("| total ms | count | ms each | event |\n|---:|---:|---:|---|")
    for name, ms, n in top_events(folder, args.top):
        print(f"| {ms:.1f} | {n} | {ms / n:.3f} | {name[:100]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
