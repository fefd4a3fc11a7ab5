"""`python -m dcpjax.bench throughput`: offline generation speed (vLLM's `bench throughput`).

Runs `num_prompts` random prompts of `input_len` tokens, each generating exactly
`output_len` tokens (greedy, EOS ignored), through `LLM.generate`, after one untimed
warm-up pass of the same workload (so every step shape is compiled before timing).
Reports output tokens/s, requests/s and a per-step breakdown of host work:

  schedule   the scheduler (queues, blocks, preemption)
  prepare    packing a model call's rows and the one host->device transfer
  dispatch   enqueueing the compiled step (model and sampling in one dispatch)
  wait       blocked on the device for a step's tokens
  process    reading tokens, detokenizing, stop checks, logprobs

Beside the device step it prints the weight-read floor of a step: the bytes of every device's
parameter shards over the host's read bandwidth, measured in the same run (numpy summing 512
MiB on every core; fake CPU devices share that memory). A decode step cannot beat it.

The KV cache: the tokens it holds (with sliding-window layers: the longest one sequence, full
layers' tokens plus each sliding layer's window, `models.kv_groups`), its blocks and bytes per
device, the same bytes per device at DCP 1 (the engine's own sizing arithmetic, same TP) and the
ratio, and the blocks the sliding layers freed behind their windows during the timed run.

Device time per step comes from a synchronous pass of the same workload (each step read
as soon as it is dispatched: dispatch + wait is the device's step); the asynchronous
run's wall time minus it is host time the device did not hide (device idle).
With --speculative-config, the same workload also runs on an engine without speculation in the
same process, and the speed-up, the mean acceptance length (1 + accepted drafts per verify row,
vLLM's definition), the acceptance rate and the accepted drafts per position are printed.
Every timed figure is the median of `--num-iters` runs (transformers' too): one 0.2 s run on
a shared machine is not a measurement.
`--dataset-path` reads the prompts from a JSON file: benchmarks/make_cycle_llama.py writes a model
whose greedy text cycles and prompts holding its cycles, where prompt lookup (ngram) proposes the
right tokens.
With --compare-transformers, Hugging Face transformers' `generate` runs the same
model (a folder, a GGUF file or the built-in "smollm2-135m-instruct": transformers reads
the GGUF with its own loader) and prompts in the same process under the same stopping
rule: greedy, EOS not a stop (`eos_token_id=None`, as dcpjax's ignore_eos: an argmax EOS
is emitted and decoding goes on), exactly `output_len` tokens; the ratio is printed. It
needs `pip install -e ".[bench]"`, checked before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import time

from dcpjax.engine.args import EngineArgs
from dcpjax.llm import LLM


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags, then the engine flags (`EngineArgs`, with this benchmark's defaults)."""
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-path", help="prompts from a JSON file (a list of token id lists; cycled to "
                   "--num-prompts, each cut to --input-len), e.g. benchmarks/make_cycle_llama.py's; default: "
                   "random token ids")
    p.add_argument("--num-iters", type=positive_int, default=5,
                   help="timed runs of the workload (and of transformers); the median run is reported")
    p.add_argument("--no-breakdown", action="store_true", help="skip the synchronous pass that measures device time")
    p.add_argument("--compare-transformers", action="store_true",
                   help="also time Hugging Face transformers' generate on the same folder and prompts")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    EngineArgs.add_cli_args(
        p, defaults={"max_num_batched_tokens": 4096, "max_num_seqs": None},
        default_help={"max_num_seqs": "--num-prompts", "max_model_len": "input-len + output-len + 1"},
    )


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine of this run: room for every prompt at once, max_model_len = input + output + 1."""
    return EngineArgs.from_cli_args(args, max_num_seqs=args.max_num_seqs or args.num_prompts,
                                    max_model_len=args.max_model_len or args.input_len + args.output_len + 1)


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    low = min(3, vocab - 1)  # skip the usual special ids (0-2) where the vocabulary allows
    return [rng.integers(low, vocab, length).tolist() for _ in range(num)]


def _file_prompts(path: str, num: int, length: int, vocab: int) -> list[list[int]]:
    """`num` prompts from a JSON list of token id lists (cycled), each cut to `length` tokens."""
    with open(path) as f:
        prompts = json.load(f)
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, list) and len(p) >= length and all(isinstance(t, int) and 0 <= t < vocab for t in p)
            for p in prompts):
        raise SystemExit(f"--dataset-path {path}: expected a JSON list of lists of >= {length} token ids in "
                         f"[0, {vocab})")
    return [prompts[i % len(prompts)][:length] for i in range(num)]


def _timed_generate(llm, prompts, params, async_scheduling: bool) -> dict:
    engine = llm.engine
    engine.async_scheduling = async_scheduling and engine.proposer is None  # speculation runs synchronously
    engine.reset_stats()
    llm.reset_prefix_cache()  # every pass computes every prompt: the warm-up's prefixes are no head start
    compiled, freed = llm.compiled_step_count, engine.num_dead_blocks_freed
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(seconds=seconds, output_tokens=tokens, timings=engine.timings.as_dict(),
                recompilations=llm.compiled_step_count - compiled, outputs=outputs,
                sliding_blocks_freed=engine.num_dead_blocks_freed - freed,
                spec_decode=engine.spec_stats.as_dict() if engine.spec_stats is not None else None)


def _median_generate(llm, prompts, params, async_scheduling: bool, iters: int) -> dict:
    """`iters` timed runs; the one with the median time, its recompilations those of every run
    (a 0.2 s run on a shared machine moves by 30%: one run is not a measurement)."""
    runs = [_timed_generate(llm, prompts, params, async_scheduling) for _ in range(iters)]
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return median | {"recompilations": sum(r["recompilations"] for r in runs),
                     "all_seconds": [r["seconds"] for r in runs]}


def _sampling_ms(vocab: int, batch: int) -> float:
    """The greedy sampler alone at this batch and vocabulary (it runs inside the step)."""
    import jax
    import numpy as np

    from dcpjax.bench.timing import median_seconds
    from dcpjax.sampling import SamplerConfig, SamplingRows, sample

    logits = jax.numpy.asarray(np.random.default_rng(0).normal(size=(batch, vocab)).astype(np.float32))
    zeros = jax.numpy.zeros(batch, jax.numpy.float32)
    rows = SamplingRows(zeros, zeros.astype(np.int32), zeros + 1, zeros, zeros.astype(np.uint32),
                        zeros.astype(np.int32))
    fn = jax.jit(lambda x: sample(x, rows, SamplerConfig()).tokens)
    return 1e3 * median_seconds(lambda: fn(logits), 20)


def _weight_read_floor(llm) -> dict:
    """The weight-read floor of one step (see the module docstring), measured now; on CPU only
    (an accelerator reads its weights from its own memory, not the host's)."""
    from dcpjax.bench.timing import read_bandwidth

    if llm.mesh.devices.flat[0].platform != "cpu":
        return {}
    weight_bytes, bandwidth = sum(llm.weight_bytes_by_device().values()), read_bandwidth()  # every fake device's
    return dict(weight_bytes=weight_bytes, read_bandwidth_GBps=bandwidth / 1e9,
                weight_read_floor_ms=1e3 * weight_bytes / bandwidth)


def kv_cache_summary(llm) -> dict:
    """The engine's KV cache (see the module docstring), and what the same bytes per device hold at DCP 1."""
    import dataclasses

    from dcpjax.runner.kv_budget import kv_cache_tokens
    from dcpjax.runner.kv_layout import kv_cache_layout

    info, cfg, pc = llm.kv_cache_info, llm.model_config, llm.parallel_config
    dcp1 = dataclasses.replace(pc, decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                               dcp_comm_backend="ag_rs")
    base = kv_cache_layout(cfg, dcp1, block_size=info["block_size"], bytes_per_device=info["bytes_per_device"],
                           dtype=info["dtype"])
    chunk = llm.scheduler_config.max_num_batched_tokens
    base_tokens = kv_cache_tokens(cfg, base.num_blocks, info["block_size"], 1, chunk)
    return dict(kv_cache_size_tokens=info["kv_cache_size_tokens"], kv_blocks=info["num_blocks"],
                kv_block_layers=info["layers_per_block"], kv_groups=info["num_groups"],
                sliding_groups=info["sliding_groups"], sliding_windows=info["sliding_windows"],
                kv_bytes_per_device=info["bytes_per_device"], dcp1_kv_cache_size_tokens=base_tokens,
                kv_tokens_vs_dcp1=info["kv_cache_size_tokens"] / base_tokens)


def check_transformers(model: str) -> None:
    """Fail before any timing if the transformers baseline cannot run (missing extras, a
    built-in random model transformers does not have)."""
    from dcpjax.loader.model_source import BUILTIN_GGUF, resolve

    try:
        kind, _ = resolve(model)
    except ValueError as error:
        raise SystemExit(f"--model: {error}") from None
    if kind not in ("hf", "gguf"):
        raise SystemExit("--compare-transformers needs --model to be a Hugging Face folder, a GGUF file or a built-in "
                         f"pretrained model ({', '.join(BUILTIN_GGUF)}); "
                         "benchmarks/make_hf_llama.py writes a tiny Llama")
    needed = ["torch", "transformers"] + (["gguf", "accelerate"] if kind == "gguf" else [])
    import importlib.util

    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"--compare-transformers needs {', '.join(missing)}: pip install -e \".[bench]\"")


