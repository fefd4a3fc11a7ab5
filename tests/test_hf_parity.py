"""Whole models against Hugging Face transformers (fixtures from tests/fixtures/make_hf_fixtures.py).

Greedy tokens must be identical and the top-5 log-probabilities of every generated
step within 1e-3, for prompts of 1 to 200 tokens (300 for the hybrid) and 20 new tokens, across meshes,
comm backends, interleave sizes and attention backends. No torch needed here.
"""

import json
import pathlib

import pytest

import dcpjax

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# (tp, dcp, interleave, comm, attention_backend)
CASES = [
    (1, 1, 1, "ag_rs", "reference"),
    (4, 2, 1, "ag_rs", "reference"),
    (4, 2, 2, "a2a", "reference"),
    (8, 2, 1, "a2a", "reference"),
    (8, 2, 4, "ag_rs", "reference"),
    (8, 4, 1, "ag_rs", "reference"),
    (8, 4, 2, "a2a", "reference"),
    (4, 2, 2, "ag_rs", "pallas"),
    (8, 4, 1, "a2a", "pallas"),
]


# MLA counts as one KV head: DCP up to TP, 8 included
MLA_CASES = [
    (1, 1, 1, "ag_rs", "reference"),
    (8, 8, 1, "ag_rs", "reference"),
    (8, 8, 2, "a2a", "reference"),
    (8, 2, 2, "ag_rs", "reference"),
    (8, 4, 1, "a2a", "reference"),
    (4, 4, 1, "ag_rs", "pallas"),
    (8, 8, 1, "a2a", "pallas"),
]
# the hybrid: DCP on its full-attention layer (2 KV heads: DCP up to TP / 2), linear heads over all TP devices;
# prompts of 1 to 300 tokens, prefilled in packed chunks of a 64-token budget
HYBRID_CASES = [
    (1, 1, 1, "ag_rs", "reference"),
    (4, 2, 2, "a2a", "reference"),
    (8, 2, 1, "a2a", "reference"),
    (8, 4, 1, "ag_rs", "reference"),
    (8, 4, 2, "a2a", "pallas"),
]
# Cases other cases of the model already cover (both backends, interleave 1 and > 1, both merges) run on one
# Python only, split between the two: the newest jax (marker e2e, as CI's older Python leaves them out) or the
# oldest (marker oldest_jax, as CI's newer Python leaves them out). Every family keeps TP 1 or a DCP case of
# each kernel on both.
NEWEST_JAX_ONLY = {
    "llama3-rope": {CASES[2], CASES[4], CASES[6]},
    "qwen3": {CASES[1], CASES[3], CASES[4], CASES[5], CASES[6]},
    "qwen3-moe": {CASES[1], CASES[3], CASES[4], CASES[5], CASES[6]},
    "qwen3-next": set(HYBRID_CASES[2:5]),
    "deepseek-v3": {MLA_CASES[2], MLA_CASES[3], MLA_CASES[6]},
}
OLDEST_JAX_ONLY = {
    "llama3-rope": {CASES[1], CASES[3], CASES[7]},
    "qwen3": {CASES[2], CASES[7]},
    "qwen3-moe": {CASES[2], CASES[8]},
    "qwen3-next": set(HYBRID_CASES[0:2]),
    "deepseek-v3": {MLA_CASES[1], MLA_CASES[4]},
}


def _case(name: str, case: tuple):
    if case in NEWEST_JAX_ONLY.get(name, ()):
        return pytest.param(name, *case, marks=pytest.mark.e2e)
    if case in OLDEST_JAX_ONLY.get(name, ()):
        return pytest.param(name, *case, marks=pytest.mark.oldest_jax)
    return (name, *case)


