"""Gemma 3 270M past 16k tokens at TP 4 / DCP 4, against transformers.

tests/fixtures/make_gemma3_fixtures.py wrote fixtures/gemma3/long.json: a 16,001-token prompt (Python's data
model documentation) and the 8 tokens transformers 5.25 generates greedily from the same GGUF in float32
(prefilled in 1,024-token chunks), with each step's top-5 logprobs. Here the prompt prefills in 1,024-token
chunks too, its 15 sliding layers attending to the last 512 positions, split over 4 DCP ranks and merged by
LSE, its 3 full layers to all 16,001; one KV head, so each of the 4 devices holds a quarter of the tokens.
It runs in a process of its own (tests/layout_worker.py), compiled with XLA's default optimisation (a third
faster than the tests' -O0 on this prompt).
"""

import json
import pathlib

import layout_worker
import pytest

NAME = "gemma3-270m"
LONG = json.loads((pathlib.Path(__file__).parent / "fixtures" / "gemma3" / "long.json").read_text())



@pytest.mark.e2e  # minutes on CI's CPU
def test_a_16k_prompt_at_dcp_4_equals_transformers(gguf_path):
    prompt = LONG["prompt"]
    assert len(prompt) > 16_000
    # float32 KV: 18 layers x 1 head x (256 + 256) x 4 bytes = 36 KiB a token, a quarter of the tokens per device
    job = {"num_cpu_devices": 4, "model": NAME,
           "layouts": [dict(tensor_parallel_size=4, decode_context_parallel_size=4)],
           "engine": dict(max_model_len=len(prompt) + 16, max_num_seqs=1, max_num_batched_tokens=1024,
                          kv_cache_memory_bytes=192 << 20),
           "batches": [[{"prompt_token_ids": prompt, "sampling": dict(temperature=0, max_tokens=len(LONG["greedy"]),
                                                                     ignore_eos=True, logprobs=5)}]]}
    run = layout_worker.run(job)[0]
    assert run["kv_cache_size_tokens"] >= len(prompt) + 16
    output = run["outputs"][0]
    assert output["token_ids"] == LONG["greedy"]
    for step, want in zip(output["logprobs"], LONG["top_logprobs"], strict=True):
        for token, logprob in zip(want["ids"], want["logprobs"]):
            assert step[str(token)] == pytest.approx(logprob, abs=1e-3)
