"""Run one model at several layouts in a process of its own (e.g. 9 fake CPU devices, which the
8-device pytest process cannot give) and print each layout's outputs as JSON.

    python tests/layout_worker.py < job.json

job: {"num_cpu_devices": 9, "model": NAME, "engine": {LLM kwargs}, "layouts": [{LLM kwargs}, ...],
      "batches": [[{"prompt_token_ids": [...], "sampling": {SamplingParams kwargs}}, ...], ...]}
      (each batch is one `generate` call: few step shapes, so few compilations)
out: {"layouts": [{"layout": {...}, "kv_cache_size_tokens": N, "seconds": S, "outputs": [
      {"token_ids": [...], "finish_reason": "...", "prompt_logprobs": [null | float, ...]}]}]}
      (outputs of every batch, in order)
"""

import gc
import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    import dcpjax

    dcpjax.use_cpu_devices(job["num_cpu_devices"])
    results = []
    for layout in job["layouts"]:
        llm = dcpjax.LLM(job["model"], **job.get("engine", {}), **layout)
        requests, outputs = [], []
        start = time.perf_counter()
        for batch in job["batches"]:
            requests += batch
            outputs += llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch],
                                    [dcpjax.SamplingParams(**r.get("sampling", {})) for r in batch])
        seconds = time.perf_counter() - start
        rows = []
        for out, request in zip(outputs, requests):
            completion = out.outputs[0]
            row = {"token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
            if request.get("sampling", {}).get("prompt_logprobs") is not None:
                row["prompt_logprobs"] = [None if e is None else e[t].logprob
                                          for e, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
            rows.append(row)
        results.append({"layout": layout, "kv_cache_size_tokens": llm.kv_cache_size_tokens, "seconds": seconds,
                        "held_quantized": bool(llm.model_weights.held), "outputs": rows})
        del llm
        gc.collect()
    json.dump({"layouts": results}, sys.stdout)


if __name__ == "__main__":
    main()
