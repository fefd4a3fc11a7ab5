"""The prefill/decode router (`python -m dcpjax.serve.router`) against fake backends: an
httpx.MockTransport stands in for the prefill and decode servers, recording what each receives,
so every path (both hops, streams, refusals, backends down or misconfigured) runs in
milliseconds without a model."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dcpjax.entrypoints import cli
from dcpjax.serve.router import build_app
from dcpjax.serve.router.__main__ import main

PREFILL, PREFILL2 = "http://127.0.0.1:8100", "http://127.0.0.1:8101"
DECODE, DECODE2 = "http://127.0.0.1:8200", "http://127.0.0.1:8201"
HANDLE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "10.0.0.1", "remote_port": 7000,
          "transfer_id": "t-1"}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " world",
              "finish_reason": "length"}], "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}}
EVENTS = [b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n',
          b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n',
          b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n', b"data: [DONE]\n\n"]
SSE = {"content-type": "text/event-stream; charset=utf-8"}


Call = collections.namedtuple("Call", "base path body headers")


class Fakes:
    """Fake prefill and decode servers behind one transport. Set `prefill` / `decode` to another
    answer (a function of the request's body), or put a base URL in `down` to refuse connections."""

    def __init__(self):
        self.calls: list[Call] = []
        self.down: dict[str, Exception] = {}
        self.health: dict[str, int] = {}
        self.prefill = lambda body: httpx.Response(200, json={**COMPLETION, "kv_transfer_params": HANDLE})
        self.decode = lambda body: httpx.Response(200, json=COMPLETION)
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise self.down[base]
        body = json.loads(request.content) if request.content else None
        self.calls.append(Call(base, request.url.path, body, request.headers))
        if request.url.path == "/health":
            return httpx.Response(self.health.get(base, 200))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        return (self.prefill if base in (PREFILL, PREFILL2) else self.decode)(body)

    def bodies(self, base: str) -> list[dict]:
        return [c.body for c in self.calls if c.base == base]


class Events(httpx.AsyncByteStream):
    """A decode server's event stream: its chunks one at a time (the second only once `gate` is
    set, if given), then `error` (if given); records whether the router closed it."""

    def __init__(self, chunks: list[bytes], gate: asyncio.Event | None = None, error: Exception | None = None):
        self.chunks, self.gate, self.error, self.closed = chunks, gate, error, False

    async def __aiter__(self):
        for i, chunk in enumerate(self.chunks):
            if i == 1 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 5)
            yield chunk
            await asyncio.sleep(0)
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def fakes():
    return Fakes()


def router(fakes: Fakes, prefill=(PREFILL,), decode=(DECODE,), **kwargs) -> TestClient:
    return TestClient(build_app(list(prefill), list(decode), transport=fakes.transport, **kwargs))


def outcomes(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    counts = {s.labels["outcome"]: s.value for s in samples if s.name == "dcpjax_router_requests_total"}
    counts["prefill_count"] = next(s.value for s in samples if s.name == "dcpjax_router_prefill_seconds_count")
    return counts


async def call_asgi(fakes: Fakes, path: str, body: dict, send) -> str:
    """One request straight through the app's ASGI interface (each `send` seen, as a server sees
    it, with ASGI 2.4's semantics); the router's /metrics afterwards."""
    app = build_app([PREFILL], [DECODE], transport=fakes.transport)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5),
             "server": ("testserver", 80)}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays

    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return (await client.get("/metrics")).text


# -- both hops ------------------------------------------------------------------------------------
def test_completion_prefills_then_decodes_with_the_producers_handle(fakes):
    request = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "min_tokens": 2, "temperature": 0}
    with router(fakes) as client:
        r = client.post("/v1/completions", json=request, headers={"Authorization": "Bearer k", "X-Request-Id": "r1"})
    assert r.status_code == 200 and r.json() == COMPLETION
    assert r.content == httpx.Response(200, json=COMPLETION).content  # the decode server's bytes as is
    prefill, decode = fakes.calls
    assert (prefill.base, prefill.path, decode.base, decode.path) == (PREFILL, "/v1/completions", DECODE,
                                                                      "/v1/completions")
    # the prefill's token is the client's first: min_tokens goes along, at most 1 (no EOS first); the client's
    # max_tokens too, for the prefill server to refuse a prompt + output past max_model_len before it runs
    assert prefill.body == {"model": "tiny", "prompt": "Hello", "max_tokens": 1, "min_tokens": 1, "temperature": 0,
                            "stream": False, "kv_transfer_params": {"do_remote_decode": True, "client_max_tokens": 5}}
    assert decode.body == {**request, "kv_transfer_params": HANDLE}
    for call in (prefill, decode):
        assert call.headers["authorization"] == "Bearer k" and call.headers["x-request-id"] == "r1"
    assert r.headers["x-request-id"] == "r1"