# fp8 block-scaled checkpoints (tests/fixtures/make_fp8_fixtures.py: written the way DeepSeek-V3 ships, blocks
# of [16, 24] / [24, 16] that divide no dimension), held fp8 on the devices, against transformers on the
# dequantized weights; TP 8 splits blocks. Each on both Pythons at TP 1 and one DCP layout, the rest newest-jax only.
FP8_CASES = {
    "deepseek-v3-fp8": [MLA_CASES[0], (8, 8, 2, "a2a", "reference"), (8, 4, 1, "ag_rs", "pallas"),
                        (4, 2, 2, "a2a", "pallas")],
    "qwen3-moe-fp8": [CASES[0], (8, 4, 2, "a2a", "reference"), (4, 2, 1, "ag_rs", "pallas")],
}
NEWEST_JAX_ONLY |= {"deepseek-v3-fp8": {(8, 4, 1, "ag_rs", "pallas"), (4, 2, 2, "a2a", "pallas")},
                    "qwen3-moe-fp8": {(4, 2, 1, "ag_rs", "pallas")}}
OLDEST_JAX_ONLY |= {"deepseek-v3-fp8": {(8, 8, 2, "a2a", "reference")},
                    "qwen3-moe-fp8": {(8, 4, 2, "a2a", "reference")}}

# Gemma 3 (sliding window 8 on four of six layers, the full ones mid-stack and last; 8 query heads / 1 KV head:
# DCP up to TP; final-logit soft-cap; linear RoPE on the full layers only) and Gemma 2 (attention soft-cap in
# every kernel, window 8 on every other layer; 2 KV heads): prompts of 1 to 200 tokens, far past the window
GEMMA_CASES = {
    "gemma3-tiny": [(1, 1, 1, "ag_rs", "reference"), (8, 8, 1, "ag_rs", "reference"), (8, 4, 2, "a2a", "reference"),
                    (4, 4, 1, "a2a", "pallas"), (8, 2, 4, "ag_rs", "pallas")],
    "gemma2": [(1, 1, 1, "ag_rs", "reference"), (8, 4, 1, "a2a", "reference"), (4, 2, 2, "ag_rs", "pallas")],
}
NEWEST_JAX_ONLY |= {"gemma3-tiny": {(8, 4, 2, "a2a", "reference"), (8, 2, 4, "ag_rs", "pallas")}}
OLDEST_JAX_ONLY |= {"gemma3-tiny": {(1, 1, 1, "ag_rs", "reference"), (8, 8, 1, "ag_rs", "reference")},
                    "gemma2": {(8, 4, 1, "a2a", "reference")}}
NEWEST_JAX_ONLY |= {"gemma2": {(1, 1, 1, "ag_rs", "reference")}}

PARAMS = (
    [_case(name, case) for name, cases in GEMMA_CASES.items() for case in cases]
    + [_case(name, case) for name in ("llama3-rope", "qwen3", "qwen3-moe") for case in CASES]
    + [_case("qwen3-next", case) for case in HYBRID_CASES]
    # q/k/v bias, linear RoPE, tied embeddings (in every case)
    + [("qwen2", *CASES[0]), pytest.param("qwen2", *CASES[6], marks=pytest.mark.oldest_jax),
       pytest.param("qwen2", *CASES[7], marks=pytest.mark.e2e)]
    + [_case("deepseek-v3", case) for case in MLA_CASES]
    + [_case(name, case) for name, cases in FP8_CASES.items() for case in cases]
)


