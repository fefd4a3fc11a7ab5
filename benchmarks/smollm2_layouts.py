"""SmolLM2-135M-Instruct at every layout the rules accept, against transformers' fixtures.

    python benchmarks/smollm2_layouts.py [--json]

Runs tests/layout_worker.py (9 fake CPU devices, a process of its own) at TP 1, TP 3,
TP 9 / DCP 1 and TP 9 / DCP 3 (ag_rs and a2a, interleave 1 and 16), with the same KV bytes
per device, on the fixture's workload (tests/fixtures/smollm2/expected.json, written by
tests/fixtures/make_smollm2_fixtures.py from transformers' own GGUF loader): 6 greedy prompts
x 24 tokens (EOS ignored), the prompt logprobs of a 308-token English text, and a needle in a
3,059-token document. Prints one row per layout: greedy prompts identical to transformers,
the largest prompt-logprob difference, the needle's answer, KV tokens and the run's seconds
(compilation included).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import layout_worker  # (the run in a process of its own, shared with the tests)

EXPECTED = json.loads((ROOT / "tests" / "fixtures" / "smollm2" / "expected.json").read_text())
# every layout of 9 query / 3 KV heads with DCP > 1 is TP 9 / DCP 3; TP 9 / DCP 1 pads the MLP (1536 % 9 != 0)
DCP_LAYOUTS = [
    dict(tensor_parallel_size=9, decode_context_parallel_size=1),
    dict(tensor_parallel_size=9, decode_context_parallel_size=3),
    dict(tensor_parallel_size=9, decode_context_parallel_size=3, dcp_comm_backend="a2a"),
    dict(tensor_parallel_size=9, decode_context_parallel_size=3, cp_kv_cache_interleave_size=16),
    dict(tensor_parallel_size=9, decode_context_parallel_size=3, cp_kv_cache_interleave_size=16,
         dcp_comm_backend="a2a"),
]
LAYOUTS = [dict(tensor_parallel_size=1, decode_context_parallel_size=1),
           dict(tensor_parallel_size=3, decode_context_parallel_size=1), *DCP_LAYOUTS]


def job(layouts: list[dict], kv_bytes: int) -> dict:
    """The fixture's workload at `layouts` (same KV bytes per device), as three `generate` calls:
    greedy prompts (EOS ignored), the prompt-logprob text, the needle (one 4096-token chunk takes
    it whole: one prefill shape per layout, so few compilations)."""
    greedy = [{"prompt_token_ids": c["prompt"], "sampling": dict(temperature=0, max_tokens=len(c["greedy"]),
                                                                  ignore_eos=True)} for c in EXPECTED["greedy"]]
    logprobs = [{"prompt_token_ids": EXPECTED["prompt_logprobs"]["prompt"],
                 "sampling": dict(temperature=0, max_tokens=1, prompt_logprobs=1)}]
    needle = [{"prompt_token_ids": EXPECTED["needle"][0]["prompt"], "sampling": dict(temperature=0, max_tokens=16)}]
    return {"num_cpu_devices": 9, "model": "smollm2-135m-instruct", "layouts": layouts,
            "engine": dict(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096,
                           kv_cache_memory_bytes=kv_bytes),
            "batches": [greedy, logprobs, needle]}


def run_layouts(job: dict) -> list[dict]:
    """Each layout's run (tests/layout_worker.py in a fresh process: 9 fake CPU devices)."""
    return layout_worker.run(job)


def rows(runs: list[dict]) -> list[dict]:
    want_lp = EXPECTED["prompt_logprobs"]["logprobs"]
    needle = EXPECTED["needle"][0]
    out = []
    for run in runs:
        outputs, n = run["outputs"], len(EXPECTED["greedy"])
        got_lp = outputs[n]["prompt_logprobs"]
        answer = outputs[n + 1]["token_ids"]
        out.append(dict(
            layout=run["layout"], kv_cache_size_tokens=run["kv_cache_size_tokens"], seconds=run["seconds"],
            greedy_identical=sum(o["token_ids"] == c["greedy"] for o, c in zip(outputs, EXPECTED["greedy"])),
            greedy_prompts=n,
            max_prompt_logprob_error=max(abs(a - b) for a, b in zip(got_lp[1:], want_lp[1:])),
            needle_identical=answer == needle["answer"], needle_found="pineapple" in needle["answer_text"].lower()
            and answer == needle["answer"]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    table = rows(run_layouts(job(LAYOUTS, 256 << 20)))
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print("| TP | DCP | comm | I | greedy = transformers | max abs prompt-logprob error | needle (3,059 tokens) "
          "| KV tokens (256 MiB / device) | run s |")
    print("|---:|---:|---|---:|---:|---:|---|---:|---:|")
    for r in table:
        lay = r["layout"]
        print(f"| {lay['tensor_parallel_size']} | {lay['decode_context_parallel_size']} "
              f"| {lay.get('dcp_comm_backend', 'ag_rs')} | {lay.get('cp_kv_cache_interleave_size', 1)} "
              f"| {r['greedy_identical']}/{r['greedy_prompts']} | {r['max_prompt_logprob_error']:.1e} "
              f"| {'found, = transformers' if r['needle_found'] else 'MISSED'} | {r['kv_cache_size_tokens']:,} "
              f"| {r['seconds']:.1f} |")
    return 0 if all(r["greedy_identical"] == r["greedy_prompts"] and r["needle_found"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
