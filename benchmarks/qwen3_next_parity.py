"""The tiny random Qwen3-Next (tests/fixtures/qwen3-next) against transformers at several layouts:
greedy tokens and the largest error of the top-5 logprobs of every generated step.

    python benchmarks/qwen3_next_parity.py                      # TP / DCP 1/1, 4/2, 8/4
    python benchmarks/qwen3_next_parity.py --layouts 8/2 --dcp-comm-backend a2a --interleave 2

The fixture's prompts are 1 to 300 tokens with 20 new tokens each; a 64-token budget prefills
the longest in several packed calls. tests/test_hf_parity.py asserts the same (within 1e-3).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3-next"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=["1/1", "4/2", "8/4"], help="TP/DCP pairs")
    p.add_argument("--dcp-comm-backend", default="ag_rs", choices=["ag_rs", "a2a"])
    p.add_argument("--interleave", type=int, default=1)
    args = p.parse_args(argv)
    import dcpjax

    dcpjax.use_cpu_devices(8)
    cases = json.loads((FIXTURE / "expected.json").read_text())["cases"]
    print(f"tiny Qwen3-Next vs transformers, {args.dcp_comm_backend}, interleave {args.interleave}, "
          f"{time.strftime('%Y-%m-%d')}\n\n| TP / DCP | greedy tokens identical | max logprob error |\n|---|---|---:|")
    worst = 0.0
    for layout in args.layouts:
        tp, dcp = map(int, layout.split("/"))
        llm = dcpjax.LLM(str(FIXTURE), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                         cp_kv_cache_interleave_size=args.interleave if dcp > 1 else 1,
                         dcp_comm_backend=args.dcp_comm_backend if dcp > 1 else "ag_rs",
                         block_size=4 * args.interleave, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)
        params = dcpjax.SamplingParams(temperature=0, max_tokens=20, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": c["prompt"]} for c in cases], params)
        same, error = 0, 0.0
        for case, output in zip(cases, outputs):
            completion = output.outputs[0]
            same += completion.token_ids == case["greedy"]
            for step, want in zip(completion.logprobs, case["top_logprobs"]):
                error = max([error] + [abs(step[t].logprob - lp) for t, lp in zip(want["ids"], want["logprobs"])
                                       if t in step])
        worst = max(worst, error)
        print(f"| {tp} / {dcp} | {same} of {len(cases)} | {error:.1e} |")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