# expert parallelism (routed experts whole on their devices): TP 8 at DCP 1, 2, 4 (and 8 for MLA), both
# kernels, fp8 experts too; each model's first case on both Pythons, the others newest-jax only
EP_CASES = {
    "qwen3-moe": [(8, 1, 1, "ag_rs", "reference"), (8, 2, 2, "a2a", "pallas"), (8, 4, 1, "ag_rs", "reference")],
    "deepseek-v3": [(8, 8, 1, "a2a", "reference"), (8, 1, 1, "ag_rs", "pallas"), (8, 2, 2, "ag_rs", "reference"),
                    (8, 4, 1, "a2a", "pallas")],
    "qwen3-next": [(8, 4, 2, "a2a", "reference"), (8, 1, 1, "ag_rs", "reference"), (8, 2, 1, "a2a", "pallas")],
    "deepseek-v3-fp8": [(8, 8, 2, "a2a", "reference")],
    "qwen3-moe-fp8": [(8, 4, 1, "ag_rs", "pallas")],
}
# the first case of the hybrid's and deepseek-v3-fp8's on the oldest jax only (their other cases run on the newest)
EP_FIRST_ON_OLDEST_ONLY = {"qwen3-next", "deepseek-v3-fp8"}
EP_PARAMS = [pytest.param(name, *case, marks=[pytest.mark.e2e] if i else
                          [pytest.mark.oldest_jax] if name in EP_FIRST_ON_OLDEST_ONLY else [])
             for name, cases in EP_CASES.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("name, tp, dcp, interleave, comm, backend", PARAMS)
def test_greedy_tokens_and_logprobs_match_transformers(name, tp, dcp, interleave, comm, backend):
    check_against_transformers(name, tp, dcp, interleave, comm, backend)


@pytest.mark.parametrize("name, tp, dcp, interleave, comm, backend", EP_PARAMS)
def test_expert_parallel_matches_transformers(name, tp, dcp, interleave, comm, backend):
    check_against_transformers(name, tp, dcp, interleave, comm, backend, enable_expert_parallel=True)


def check_against_transformers(name, tp, dcp, interleave, comm, backend, **engine):
    """The fixture's prompts: greedy tokens identical, top-5 logprobs of every step within 1e-3."""
    folder = FIXTURES / name
    expected = json.loads((folder / "expected.json").read_text())["cases"]
    llm = dcpjax.LLM(
        str(folder), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave, dcp_comm_backend=comm, attention_backend=backend,
        block_size=4 * interleave, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, **engine,
    )
    params = dcpjax.SamplingParams(temperature=0, max_tokens=20, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": case["prompt"]} for case in expected], params)
    for case, output in zip(expected, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == case["greedy"], f"prompt of {len(case['prompt'])} tokens"
        assert completion.finish_reason == "length"
        for step, want in zip(completion.logprobs, case["top_logprobs"]):
            for token, logprob in zip(want["ids"], want["logprobs"]):
                assert step[token].logprob == pytest.approx(logprob, abs=1e-3)


@pytest.mark.parametrize("name, tp, dcp, interleave, comm", [
    ("qwen2", 1, 1, 1, "ag_rs"),
    pytest.param("qwen3-next", 8, 2, 2, "ag_rs", marks=pytest.mark.oldest_jax),
    ("llama3-rope", 8, 2, 4, "ag_rs"),
    ("qwen3", 4, 2, 2, "a2a"),
    ("deepseek-v3", 8, 8, 2, "a2a"),
    ("gemma3-tiny", 8, 4, 1, "ag_rs"),
])
def test_prompt_logprobs_match_transformers(name, tp, dcp, interleave, comm):
    check_prompt_logprobs(name, tp, dcp, interleave, comm)


def check_prompt_logprobs(name, tp, dcp, interleave, comm):
    """Prompt logprobs of prompt + greedy continuation equal transformers' logprobs of each
    generated step: computed from the prefill chunks' logits on every DCP rank layout."""
    folder = FIXTURES / name
    expected = json.loads((folder / "expected.json").read_text())["cases"]
    llm = dcpjax.LLM(
        str(folder), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave, dcp_comm_backend=comm, block_size=4 * interleave,
        max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20,
    )
    params = dcpjax.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": case["prompt"] + case["greedy"][:-1]} for case in expected], params)
    for case, output in zip(expected, outputs):
        got = output.prompt_logprobs
        assert got[0] is None and len(got) == len(output.prompt_token_ids)
        # step k of the fixture predicted greedy[k] after prompt + greedy[:k]: prompt position len(prompt) + k
        for k, want in enumerate(case["top_logprobs"][:-1]):
            entry = got[len(case["prompt"]) + k]
            assert entry[case["greedy"][k]].rank == 1
            for token, logprob in zip(want["ids"], want["logprobs"]):
                assert entry[token].logprob == pytest.approx(logprob, abs=1e-3)