def test_streamed_chat_passes_every_event_through_in_order(fakes):
    fakes.decode = lambda body: httpx.Response(200, headers=SSE, stream=Events(EVENTS))
    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
               "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    with router(fakes) as client, client.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert b"".join(r.iter_bytes()) == b"".join(EVENTS)
    assert fakes.bodies(PREFILL) == [{"model": "tiny", "messages": request["messages"], "max_tokens": 1,
                                      "stream": False,
                                      "kv_transfer_params": {"do_remote_decode": True, "client_max_tokens": 9}}]
    assert fakes.bodies(DECODE) == [{**request, "kv_transfer_params": HANDLE}]


def test_chat_without_stream_returns_the_decode_servers_json_under_a_new_request_id(fakes):
    chat = {"id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "Hi"}}]}
    fakes.decode = lambda body: httpx.Response(200, json=chat)
    with router(fakes) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json() == chat
    assert [c.path for c in fakes.calls] == ["/v1/chat/completions"] * 2
    ids = {c.headers["x-request-id"] for c in fakes.calls}  # one per request, the same on both hops
    assert ids == {r.headers["x-request-id"]} and "authorization" not in fakes.calls[0].headers


def test_each_event_is_relayed_as_it_arrives_not_when_the_stream_ends(fakes):
    """The fake decode server sends its second event only once the router relayed the first: a
    router that buffered the stream would wait for it forever (here: 5 s, then fail)."""
    first_relayed, bodies = asyncio.Event(), []
    events = Events(EVENTS, gate=first_relayed)
    fakes.decode = lambda body: httpx.Response(200, headers=SSE, stream=events)

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            bodies.append(message["body"])
            first_relayed.set()

    text = asyncio.run(call_asgi(fakes, "/v1/chat/completions", {"messages": [], "stream": True}, send))
    assert bodies == EVENTS and events.closed and 'requests_total{outcome="ok"} 1.0' in text


def test_a_client_that_leaves_mid_stream_closes_the_decode_servers_stream(fakes):
    """An ASGI 2.4 server's `send` raises once the client is gone; the router then closes its
    stream from the decode server (which stops generating) and counts client_disconnected."""
    events = Events(EVENTS)
    fakes.decode = lambda body: httpx.Response(200, headers=SSE, stream=events)

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            raise OSError("the client went away")

    text = asyncio.run(call_asgi(fakes, "/v1/completions", {"prompt": "Hi", "stream": True}, send))
    assert events.closed and 'dcpjax_router_requests_total{outcome="client_disconnected"} 1.0' in text


def test_round_robin_over_two_prefill_and_two_decode_servers(fakes):
    with router(fakes, prefill=(PREFILL, PREFILL2), decode=(DECODE, DECODE2)) as client:
        for _ in range(4):
            assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
    assert [c.base for c in fakes.calls] == [PREFILL, DECODE, PREFILL2, DECODE2] * 2


def test_models_come_from_a_decode_server(fakes):
    with router(fakes) as client:
        r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert [(c.base, c.path) for c in fakes.calls] == [(DECODE, "/v1/models")]


# -- refused up front -----------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [], "n": "3"}, "n"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [], "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": ["Hi", "there"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
])
def test_what_a_pd_pair_cannot_do_is_a_400_before_any_backend(fakes, path, body, param):
    with router(fakes) as client:
        r = client.post(path, json=body)
        assert outcomes(client)["client_error"] == 1
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert fakes.calls == []
    if param in ("n", "best_of"):
        assert "send n=1 through the P/D router" in error["message"]


@pytest.mark.parametrize("content", [b'{"prompt": "Hi"', b"[1, 2]", b'{"prompt": "Hi", "temperature": NaN}',
                                     b"\xff\xfe", b"[" * 100_000])
def test_a_body_that_is_not_a_json_object_is_a_400(fakes, content):
    with router(fakes) as client:
        r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error" and fakes.calls == []


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["Hi"], [[1, 2]], "Hi"])
def test_one_prompt_in_any_of_its_forms_goes_through(fakes, prompt):
    with router(fakes) as client:
        assert client.post("/v1/completions", json={"prompt": prompt, "n": 1, "echo": False}).status_code == 200
    assert fakes.bodies(DECODE)[0]["prompt"] == prompt