def _load_transformers(model: str):
    import pathlib

    import torch
    import transformers

    from dcpjax.loader.model_source import resolve

    kind, path = resolve(model)
    path = pathlib.Path(path)
    if kind == "gguf":  # transformers' own GGUF loader, dequantized
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _transformers_generate(model_name: str, prompts: list[list[int]], output_len: int, iters: int) -> dict:
    import torch
    import transformers

    model = _load_transformers(model_name)
    model.eval()
    model.generation_config.eos_token_id = None  # EOS is a token like any other: dcpjax's ignore_eos
    ids = torch.tensor(prompts, dtype=torch.long)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kw = dict(do_sample=False, pad_token_id=pad, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, **{**kw, "attention_mask": torch.ones_like(ids[:2])})
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, **kw)
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    generated = out[:, ids.shape[1]:]
    return dict(seconds=seconds, all_seconds=times, output_tokens=int(generated.numel()),
                token_ids=generated.tolist(), version=transformers.__version__, torch=torch.__version__)


def _without_speculation(engine: EngineArgs, prompts, params, spec_outputs, iters: int) -> dict:
    """The same workload on the same engine without speculation (its own scheduling mode)."""
    import dataclasses

    llm = LLM.from_engine_args(dataclasses.replace(engine, speculative_config=None))
    mode = llm.async_scheduling
    _timed_generate(llm, prompts, params, mode)  # warm-up
    run = _median_generate(llm, prompts, params, mode, iters)
    same = [o.outputs[0].token_ids for o in run["outputs"]] == [o.outputs[0].token_ids for o in spec_outputs]
    return dict(output_throughput=run["output_tokens"] / run["seconds"], elapsed_s=run["seconds"],
                async_scheduling=mode, steps=run["timings"]["steps"], identical_tokens=same)


