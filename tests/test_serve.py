"""The OpenAI-compatible server in a subprocess on 127.0.0.1, driven by the official client.

Tiny model, 8 fake CPU devices, TP 8, DCP 2, and a KV cache of 24 blocks (768 tokens), so
64 concurrent requests oversubscribe it and preemption must happen.
"""

import asyncio
import json
import re
import sys
import time

import httpx
import openai
import pytest

from dcpjax.serve.process.launch import start_server

API_KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    args = ["--num-cpu-devices", "8", "-tp", "8", "-dcp", "2", "--served-model-name", MODEL,
            "--kv-cache-memory-bytes", str(24 * 4096), "--max-model-len", "128", "--max-num-batched-tokens", "128",
            "--api-key", API_KEY, "--max-request-bytes", "100000"]
    with start_server(args, timeout=180) as running:
        yield running.base_url


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def metric(server, name) -> float:
    text = httpx.get(f"{server}/metrics").text
    match = re.search(rf"^dcpjax:{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1))


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="Stream me", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kw))
    assert streamed == whole
    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**chat_kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat_kw))
    assert streamed == whole


def test_64_concurrent_requests_oversubscribe_and_match_solo_runs(server, client):
    prompts = [f"req {i} " + "x" * (i % 23) for i in range(64)]
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    preempted_before = metric(server, "num_preemptions")

    async def run_all():
        async_client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=600)
        return await asyncio.gather(*(async_client.completions.create(prompt=p, **kw) for p in prompts))

    together = asyncio.run(run_all())
    assert metric(server, "num_preemptions") > preempted_before
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [r.choices[0].text for r in together] == [r.choices[0].text for r in alone]
    assert all(r.usage.completion_tokens == 24 for r in together)
    assert metric(server, "kv_cache_usage_perc") == 0.0


def test_client_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "long", "max_tokens": 120, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 3:
                break  # hang up mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and (metric(server, "kv_cache_usage_perc") > 0 or
                                      metric(server, "num_requests_running") > 0):
        time.sleep(0.2)
    assert metric(server, "kv_cache_usage_perc") == 0.0 and metric(server, "num_requests_running") == 0.0


@pytest.mark.parametrize(
    "body, status, fragment, param",
    [
        ("{not json", 400, "not valid JSON", None),
        ({"prompt": "hi"}, 400, "model: Field required", "model"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist", "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_model_len=128", "max_tokens"),
        ({"model": MODEL, "prompt": "y" * 300}, 400, "max_model_len=128", "prompt"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p", "top_p"),
        ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
        ({"model": MODEL, "prompt": "hi", "min_p": 3}, 400, "min_p", "min_p"),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16", "n"),
        ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, "outside this model's vocabulary", "prompt"),
        ({"model": MODEL, "prompt": "z" * 200000}, 413, "over 100000 bytes", None),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server}/v1/completions", content=content, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] and error["code"] and error["param"] == param


def test_wrong_api_key_is_401_and_server_still_serves(server, client):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert client.completions.create(model=MODEL, prompt="still up", max_tokens=2).usage.completion_tokens == 2


def test_metrics_present(server):
    text = httpx.get(f"{server}/metrics").text
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                 "time_to_first_token_seconds", "time_per_output_token_seconds", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prefix_cache_blocks", "compilations_total",
                 "step_compilations_after_ready_total"):
        assert f"dcpjax:{name}" in text
    assert metric(server, "compilations") > 0  # the steps the requests before this one compiled


def test_prefix_cache_hits_are_reported(client, server):
    """A repeated prompt reuses its cached blocks (32 tokens each at block 16 x DCP 2): usage says how
    many prompt tokens were cached, streamed (stream_options.include_usage) or not, and /metrics counts them."""
    prompt = ("A shared system prompt, repeated by every request of this test. " * 2)[:100]  # + BOS: 101 tokens
    queries, hits = metric(server, "prefix_cache_queries"), metric(server, "prefix_cache_hits")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == 96  # whole blocks, never the last token
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 96
    assert "".join(c.choices[0].text for c in chunks[:-1]) == first.choices[0].text
    assert metric(server, "prefix_cache_queries") - queries == 3 * first.usage.prompt_tokens
    assert metric(server, "prefix_cache_hits") - hits == 2 * 96
    assert metric(server, "prefix_cache_blocks") >= 3


def test_bench_serve_reports_latency_and_kv_usage(server):
    from dcpjax.bench.client import make_prefix_repetition_prompts, run_benchmark

    prompts = make_prefix_repetition_prompts(12, prefix_len=64, suffix_len=8, num_prefixes=3, seed=5)
    result = asyncio.run(run_benchmark(server, MODEL, prompts=prompts, output_len=24, max_concurrency=3,
                                       api_key=API_KEY, progress=False))
    assert (result["completed"], result["failed"]) == (12, 0)
    # the first of each prefix misses, later ones reuse its 64 tokens (2 blocks of 32)
    assert result["ttft_miss"]["median_ms"] > 0 and result["ttft_hit"]["median_ms"] > 0
    assert 0.5 < result["prefix_cache_hit_rate"] <= 9 * 64 / result["prompt_tokens"]
    for metric in ("ttft", "tpot", "itl"):
        assert result[metric]["median_ms"] > 0 and result[metric]["p99_ms"] >= result[metric]["median_ms"]
    assert result["output_throughput"] > 0 and 0 < result["peak_kv_cache_usage"] <= 1


def test_load_holds_streams_without_errors_or_losses(server):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    from load import hold

    result = asyncio.run(hold(server, MODEL, streams=24, seconds=4, input_len=32, output_len=8, api_key=API_KEY))
    assert result["completed"] > 0 and result["errors"] == 0 and result["lost"] == 0


def test_start_server_fails_fast_with_the_servers_output():
    """A server that exits at start-up (here: a bad flag) is an error carrying its output, not a 300 s wait."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with status 2(.|\n)*invalid choice: 'int4'"):
        start_server(["--dtype", "int4"])
    assert time.monotonic() - start < 60


def test_sampling_fields_are_honoured_not_ignored(client):
    """OpenAI's and vLLM's sampling fields change what is generated (the engine applies them on the device)."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    penalised = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0).choices[0]
    assert penalised.text != plain.text
    ab = {"ignore_eos": True, "allowed_token_ids": [ord("a"), ord("b")]}  # the byte tokenizer: id = byte
    only = client.completions.create(**{**kw, "extra_body": ab}).choices[0].text
    assert set(only) <= {"a", "b"}
    other = client.completions.create(**{**kw, "extra_body": ab}, logit_bias={str(ord(only[0])): -100}).choices[0]
    assert other.text[0] == ({"a", "b"} - {only[0]}).pop()
    out = client.completions.create(model=MODEL, prompt=["Hello", "Other"], max_tokens=4, n=2, seed=3,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 16
    best = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, best_of=4, seed=3,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 2 and best.usage.completion_tokens == 16  # every draw is billed, as OpenAI does
    with pytest.raises(openai.BadRequestError, match="unsupported field 'guided_regex'"):
        client.completions.create(**{**kw, "extra_body": {"guided_regex": "a+"}})