# -- backends down or misconfigured ---------------------------------------------------------------
def test_decode_unreachable_is_a_503_naming_the_decode_server(fakes):
    fakes.down[DECODE] = httpx.ConnectError("[Errno 111] Connection refused")
    with router(fakes) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi"})
        assert outcomes(client)["decode_unavailable"] == 1
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and f"the decode server {DECODE} is unreachable (ConnectError: " in message
    assert "is it running?" in message and "kept the prompt's KV" in message
    assert [c.base for c in fakes.calls] == [PREFILL]


@pytest.mark.parametrize("error, words", [(httpx.ConnectError("[Errno 111] Connection refused"), "is unreachable"),
                                          (httpx.ReadTimeout("timed out"), "did not answer within 600 s")])
def test_prefill_unreachable_is_a_503_naming_the_prefill_server(fakes, error, words):
    fakes.down[PREFILL] = error
    with router(fakes) as client:
        r = client.post("/v1/chat/completions", json={"messages": []})
        assert outcomes(client)["prefill_unavailable"] == 1
    assert r.status_code == 503 and f"the prefill server {PREFILL} {words}" in r.json()["error"]["message"]
    assert fakes.calls == []


@pytest.mark.parametrize("answer", [httpx.Response(200, json=COMPLETION), httpx.Response(200, text="not json"),
                                    httpx.Response(200, json={**COMPLETION, "kv_transfer_params": None}),
                                    httpx.Response(200, json=[1])])
def test_a_prefill_answer_without_kv_transfer_params_is_a_502(fakes, answer):
    fakes.prefill = lambda body: answer
    with router(fakes) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 502 and r.json()["error"]["message"] == (
        f"the prefill server at {PREFILL} returned no kv_transfer_params: start it with --kv-transfer-config "
        "'{\"kv_role\": \"kv_producer\"}'")
    assert [c.base for c in fakes.calls] == [PREFILL]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_backends_own_error_answer_passes_through_unchanged(fakes, role, stream):
    error = {"error": {"message": "temperature: must be >= 0", "type": "invalid_request_error",
                       "param": "temperature", "code": "invalid_request_error"}}
    setattr(fakes, role, lambda body: httpx.Response(400, json=error))
    with router(fakes) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "temperature": -1, "stream": stream})
        assert outcomes(client)[f"{role}_error"] == 1
    assert r.status_code == 400 and r.content == httpx.Response(400, json=error).content
    assert r.headers["content-type"] == "application/json"
    # a refusing decode server releases the prefill server's KV itself: the router only relays its 4xx
    assert [c.base for c in fakes.calls] == ([PREFILL] if role == "prefill" else [PREFILL, DECODE])


def test_a_decode_stream_that_breaks_ends_the_clients_stream(fakes):
    events = Events(EVENTS[:1], error=httpx.RemoteProtocolError("peer closed connection without sending all"))
    fakes.decode = lambda body: httpx.Response(200, headers=SSE, stream=events)
    with router(fakes) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
            assert r.status_code == 200 and b"".join(r.iter_bytes()) == EVENTS[0]
        assert outcomes(client)["decode_stream_broken"] == 1 and events.closed


# -- health, api key, metrics ---------------------------------------------------------------------
def test_health_is_503_naming_each_backend_that_is_down(fakes):
    with router(fakes, decode=(DECODE, DECODE2)) as client:
        assert client.get("/health").status_code == 200
        fakes.down[DECODE2] = httpx.ConnectError("[Errno 111] Connection refused")
        fakes.health[PREFILL] = 503
        r = client.get("/health")
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and f"the decode server {DECODE2} is unreachable" in message
    assert f"the prefill server {PREFILL} answered 503" in message and DECODE + " " not in message


