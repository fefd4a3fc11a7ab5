"""The router's ASGI app: /v1/completions and /v1/chat/completions through a prefill server and
then a decode server; /v1/models from a decode server; /health of every backend; /metrics.

One `httpx.AsyncClient` serves every request (created at startup, closed at shutdown): its
connection pool keeps the backends' connections open between requests, which a client per
request would reopen each time. Errors are OpenAI-style bodies (`dcpjax.serve.errors`), the
same as a server's, and bad input is a 4xx, never a 500.

The router speaks only HTTP to its backends, never the KV transfer wire: the servers own the KV.
A decode server that refuses a request (a 4xx) releases its handle on the prefill server itself,
and the router relays that 4xx as is. So this package imports neither JAX nor the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import dcpjax
from dcpjax.serve.errors import APIError, add_error_handling, error_response
from dcpjax.serve.router.checks import check_pd_request, parse_body
from dcpjax.serve.router.metrics import RouterMetrics
from dcpjax.serve.router.proxy import (
    KV_KEPT,
    Backends,
    Reply,
    decode_body,
    describe,
    kv_transfer_params,
    prefill_body,
    relay,
    relay_stream,
    send,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HEALTH_TIMEOUT = 5.0  # seconds for a backend's /health: a probe must answer before its own deadline does
MAX_BODY_BYTES = 64 << 20  # the router's own bound on a body it holds; each backend applies its own limit too
MAX_IDLE_CONNECTIONS = 256  # kept-alive connections to the backends (no cap on open ones: streams hold theirs)


def forward_headers(request: Request) -> dict[str, str]:
    """The headers both backends get: the client's Authorization (the backends may check the same
    key) and one X-Request-Id (the client's, else a new one) to follow a request in both logs."""
    headers = {"x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex}
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


class Router:
    """What the routes share: the backends of each role, the HTTP client, the metrics."""

    def __init__(self, prefill: Backends, decode: Backends, timeout: float, metrics: RouterMetrics):
        self.prefill, self.decode, self.timeout, self.metrics = prefill, decode, timeout, metrics
        self.client: httpx.AsyncClient | None = None  # the app's lifespan opens and closes it

    async def generate(self, request: Request, path: str) -> Response:
        """One completion through both hops, counted by its outcome."""
        headers = forward_headers(request)
        try:
            body = await self._read(request, path)
            params = await self._prefill(path, body, headers)
            response, outcome = await self._decode(path, body, params, headers)
        except Reply as reply:
            response, outcome = reply.response, reply.outcome
        if outcome is not None:  # None: a stream, counted when it ends
            self.metrics.count(outcome)
        response.headers["x-request-id"] = headers["x-request-id"]
        return response

    async def _read(self, request: Request, path: str) -> dict:
        """The body, if a P/D pair can serve it; a Reply 4xx otherwise."""
        try:
            body = parse_body(await request.body())
            check_pd_request(body, completions=path == COMPLETIONS)
        except APIError as err:
            response = error_response(err.status, err.message, err.kind, err.code, err.param)
            raise Reply(response, "client_error") from None
        except StarletteHTTPException as err:  # the request guard's 413, raised as the body arrives
            raise Reply(error_response(err.status_code, str(err.detail), code="request_too_large"),
                        "client_error") from None
        return body

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> dict:
        """The first hop: the prompt's prefill, and the handle to its KV."""
        url = self.prefill.next()
        start = time.perf_counter()
        answer = await send(self.client, "prefill", url, "POST", path, headers=headers,
                            body=prefill_body(body, chat=path == CHAT), timeout=self.timeout)
        self.metrics.prefill_seconds.observe(time.perf_counter() - start)
        if answer.status_code >= 400:
            raise Reply(relay(answer), "prefill_error")
        return kv_transfer_params(answer, url)

    async def _decode(self, path: str, body: dict, params: dict,
                      headers: dict[str, str]) -> tuple[Response, str | None]:
        """The second hop: the client's own request with the handle; its answer, relayed. A decode
        server that refuses the request (a 4xx, before its pull) releases the handle's KV on the
        prefill server itself: the router only relays its answer."""
        url = self.decode.next()
        # any stream value but false/absent: a backend reads "true" and 1 as true, and a stream relays a JSON
        # answer just as well, so this never buffers what the client expects as events
        stream = body.get("stream") not in (None, False)
        answer = await send(self.client, "decode", url, "POST", path, headers=headers,
                            body=decode_body(body, params), stream=stream, timeout=self.timeout, note=KV_KEPT)
        if stream:
            return await relay_stream(answer, url, self.timeout, self.metrics.count)
        return relay(answer), "ok" if answer.status_code < 400 else "decode_error"

    async def models(self, request: Request) -> Response:
        """A decode server's /v1/models (the pair serves the same model)."""
        try:
            answer = await send(self.client, "decode", self.decode.next(), "GET", "/v1/models",
                                headers=forward_headers(request), timeout=self.timeout)
        except Reply as reply:
            return reply.response
        return relay(answer)

    async def health(self) -> Response:
        """200 when every backend's /health answers 200; else 503 naming each one that does not."""
        backends = [(b.role, url) for b in (self.prefill, self.decode) for url in b.urls]
        problems = [p for p in await asyncio.gather(*(self._problem(role, url) for role, url in backends)) if p]
        if not problems:
            return PlainTextResponse("")
        return error_response(503, f"not ready: {'; '.join(problems)}", "service_unavailable", "backend_unavailable")

    async def _problem(self, role: str, url: str) -> str | None:
        """Why the backend at `url` is not healthy (None: it is)."""
        try:
            answer = await self.client.get(url + "/health", timeout=min(self.timeout, HEALTH_TIMEOUT))
        except httpx.HTTPError as err:
            return f"the {role} server {url} is unreachable ({describe(err)})"
        if answer.status_code != 200:
            return f"the {role} server {url} answered {answer.status_code} on /health"
        return None


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], *, timeout: float = 600.0,
              api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router over these backends (each list taken round robin). `timeout`: seconds for each
    backend request (connect, and each read: between two events of a stream); `api_key`: what
    clients must send as 'Authorization: Bearer KEY' on /v1/*; `transport`: the backends' HTTP
    transport (tests pass an httpx.MockTransport of fake servers)."""
    if not timeout > 0:
        raise ValueError(f"the router's timeout must be > 0 seconds, got {timeout}")
    router = Router(Backends("prefill", list(prefill_urls)), Backends("decode", list(decode_urls)), timeout,
                    RouterMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_IDLE_CONNECTIONS)
        # trust_env=False: the backends are this deployment's own servers, never to be reached through an
        # HTTP(S)_PROXY meant for the outside world
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport,
                                     trust_env=False) as client:
            router.client = client
            yield

    app = FastAPI(title="dcpjax router", version=dcpjax.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    add_error_handling(app, api_key, MAX_BODY_BYTES)
    _add_routes(app, router)
    return app


def _add_routes(app: FastAPI, router: Router) -> None:
    """The OpenAI routes through the backends, and the router's own /health and /metrics."""

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await router.generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await router.generate(request, CHAT)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
