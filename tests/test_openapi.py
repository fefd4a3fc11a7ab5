"""/openapi.json is the server's contract, and requests the engine cannot serve are 400s.

A schemathesis run (bounded, deterministic) against a server subprocess checks that every
response has a documented status, content type and schema, and that none is a 5xx. The
admission errors are checked in-process (no engine runs: each is refused before it).
"""

import re
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from dcpjax import LLM, SamplingParams
from dcpjax.engine.requests import RequestError
from dcpjax.serve.api import build_app
from dcpjax.serve.metrics import Metrics
from dcpjax.serve.process.launch import start_server

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 32
# every warning but validation_mismatch: the schema bounds max_tokens by max_model_len, but the rule is vLLM's
# prompt + max_tokens <= max_model_len, a bound across two fields no JSON schema states, so most generated
# bodies of this 32-token model are (rightly) 400s
WARNINGS = ["missing_auth", "missing_test_data", "base_url_mismatch", "missing_deserializer", "unused_openapi_auth",
            "unsupported_regex", "method_not_allowed", "unresolvable_reference"]
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    # one CPU device and a 32-token model: every request the fuzzer sends is answered in milliseconds
    args = ["--num-cpu-devices", "1", "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(1 << 16), "--api-key", API_KEY, "--max-request-bytes", "100000"]
    with start_server(args, timeout=180) as running:
        yield running


@pytest.mark.e2e
def test_schemathesis_finds_no_contract_violation(server, tmp_path):
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base_url}/openapi.json",
               "--checks", ",".join(CHECKS), "--max-examples", "25", "--seed", "20251", "--generation-deterministic",
               "--workers", "1", "--warnings", ",".join(WARNINGS),
               "--phases", "examples,coverage,fuzzing", "--request-timeout", "60",
               "--header", f"Authorization: Bearer {API_KEY}", "--no-color"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert run.returncode == 0, f"{run.stdout[-8000:]}\n{run.stderr[-2000:]}\nserver:\n{server.log_tail()}"
    assert re.search(r"\b\d+ generated, \d+ passed\b", run.stdout) and "No issues found" in run.stdout, run.stdout
    metrics = httpx.get(f"{server.base_url}/metrics").text  # the fuzzer got past validation into the engine
    generated = re.search(r'^dcpjax:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.MULTILINE)
    assert float(generated.group(1)) > 0


def test_every_status_is_documented_with_its_content_type(server):
    doc = httpx.get(f"{server.base_url}/openapi.json").json()
    statuses = {path: {status: sorted(response.get("content", {})) for status, response in
                       next(iter(item.values()))["responses"].items()} for path, item in doc["paths"].items()}
    json_, text = ["application/json"], ["text/plain"]
    errors = {"413": json_, "503": json_}
    generation = {"200": ["application/json", "text/event-stream"], "400": json_, "401": json_, "404": json_,
                  "413": json_, "500": json_, "503": json_}
    assert statuses == {"/health": {"200": text, **errors}, "/metrics": {"200": text, "413": json_},
                        "/v1/models": {"200": json_, "401": json_, **errors},
                        "/v1/completions": generation, "/v1/chat/completions": generation,
                        # not under /v1: no API key, as in vLLM
                        "/tokenize": {"200": json_, "400": json_, "404": json_, **errors},
                        "/detokenize": {"200": json_, "400": json_, "404": json_, **errors}}
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # validation errors are 400s with the OpenAI body
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    assert doc["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer"}}