def test_api_key_is_required_on_v1_and_forwarded(fakes):
    with router(fakes, api_key="sekrit") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.post("/v1/completions", json={"prompt": "Hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401 and fakes.calls == []
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        ok = client.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert {c.headers["authorization"] for c in fakes.calls if c.path != "/health"} == {"Bearer sekrit"}


def test_metrics_count_each_outcome_and_time_the_prefills(fakes):
    with router(fakes) as client:
        client.post("/v1/completions", json={"prompt": "Hi"})
        client.post("/v1/completions", json={"prompt": "Hi"})
        client.post("/v1/completions", json={"prompt": "Hi", "n": 4})
        fakes.down[DECODE] = httpx.ConnectError("refused")
        client.post("/v1/completions", json={"prompt": "Hi"})
        fakes.down[PREFILL] = httpx.ConnectError("refused")
        client.post("/v1/completions", json={"prompt": "Hi"})
        counts = outcomes(client)
        assert client.get("/metrics").headers["content-type"].startswith("text/plain")
        with router(fakes) as other:  # an app of its own, a registry of its own
            assert outcomes(other)["ok"] == 0
    assert counts == {"ok": 2, "client_error": 1, "decode_unavailable": 1, "prefill_unavailable": 1,
                      "prefill_error": 0, "prefill_no_kv_transfer_params": 0, "decode_error": 0,
                      "decode_stream_broken": 0, "client_disconnected": 0, "prefill_count": 3}


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--prefill", PREFILL], "the following arguments are required: --decode"),
    (["--prefill", PREFILL, "--decode", "127.0.0.1:8200"], "is not a server's base URL"),
    (["--prefill", "http://h:99999", "--decode", DECODE], "is not a URL"),
    (["--prefill", PREFILL, "--decode", DECODE, "--timeout", "0"], "--timeout must be > 0"),
    (["--prefill", PREFILL, "--decode", DECODE, "--port", "70000"], "--port must be in [0, 65535]"),
])
def test_bad_flags_are_one_line_errors_with_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.run(main, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and "Traceback" not in err


def test_a_busy_port_is_a_one_line_error_before_serving(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert cli.run(main, ["--prefill", PREFILL, "--decode", DECODE, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"cannot serve on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_python_m_router_serves_on_the_port_it_logs():
    """The real entry point: --port 0, the log line names the port, /health answers 503 naming the
    prefill server nobody started (port 9: refused), SIGTERM stops it."""
    argv = [sys.executable, "-m", "dcpjax.serve.router", "--port", "0", "--prefill", "http://127.0.0.1:9",
            "--decode", "http://127.0.0.1:9"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        line = next((line for line in proc.stderr if "router on" in line), "")  # past any library's warnings
        found = re.search(r"router on http://127\.0\.0\.1:(\d+) \(prefill: \['http://127\.0\.0\.1:9'\], decode: ", line)
        assert found, line
        r = health_when_up(f"http://127.0.0.1:{found[1]}/health")
        assert r.status_code == 503 and "the prefill server http://127.0.0.1:9 is unreachable" in r.text
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0, proc.stderr.read()


def health_when_up(url: str, seconds: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:  # the port is bound before uvicorn listens: refused for those few milliseconds
        try:
            return httpx.get(url, timeout=5.0)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- no JAX, quick start --------------------------------------------------------------------------
JAX_FREE = """
import sys
import dcpjax.serve.router.__main__
from dcpjax.serve.router import build_app
build_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
heavy = ("jax", "jaxlib", "dcpjax.engine", "dcpjax.llm", "dcpjax.runner", "dcpjax.kv_transfer")
loaded = sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy)))
assert not loaded, loaded
"""


def test_the_router_imports_neither_jax_nor_the_engine():
    """The router is HTTP only: no JAX, no engine, no KV wire (a refusing decode server releases the
    handle itself), in a fresh interpreter (this one has JAX already)."""
    done = subprocess.run([sys.executable, "-c", JAX_FREE], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


STARTUP_SECONDS = 2.0  # the bound: typically ~0.5 s on an idle machine (no JAX to import)


def test_python_m_router_answers_metrics_within_2_s_of_starting():
    argv = [sys.executable, "-m", "dcpjax.serve.router", "--prefill", "http://127.0.0.1:1", "--decode",
            "http://127.0.0.1:2", "--port", "0"]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        line = next((line for line in proc.stderr if "router on" in line), "")
        found = re.search(r"router on http://127\.0\.0\.1:(\d+) ", line)
        assert found, line
        r = health_when_up(f"http://127.0.0.1:{found[1]}/metrics")
        seconds = time.monotonic() - start
        assert r.status_code == 200 and "dcpjax_router_requests_total" in r.text
        assert seconds < STARTUP_SECONDS, f"the router took {seconds:.2f} s to answer /metrics"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0, proc.stderr.read()


@pytest.mark.parametrize("body, chat, sent", [
    ({"max_tokens": 7}, False, 7),
    ({"max_tokens": 7, "max_completion_tokens": 9}, True, 9),  # a chat's max_completion_tokens wins
    ({"max_tokens": 7, "max_completion_tokens": None}, True, 7),  # null is not given
    ({"max_tokens": 7, "max_completion_tokens": 9}, False, 7),  # not a completions field: its own 400 says so
    ({"max_tokens": True}, False, None), ({"max_tokens": 0}, False, None), ({}, True, None),
])
def test_the_prefill_carries_the_clients_max_tokens(body, chat, sent):
    from dcpjax.serve.router.proxy import prefill_body

    transfer = prefill_body({"model": "tiny", **body}, chat=chat)["kv_transfer_params"]
    assert transfer == {"do_remote_decode": True} | ({"client_max_tokens": sent} if sent is not None else {})
