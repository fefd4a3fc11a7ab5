"""Generate from a shell: `python -m dcpjax.generate` (the README's first command).

    python -m dcpjax.generate --model smollm2-135m-instruct --num-cpu-devices 9 \\
        --tensor-parallel-size 9 --decode-context-parallel-size 3 --chat --compare-dcp-1

The model (--model, or a positional MODEL as in `vllm serve MODEL`) is a built-in name
(the pretrained "smollm2-135m-instruct", or a tiny model with random weights, whose text
is noise by design), a Hugging Face folder or a GGUF file. --chat sends each --prompt as
a user message through the model's chat template. With --compare-dcp-1 it also runs the
same prompts at DCP 1 and the same TP with the same KV bytes per device, and prints the
KV capacity of both, the time of each run and whether greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import dcpjax
from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli
from dcpjax.loader.model_source import DEFAULT_PRETRAINED, has_random_weights

PRETRAINED = DEFAULT_PRETRAINED  # the built-in model with real weights it suggests (smollm2-135m-instruct)
DEFAULT_PROMPTS = [
    "Decode context parallelism splits the KV cache by token position.",
    "The quick brown fox",
]
DEFAULT_CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain in two sentences why the sky is blue.",
]


def build_parser() -> argparse.ArgumentParser:
    """The parser: the engine flags (`EngineArgs`), then prompts and sampling."""
    p = cli.ArgumentParser(prog="python -m dcpjax.generate", description=__doc__.split("\n\n")[0])
    cli.add_model_positional(p)
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", action="append", help="repeat for several prompts (default: a few built-in ones)")
    sampling = p.add_argument_group("sampling (SamplingParams; the defaults are greedy)")
    sampling.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most per prompt; prompt "
                          "+ max tokens past --max-model-len stops there, with a warning (default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 keeps every token "
                          "(default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 keeps every token "
                          "(default: %(default)s)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the likeliest's "
                          "probability (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the model's "
                   "chat template (LLM.chat)")
    p.add_argument("--compare-dcp-1", action="store_true", help="also run at DCP 1 (same TP, same KV bytes per "
                   "device) and compare")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    cli.add_debug_flag(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed."""
    return cli.parse_with_model(build_parser(), argv)


def say_if_random(engine_args: EngineArgs) -> None:
    """First line of the output: the model's weights are random (a tiny built-in, load_format dummy)."""
    if has_random_weights(engine_args.model, engine_args.load_format) and not engine_args.orbax_checkpoint:
        print(f"note: {engine_args.model} has random weights, so the text below is noise by design; for real text "
              f"run the built-in pretrained model: --model {PRETRAINED}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Generate (and compare with DCP 1); exit status 1 if greedy outputs differ."""
    args = parse_args(argv)
    cli.configure_logging()
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.use_cpu_devices()
    if not args.json:
        say_if_random(engine_args)

    prompts = args.prompt or (DEFAULT_CHAT_PROMPTS if args.chat else DEFAULT_PROMPTS)
    params = dcpjax.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    runs = [args.decode_context_parallel_size]
    if args.compare_dcp_1 and args.decode_context_parallel_size > 1:
        runs.append(1)
    results = {}
    for dcp in sorted(runs):  # DCP 1 first: its budget holds one sequence wherever DCP k's does
        llm = dcpjax.LLM.from_engine_args(engine_args.with_dcp(dcp))
        # the comparison is at equal KV bytes per device: the first run's (chosen or sized) budget
        engine_args = engine_args.with_kv_bytes(llm.kv_cache_memory_bytes)
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
            for out, question in zip(outputs, prompts):
                out.prompt = question  # print the question, not the whole rendered template
        else:
            outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        results[dcp] = dict(kv_cache_size_tokens=llm.kv_cache_size_tokens, seconds=seconds, outputs=outputs)
        del llm
        gc.collect()  # free this run's KV cache and weights before the next run sizes its own
    main_run = results[runs[0]]
    if args.json:
        print(json.dumps({
            f"dcp{dcp}": dict(kv_cache_size_tokens=r["kv_cache_size_tokens"],
                              outputs=[dict(prompt=o.prompt, text=o.outputs[0].text, token_ids=o.outputs[0].token_ids,
                                            finish_reason=o.outputs[0].finish_reason) for o in r["outputs"]])
            for dcp, r in results.items()
        }))
        return 0
    tokens = sum(len(o.outputs[0].token_ids) for o in main_run["outputs"])
    print(f"\nTP {args.tensor_parallel_size}, DCP {runs[0]}: KV cache holds {main_run['kv_cache_size_tokens']:,} "
          f"tokens; {tokens} tokens generated in {main_run['seconds']:.2f} s (first call includes compilation)")
    for out in main_run["outputs"]:
        completion = out.outputs[0]
        print(f"\nprompt: {out.prompt!r}\noutput: {completion.text!r}\n"
              f"tokens: {completion.token_ids[:16]}{' ...' if len(completion.token_ids) > 16 else ''} "
              f"({completion.finish_reason})")
    if len(runs) == 2:
        other = results[1]
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids
                   for a, b in zip(main_run["outputs"], other["outputs"]))
        ratio = main_run["kv_cache_size_tokens"] / other["kv_cache_size_tokens"]
        print(f"\nDCP {runs[0]} vs DCP 1 at TP {args.tensor_parallel_size}, same KV bytes per device: KV capacity "
              f"{ratio:.2f}x ({main_run['kv_cache_size_tokens']:,} vs {other['kv_cache_size_tokens']:,} tokens); "
              f"run time {main_run['seconds']:.2f} s vs {other['seconds']:.2f} s; greedy outputs identical: {same}")
        if args.temperature == 0 and not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