def run(args: argparse.Namespace) -> dict:
    """The benchmark: warm-up, timed run, synchronous pass (breakdown), transformers (optional)."""
    engine = engine_args(args)
    if args.compare_transformers:
        check_transformers(engine.model)
    engine.use_cpu_devices()
    import jax

    import dcpjax

    llm = LLM.from_engine_args(engine)
    max_num_seqs = engine.max_num_seqs
    vocab = llm.model_config.vocab_size
    if args.dataset_path:
        prompts = _file_prompts(args.dataset_path, args.num_prompts, args.input_len, vocab)
    else:
        prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    params = dcpjax.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    mode = llm.async_scheduling
    _timed_generate(llm, prompts, params, mode)  # warm-up: compiles every shape of the workload
    main = _median_generate(llm, prompts, params, mode, args.num_iters)
    result = dict(
        model=args.model, devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}", jax=jax.__version__,
        tp=args.tensor_parallel_size, dcp=args.decode_context_parallel_size, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, async_scheduling=mode,
        dataset=args.dataset_path or "random",
        num_iters=args.num_iters, elapsed_s=main["seconds"], all_elapsed_s=main["all_seconds"],
        output_tokens=main["output_tokens"],
        output_throughput=main["output_tokens"] / main["seconds"],
        request_throughput=args.num_prompts / main["seconds"],
        recompilations=main["recompilations"], timings=main["timings"], **kv_cache_summary(llm),
        sliding_blocks_freed=main["sliding_blocks_freed"],
        sampling_ms_in_step=_sampling_ms(vocab, max_num_seqs), sampling_batch=max_num_seqs,
        **_weight_read_floor(llm),
    )
    if main["spec_decode"] is not None:
        result.update(speculative_config=engine.speculative_config, spec_decode=main["spec_decode"],
                      without_speculation=_without_speculation(engine, prompts, params, main["outputs"],
                                                                args.num_iters))
        result["speedup_vs_no_spec"] = result["output_throughput"] / result["without_speculation"]["output_throughput"]
    if not args.no_breakdown:
        sync = _median_generate(llm, prompts, params, False, args.num_iters)
        device_s = sync["timings"]["dispatch"] + sync["timings"]["wait"]
        result.update(device_s=device_s, sync_elapsed_s=sync["seconds"],
                      sync_output_throughput=sync["output_tokens"] / sync["seconds"],
                      device_idle=max(0.0, 1 - device_s / main["seconds"]),
                      identical_to_sync=[o.outputs[0].token_ids for o in sync["outputs"]]
                      == [o.outputs[0].token_ids for o in main["outputs"]])
    if args.compare_transformers:
        hf = _transformers_generate(args.model, prompts, args.output_len, args.num_iters)
        result["transformers"] = dict(elapsed_s=hf["seconds"], all_elapsed_s=hf["all_seconds"],
                                      output_throughput=hf["output_tokens"] / hf["seconds"],
                                      version=hf["version"], torch=hf["torch"],
                                      greedy_tokens_match=hf["token_ids"] == [o.outputs[0].token_ids
                                                                              for o in main["outputs"]])
        result["ratio_vs_transformers"] = result["output_throughput"] / result["transformers"]["output_throughput"]
    return result


