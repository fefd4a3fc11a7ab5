"""The plumbing of the two hops: which backend is next, the bodies each receives, sending to
one (its failures as the 503 the client gets), and relaying its answer as is.

A backend's own answer (a 400 for a bad field, a 503 for a full transfer buffer) is passed
through untouched: its message already says what to change, and the router adding its own
words would only make the two paths (direct, routed) differ.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from dcpjax.serve.errors import error_response

logger = logging.getLogger("dcpjax.serve.router")

# a decode server that cannot be reached leaves the prompt's KV parked on the prefill server: its 503 says so
KV_KEPT = " (the prefill server has kept the prompt's KV; it frees it after its timeout)"


class Reply(Exception):
    """Ends a request early with `response` (the router's refusal or a backend's own error
    answer), counted as `outcome` in the router's metrics."""

    def __init__(self, response: Response, outcome: str):
        super().__init__(outcome)
        self.response, self.outcome = response, outcome


def backend_url(text: str) -> str:
    """A backend's base URL, checked and without a trailing slash ('http://127.0.0.1:8100');
    ValueError saying what is wrong."""
    try:
        parts = urlsplit(text)
        _ = parts.port  # ValueError for a port out of range or not a number
    except ValueError as err:
        raise ValueError(f"{text!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"{text!r} is not a server's base URL — give http://HOST:PORT (e.g. http://127.0.0.1:8100)")
    return text.rstrip("/")


class Backends:
    """The servers of one role ('prefill' or 'decode'), taken in turn (round robin)."""

    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"the router needs at least one {role} server URL (--{role} URL)")
        self.role, self.urls = role, [backend_url(u) for u in urls]
        self._turn = itertools.cycle(self.urls)

    def next(self) -> str:
        """The next server's base URL (one event loop: no lock needed)."""
        return next(self._turn)


def describe(err: BaseException) -> str:
    """'ConnectError: [Errno 111] Connection refused' on one line ('ReadTimeout' when it says nothing)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def unreachable(role: str, url: str, err: httpx.HTTPError, timeout: float, note: str = "") -> Reply:
    """The 503 for a backend that gave no HTTP answer: which one, why, and what to check (`note`:
    what it leaves behind)."""
    if isinstance(err, httpx.TimeoutException):
        why = f"did not answer within {timeout:g} s ({describe(err)}): is it overloaded, or is --timeout too short?"
    else:
        why = f"is unreachable ({describe(err)}): is it running?"
    message = f"the {role} server {url} {why}{note}"
    logger.warning("%s", message)
    return Reply(error_response(503, message, "service_unavailable", f"{role}_unreachable"), f"{role}_unavailable")


def prefill_body(body: dict, chat: bool = False) -> dict:
    """What the prefill server gets (vLLM's toy proxy's): one token, no stream, keep the KV for a
    decode server. Its token is the client's first (it travels with the KV), so min_tokens stays,
    at most 1 (more is a 400 over max_tokens 1): a first token must not be EOS when the client
    said so. The client's max_tokens goes along (`client_max_tokens`): the prefill server refuses a
    prompt + output past max_model_len before it runs the prompt, as the decode server would after
    (`chat`: a chat's max_completion_tokens, when given, wins over max_tokens, as OpenAI's)."""
    asked = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        asked = body["max_completion_tokens"]
    transfer: dict = {"do_remote_decode": True}
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1:  # else the servers' own 400s say why
        transfer["client_max_tokens"] = asked
    body = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
    if "min_tokens" in body:
        minimum = body["min_tokens"]
        body["min_tokens"] = min(minimum, 1) if isinstance(minimum, int) and not isinstance(minimum, bool) else minimum
    return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": transfer}


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """What the decode server gets: the client's own request and the prefill server's handle."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def encode(body: dict) -> bytes:
    """The JSON the backend receives; a Reply 400 for nesting too deep to write back."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, RecursionError) as err:
        raise Reply(error_response(400, f"the body cannot be forwarded: {err}"), "client_error") from None


async def send(client: httpx.AsyncClient, role: str, url: str, method: str, path: str, *, headers: dict[str, str],
               body: dict | None = None, stream: bool = False, timeout: float, note: str = "") -> httpx.Response:
    """The backend's answer (its body unread when `stream`); a Reply 503 when there is none
    (`note` added to its message)."""
    content = None if body is None else encode(body)
    headers = headers if content is None else {**headers, "content-type": "application/json"}
    request = client.build_request(method, url + path, content=content, headers=headers)
    try:
        return await client.send(request, stream=stream)
    except httpx.HTTPError as err:
        raise unreachable(role, url, err, timeout, note) from None


def relay(answer: httpx.Response) -> Response:
    """The backend's (read) answer as the router's: same status, same bytes, same content type."""
    headers = {k: v for k, v in answer.headers.items() if k.lower() == "retry-after"}
    return Response(answer.content, status_code=answer.status_code, headers=headers,
                    media_type=answer.headers.get("content-type"))


class _RelayedStream(StreamingResponse):
    """A StreamingResponse that always ends its body iterator: when the client goes away, ASGI 2.4
    servers make `send` raise and Starlette leaves the iterator suspended, which would hold the
    decode server's connection (and its generation) open until garbage collection. A client gone
    is no error of the router's: nothing is left to answer, so nothing is raised (or logged as one)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        finally:
            await self.body_iterator.aclose()


async def _chunks(answer: httpx.Response, url: str, on_end: Callable[[str], None]) -> AsyncIterator[bytes]:
    """The decode server's stream, chunk by chunk as it arrives; a break ends it (the status and
    headers are gone already: the client sees the events so far, then the end)."""
    outcome = "client_disconnected"
    try:
        async for chunk in answer.aiter_bytes():
            yield chunk
        outcome = "ok"
    except httpx.HTTPError as err:
        outcome = "decode_stream_broken"
        logger.warning("the decode server %s broke its stream (%s): ended the client's stream there", url,
                       describe(err))
    finally:
        on_end(outcome)
        with anyio.CancelScope(shield=True):  # also when cancelled: the decode server stops generating
            await answer.aclose()


async def relay_stream(answer: httpx.Response, url: str, timeout: float,
                       on_end: Callable[[str], None]) -> tuple[Response, str | None]:
    """The decode server's streamed answer as the router's, and its outcome (None: counted by
    `on_end` when the stream ends). An error answer (4xx/5xx) is read and relayed whole."""
    if answer.status_code >= 400:
        try:
            await answer.aread()
        except httpx.HTTPError as err:
            raise unreachable("decode", url, err, timeout) from None
        finally:
            await answer.aclose()
        return relay(answer), "decode_error"
    media_type = answer.headers.get("content-type", "text/event-stream")
    return _RelayedStream(_chunks(answer, url, on_end), status_code=answer.status_code,
                          media_type=media_type), None


def kv_transfer_params(answer: httpx.Response, url: str) -> dict:
    """The prefill server's handle for the decode server; a Reply 502 when it sent none (a server
    started without --kv-transfer-config answers an ordinary completion)."""
    try:
        params = answer.json().get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):  # not JSON, or not an object
        params = None
    if isinstance(params, dict):
        return params
    message = (f"the prefill server at {url} returned no kv_transfer_params: start it with --kv-transfer-config "
               "'{\"kv_role\": \"kv_producer\"}'")
    logger.warning("%s", message)
    raise Reply(error_response(502, message, "server_error", "no_kv_transfer_params"),
                "prefill_no_kv_transfer_params")
