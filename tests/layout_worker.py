"""Run one model at several layouts in a process of its own (e.g. 9 fake CPU devices, which the
8-device pytest process cannot give) and print each layout's outputs as JSON.

    python tests/layout_worker.py < job.json

job: {"num_cpu_devices": 9, "model": NAME, "engine": {LLM kwargs}, "layouts": [{LLM kwargs}, ...],
      "batches": [[{"prompt_token_ids": [...], "sampling": {SamplingParams kwargs}}, ...], ...],
      "capacity_only": [index, ...]}
      (each batch is one `generate` call: few step shapes, so few compilations; the layouts listed in
      capacity_only are built, their KV capacity read, and generate nothing)
out: {"layouts": [{"layout": {...}, "kv_cache_size_tokens": N, "seconds": S, "outputs": [
      {"token_ids": [...], "finish_reason": "...", "prompt_logprobs": [null | float, ...],
       "logprobs": [{"token id": logprob, ...} per generated token]}]}]}
      (outputs of every batch, in order; prompt_logprobs and logprobs where the sampling asked for them)

The process compiles with XLA's default optimisation (`run` drops the parent's XLA_FLAGS, the tests' -O0
included): the real models' long prompts spend more time running than compiling (Gemma 3's 16k prompt:
235 s at -O0, 167 s at the default).
"""

import gc
import json
import os
import pathlib
import subprocess
import sys
import time


def run(job: dict, timeout: float = 1800) -> list[dict]:
    """Each layout's run of `job`, in a fresh process (this file) with its own CPU devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__))], input=json.dumps(job), env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"layout_worker.py failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["layouts"]


def _row(out, request: dict) -> dict:
    completion, sampling = out.outputs[0], request.get("sampling", {})
    row = {"token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
    if sampling.get("prompt_logprobs") is not None:
        row["prompt_logprobs"] = [None if e is None else e[t].logprob
                                  for e, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
    if sampling.get("logprobs") is not None:
        row["logprobs"] = [{str(token): entry.logprob for token, entry in step.items()}
                           for step in completion.logprobs]
    return row


def main() -> None:
    job = json.load(sys.stdin)
    import dcpjax

    dcpjax.use_cpu_devices(job["num_cpu_devices"])
    results = []
    for index, layout in enumerate(job["layouts"]):
        llm = dcpjax.LLM(job["model"], **job.get("engine", {}), **layout)
        requests, outputs = [], []
        start = time.perf_counter()
        for batch in [] if index in job.get("capacity_only", ()) else job["batches"]:
            requests += batch
            outputs += llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch],
                                    [dcpjax.SamplingParams(**r.get("sampling", {})) for r in batch], use_tqdm=False)
        seconds = time.perf_counter() - start
        results.append({"layout": layout, "kv_cache_size_tokens": llm.kv_cache_size_tokens, "seconds": seconds,
                        "held_quantized": bool(llm.model_weights.held),
                        "outputs": [_row(out, request) for out, request in zip(outputs, requests)]})
        del llm
        gc.collect()
    json.dump({"layouts": results}, sys.stdout)


if __name__ == "__main__":
    main()