def report(r: dict) -> str:
    """The human-readable report of `run`'s result."""
    t = r["timings"]
    steps = max(t["steps"], 1)
    per_step = lambda key: 1e3 * t[key] / steps
    lines = [
        (f"{r['model']} on {r['devices']} (jax {r['jax']}), TP {r['tp']} DCP {r['dcp']}: {r['num_prompts']} prompts x "
         f"({r['input_len']} in, {r['output_len']} out), {'async' if r['async_scheduling'] else 'sync'} scheduling"),
        (f"output throughput: {r['output_throughput']:,.{0 if r['output_throughput'] >= 100 else 2}f} tokens/s   "
         f"requests: {r['request_throughput']:.2f}/s   "
         f"elapsed {r['elapsed_s']:.3f} s (median of {r['num_iters']}), "
         f"{t['steps']} steps ({t['model_calls']} model calls), "
         f"recompilations while timed: {r['recompilations']}"),
        (f"KV cache: {r['kv_cache_size_tokens']:,} tokens{' of one sequence' if r['sliding_windows'] else ''} in "
         f"{r['kv_blocks']:,} blocks of {r['kv_block_layers']} layers ({r['kv_bytes_per_device'] / 2**20:,.1f} MiB per "
         f"device); the same bytes at DCP 1: {r['dcp1_kv_cache_size_tokens']:,} tokens, so DCP {r['dcp']} holds "
         f"{r['kv_tokens_vs_dcp1']:.2f}x" + (
             f"; sliding layers (window {'/'.join(map(str, r['sliding_windows']))}, {r['sliding_groups']} of "
             f"{r['kv_groups']} groups) freed {r['sliding_blocks_freed']:,} blocks behind their windows in the "
             "timed run" if r['sliding_windows'] else "")),
        "",
        ("| per step (ms) | schedule | propose (drafts) | prepare + transfer | dispatch | wait (device) "
         "| process (detok, stops) | host total |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        (f"| mean | {per_step('schedule'):.3f} | {per_step('propose'):.3f} | {per_step('prepare'):.3f} | "
         f"{per_step('dispatch'):.3f} | {per_step('wait'):.3f} | {per_step('process'):.3f} | "
         f"{sum(per_step(k) for k in ('schedule', 'propose', 'prepare', 'dispatch', 'process')):.3f} |"),
        "",
        (f"sampling inside the step (greedy, batch {r['sampling_batch']}, measured alone): "
         f"{r['sampling_ms_in_step']:.3f} ms"),
    ]
    if "weight_read_floor_ms" in r:
        lines.append(f"weight-read floor of a step: {r['weight_read_floor_ms']:.3f} ms "
                     f"({r['weight_bytes'] / 1e6:,.1f} MB "
                     f"of parameters at {r['read_bandwidth_GBps']:.1f} GB/s, this host's read bandwidth measured now)")
    if "device_s" in r:
        step_ms = 1e3 * r["device_s"] / steps
        at_floor = f" (floor / step = {r['weight_read_floor_ms'] / step_ms:.2f})" if "weight_read_floor_ms" in r else ""
        lines.append(
            f"device step (synchronous pass): {step_ms:.3f} ms{at_floor}; device idle (host time not hidden) "
            f"{100 * r['device_idle']:.1f}% of the async run; sync loop {r['sync_output_throughput']:,.0f} tokens/s; "
            f"async == sync tokens: {r['identical_to_sync']}")
    if "spec_decode" in r:
        sd, base = r["spec_decode"], r["without_speculation"]
        lines.append(
            f"speculative decoding {json.dumps(r['speculative_config'])}: mean acceptance length "
            f"{sd['mean_acceptance_length']:.2f}, acceptance rate {100 * sd['acceptance_rate']:.1f}%, accepted per "
            f"position {sd['accepted_per_position']} of {sd['num_drafts']} drafts; without speculation "
            f"({'async' if base['async_scheduling'] else 'sync'}): {base['output_throughput']:,.0f} tokens/s in "
            f"{base['steps']} steps; speed-up {r['speedup_vs_no_spec']:.2f}x; "
            f"identical tokens: {base['identical_tokens']}")
    if "transformers" in r:
        hf = r["transformers"]
        lines.append(f"transformers {hf['version']} (torch {hf['torch']}) generate: {hf['output_throughput']:,.0f} "
                     f"tokens/s; dcpjax / transformers = {r['ratio_vs_transformers']:.2f}x; "
                     f"greedy tokens identical: {hf['greedy_tokens_match']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run and print the report (or JSON)."""
    result = run(args)
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0