def test_huge_top_k_means_no_filter_not_an_engine_failure(server):
    """top_k beyond the vocabulary (even beyond int32) samples from all of it; the batch is not aborted."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "top_k": 2**40, "seed": 1, "ignore_eos": True}
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3


# -- admission, in-process ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1 << 16)


@pytest.fixture()
def client(llm):
    app = build_app(llm, None, Metrics(MODEL), served_model_name=MODEL)  # no engine: nothing may reach it
    with TestClient(app) as test_client:
        yield test_client


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    "body, param, fragments",
    [
        ({"prompt": [1, 2, 264]}, "prompt", ["264", "outside this model's vocabulary [0, 264)", "tokenizer"]),
        ({"prompt": [[5, -1]]}, "prompt", ["greater than or equal to 0"]),
        ({"prompt": "x" * 40}, "prompt", ["41 tokens", f"max_model_len={MAX_MODEL_LEN}", "shorten it to at most 31"]),
        ({"prompt": [], "max_tokens": 2}, "prompt", ["empty"]),
        ({"prompt": "hi", "max_tokens": 33}, "max_tokens", ["max_tokens=33", "max_model_len=32", "at most"]),
        # vLLM's rule: the prompt (3 tokens) and max_tokens within max_model_len
        ({"prompt": "hi", "max_tokens": 30}, "max_tokens", ["max_tokens=30 with a prompt of 3 tokens (33 in all)",
                                                            "max_model_len=32", "(29)"]),
        # each prompt of a list is checked
        ({"prompt": ["a", "b" * 40]}, "prompt", ["prompt 1 is 41 tokens", "shorten it"]),
        ({"prompt": "hi", "n": 17}, "n", ["n: Input should be less than or equal to 16"]),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ["needs echo=true"]),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", ["max_logprobs=20", "--max-logprobs"]),
        ({"prompt": "hi", "suffix": "end"}, "suffix", ["suffix", "not supported"]),
        ({"prompt": "hi", "guided_json": {}}, "guided_json", ["unsupported field 'guided_json'"]),
        ({"prompt": "hi", "best_of": 3, "n": 2, "stream": True}, "best_of", ["cannot stream"]),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", ["token ids"]),
        ({"prompt": "hi", "logit_bias": {"999": 1}}, "logit_bias", ["outside this model's vocabulary"]),
        ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens", ["<= max_tokens"]),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", ["less than or equal to 2"]),
    ],
)
def test_admission_errors_say_what_to_change(client, body, param, fragments):
    error = error_of(client.post("/v1/completions", json={"model": MODEL, **body}), 400)
    assert error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_past_the_context_is_refused_naming_its_field(client, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: MAX_MODEL_LEN - 1}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == field and f"{field}={MAX_MODEL_LEN - 1} with a prompt of" in error["message"]


def test_one_spelling_of_the_error_type_and_code(client):
    """A body that fails validation and one the admission refuses say the same (it was "invalid_request")."""
    invalid = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 0}), 400)
    refused = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "suffix": "x"}), 400)
    assert invalid["code"] == refused["code"] == "invalid_request_error"


def test_non_finite_sampling_values_are_refused(client):
    body = b'{"model": "tiny", "prompt": "hi", "temperature": NaN}'  # Python's json reads NaN; it is no temperature
    error = error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == "temperature" and "finite" in error["message"]


def test_chat_admission_errors(client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = error_of(client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 99}), 400)
    assert error["param"] == "max_completion_tokens" and "max_model_len=32" in error["message"]
    error = error_of(client.post("/v1/chat/completions", json={**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}), 400)  # was a 500 (str.join of an int)
    assert error["param"] == "messages"
    long = {**chat, "messages": [{"role": "user", "content": "z" * 40}]}
    error = error_of(client.post("/v1/chat/completions", json=long), 400)
    assert error["param"] == "messages" and "shorten it" in error["message"]


@pytest.mark.parametrize("prompt", [[1, 2, 264], [], list(range(40))], ids=["vocabulary", "empty", "too-long"])
def test_the_server_refuses_what_llm_refuses(client, llm, prompt):
    """One set of request checks: the 400 carries LLM.generate's RequestError (message, param, code)."""
    with pytest.raises(RequestError) as raised:
        llm.make_sequences({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}), 400)
    assert error["message"] == str(raised.value) and error["param"] == raised.value.param == "prompt"
    assert error["code"] == (raised.value.code or "invalid_request_error")


def test_guard_errors_are_openai_bodies(llm):
    app = build_app(llm, None, Metrics(MODEL), served_model_name=MODEL, api_key=API_KEY, max_body_bytes=1000)
    with TestClient(app) as client:
        body = {"model": MODEL, "prompt": "x" * 2000}
        error = error_of(client.post("/v1/completions", json=body, headers=AUTH), 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']), headers=AUTH)
        assert error_of(chunked, 413)["code"] == "request_too_large"  # no Content-Length: counted as it comes
        assert client.post("/v1/completions", json={"model": MODEL}).status_code == 401
        as_json = {**AUTH, "content-type": "application/json"}
        assert error_of(client.post("/v1/completions", content=b"[1]", headers=as_json), 400)["message"].startswith(
            "the body must be a JSON object")
        assert error_of(client.get("/nowhere"), 404)["code"] == "not_found"
