"""The API evaluation harnesses and agents call: echo with prompt logprobs, max_tokens 0,
prompt_logprobs, chat logprobs, n choices, /tokenize and /detokenize (TP 8 / DCP 2 server)."""

import httpx
import openai
import pytest

import dcpjax
from dcpjax.serve.process.launch import start_server

MODEL = "tiny"


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=120, **kw)  # a request's first shape compiles
PROMPT = "Evaluation harnesses score each continuation by its loglikelihood."


@pytest.fixture(scope="module")
def server():
    args = ["--num-cpu-devices", "8", "-tp", "8", "-dcp", "2", "--served-model-name", MODEL, "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(1 << 20), "--max-num-batched-tokens", "32", "--block-size", "8",
            "--cp-kv-cache-interleave-size", "2"]
    with start_server(args, timeout=180) as running:
        yield running.base_url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    """The same prompt's logprobs from the offline API on one device (no DCP, no server)."""
    llm = dcpjax.LLM("tiny-llama", max_model_len=256, kv_cache_memory_bytes=1 << 20)
    params = dcpjax.SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    return llm.generate(PROMPT, params)[0]


def test_echo_returns_prompt_tokens_and_logprobs_first(client, offline):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0 or 1, temperature 0."""
    ids = offline.prompt_token_ids
    for max_tokens in (0, 1):
        out = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens,
                                        temperature=0)
        choice = out.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        for got, want, token in zip(lp.token_logprobs[1 : len(ids)], offline.prompt_logprobs[1:], ids[1:]):
            assert got == pytest.approx(want[token].logprob, abs=1e-4)
        assert choice.text.startswith(PROMPT) and out.usage.completion_tokens == max_tokens
        if max_tokens:  # the greedy token after the prompt, with its logprob
            first = offline.outputs[0].logprobs[0][offline.outputs[0].token_ids[0]]
            assert (lp.tokens[-1], lp.token_logprobs[-1]) == (first.decoded_token,
                                                              pytest.approx(first.logprob, abs=1e-4))
        else:  # the prompt alone: "length", whatever ended the token that was dropped
            assert choice.text == PROMPT and (choice.finish_reason, choice.stop_reason) == ("length", None)


def test_streamed_logprobs_and_offsets_equal_unstreamed(client):
    kw = dict(model=MODEL, prompt="Offsets: ", max_tokens=12, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset


def test_max_tokens_zero_needs_echo(server):
    r = post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field(server, offline):
    # echo + logprobs 3 computes 3 alternatives per prompt token; prompt_logprobs still returns its 2
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "echo": True,
            "logprobs": 3}
    got = post(f"{server}/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(offline.prompt_token_ids)
    for entry, want, token in zip(got[1:], offline.prompt_logprobs[1:], offline.prompt_token_ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)
        assert len(entry) in (2, 3)  # the prompt token and the top 2 (which may include it)


def test_chat_logprobs_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)  # greedy: the chosen one is the best
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kw) if chunk.choices
                for t in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_n_choices_are_independent_seeded_draws(client):
    kw = dict(model=MODEL, prompt="Parallel sampling: ", max_tokens=8, temperature=1.0)
    out = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 24
    singles = [client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    streamed = {}
    for chunk in client.completions.create(n=3, seed=7, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == singles
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_tokenize_and_detokenize(server):
    r = post(f"{server}/tokenize", json={"model": MODEL, "prompt": "abc", "return_token_strs": True}).json()
    assert r["tokens"][1:] == [97, 98, 99] and r["count"] == 4 and r["max_model_len"] == 256
    assert r["token_strs"][1:] == ["a", "b", "c"]
    assert post(f"{server}/tokenize", json={"prompt": "abc", "add_special_tokens": False}).json()["count"] == 3
    messages = [{"role": "user", "content": "hi"}]
    chat = post(f"{server}/tokenize", json={"messages": messages}).json()
    text = post(f"{server}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "hi" in text and text.endswith("<|assistant|>\n")
    assert post(f"{server}/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert post(f"{server}/tokenize", json={"messages": []}).status_code == 400
    assert post(f"{server}/tokenize", json={}).status_code == 400
    assert post(f"{server}/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
