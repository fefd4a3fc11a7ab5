"""The second real model: Gemma 3 270M (the Q4_K_M GGUF of the gemma3-270m packages) against transformers.

transformers 5.25 reads the same GGUF with its own loader and runs it in float32;
tests/fixtures/make_gemma3_fixtures.py wrote what it computed to fixtures/gemma3/expected.json.
Prompts of 6, 16, 627 and 2,006 tokens: the last two reach past the 512-token sliding window of
15 of its 18 layers, so the window (and, under DCP, each rank's part of it, merged by LSE) decides
the answer. Greedy tokens must be identical, every step's top-5 logprobs and every prompt
token's logprob within 1e-3, at TP 4 / DCP 4 (ag_rs, interleave 1) and TP 4 / DCP 2 (a2a, interleave 16)
on the newest jax (marker e2e), TP 1 and TP 4 / DCP 1 on the oldest (marker oldest_jax): each layout takes
minutes on CI's CPU, so each runs on one Python. Prompt logprobs
cost the LM head at every position (262,144 logits each, about 3.5 minutes of CI for the 2,006-token
prompt): every layout checks them up to the 627-token prompt (past the window already). The 2,006-token
prompt's greedy tokens and top-5 logprobs run at TP 1 and TP 4 / DCP 2 (TP 4 / DCP 4 runs a 16k prompt in
tests/test_gemma3_long.py). Each layout runs in a process of its own (tests/layout_worker.py), compiled
with XLA's default optimisation: these prompts spend more time running than compiling.
"""

import json
import pathlib

import layout_worker
import pytest

NAME = "gemma3-270m"
EXPECTED = json.loads((pathlib.Path(__file__).parent / "fixtures" / "gemma3" / "expected.json").read_text())
TOLERANCE = 1e-3
LAYOUTS = [
    pytest.param(dict(tensor_parallel_size=4, decode_context_parallel_size=4), id="tp4-dcp4-ag_rs-i1",
                 marks=pytest.mark.e2e),
    pytest.param(dict(tensor_parallel_size=1), id="tp1", marks=pytest.mark.oldest_jax),
    pytest.param(dict(tensor_parallel_size=4, decode_context_parallel_size=2, dcp_comm_backend="a2a",
                      cp_kv_cache_interleave_size=16, block_size=16), id="tp4-dcp2-a2a-i16", marks=pytest.mark.e2e),
    pytest.param(dict(tensor_parallel_size=4), id="tp4-dcp1", marks=pytest.mark.oldest_jax),
]



def _cases(layout_id: str) -> list[dict]:
    full = layout_id in ("tp1", "tp4-dcp2-a2a-i16")
    return [case for case in EXPECTED["greedy"] if len(case["prompt"]) <= 1000 or full]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_and_prompt_logprobs_match_transformers(gguf_path, layout, request):
    cases = _cases(request.node.callspec.id)
    # 256-token prefill chunks: prompt logprobs need every position's 262,144 logits
    job = {"num_cpu_devices": 4, "model": NAME, "layouts": [layout],
           "engine": dict(max_model_len=2048, max_num_batched_tokens=256, kv_cache_memory_bytes=96 << 20),
           "batches": [[{"prompt_token_ids": case["prompt"],
                         "sampling": dict(temperature=0, max_tokens=len(case["greedy"]), ignore_eos=True, logprobs=5,
                                          prompt_logprobs=1 if len(case["prompt"]) <= 1000 else None)}
                        for case in cases]]}
    outputs = layout_worker.run(job)[0]["outputs"]
    for case, output in zip(cases, outputs, strict=True):
        label = f"prompt of {len(case['prompt'])} tokens"
        assert output["token_ids"] == case["greedy"], label
        for step, want in zip(output["logprobs"], case["top_logprobs"], strict=True):
            for token, logprob in zip(want["ids"], want["logprobs"]):
                assert step[str(token)] == pytest.approx(logprob, abs=TOLERANCE), label
        if "prompt_logprobs" not in output:
            continue
        got = output["prompt_logprobs"]
        assert got[0] is None and case["prompt_logprobs"][0] is None
        assert got[1:] == pytest.approx(case["prompt_logprobs"][1:], abs=TOLERANCE), label
