"""One log line per finished request (vLLM logs requests too; `--disable-log-requests` stops it).

    POST /v1/completions 200 request_id=cmpl-9f2c… prompt_tokens=5 completion_tokens=16 finish_reason=length
        latency_ms=41.7  (all on one line)

An ASGI middleware on the "dcpjax.serve" logger, INFO (the /health and /metrics probes at
DEBUG). It reads what the route handlers already send: the response's `id` (else the
request's X-Request-Id header), `usage` and each choice's `finish_reason`, from the JSON
body or, for a stream, from its server-sent events (the usage only with
`stream_options.include_usage`). What it cannot know is `-`. The line is written when the
response ends (a stream: its last event); a response cut short (the client left, the
server failed mid-stream) says `incomplete`. Whatever goes wrong in here is logged at DEBUG
and never reaches the request.
"""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("dcpjax.serve")

PROBES = ("/health", "/metrics")  # polled all the time: DEBUG, not INFO
MAX_JSON_BYTES = 1 << 20  # larger bodies (long logprobs) are not parsed: their tokens show as "-"


class _Record:
    """What one request's response said so far."""

    def __init__(self, scope) -> None:
        self.start = time.perf_counter()
        self.method, self.path = scope.get("method", "-"), scope.get("path", "-")
        headers = dict(scope.get("headers") or ())
        self.request_id: str | None = headers.get(b"x-request-id", b"").decode("latin-1") or None
        self.status: int | None = None
        self.complete = False
        self.kind = ""  # "stream" (server-sent events), "json" or "" (not read)
        self.body: list[bytes] = []  # a JSON body so far, or a stream's unfinished line
        self.size = 0
        self.usage: dict = {}
        self.finish: dict[int, str] = {}  # choice index -> finish_reason

    def see(self, message) -> None:
        """Note a message the app sends (what cannot be read is left out, never raised)."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
            self.kind = ("stream" if content_type.startswith(b"text/event-stream")
                         else "json" if content_type.startswith(b"application/json") else "")
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            self.size += len(chunk)
            self.complete = not message.get("more_body", False)
            try:
                self._read(chunk)
            except (ValueError, TypeError, AttributeError):
                logger.debug("request log: cannot read the response of %s", self.path, exc_info=True)
                self.kind = ""  # stop reading this one

    def _read(self, chunk: bytes) -> None:
        if self.kind == "stream":  # each `data: {...}` line is one chunk of the response
            *lines, rest = b"".join([*self.body, chunk]).split(b"\n")
            self.body = [rest]
            for line in lines:
                if line.startswith(b"data: {"):
                    self._response(json.loads(line[6:]))
        elif self.kind == "json":
            if self.size > MAX_JSON_BYTES:
                self.kind, self.body = "", []
                return
            self.body.append(chunk)
            if self.complete:
                self._response(json.loads(b"".join(self.body)))

    def _response(self, body) -> None:
        """A response (or one streamed chunk of it): its id, usage and finish reasons."""
        if not isinstance(body, dict):
            return
        if isinstance(body.get("id"), str):
            self.request_id = body["id"]
        if isinstance(body.get("usage"), dict):
            self.usage = body["usage"]
        for i, choice in enumerate(body.get("choices") or ()):
            if isinstance(choice, dict) and choice.get("finish_reason"):
                index = choice.get("index")
                self.finish[index if isinstance(index, int) else i] = str(choice["finish_reason"])

    def line(self, failed: bool) -> str:
        """The log line (`failed`: the app raised)."""
        status = self.status if self.status is not None else 500 if failed else "-"
        finish = ",".join(self.finish[i] for i in sorted(self.finish)) or "-"
        text = (f"{self.method} {self.path} {status} request_id={self.request_id or '-'} "
                f"prompt_tokens={self.usage.get('prompt_tokens', '-')} "
                f"completion_tokens={self.usage.get('completion_tokens', '-')} finish_reason={finish} "
                f"latency_ms={(time.perf_counter() - self.start) * 1000:.1f}")
        return text if self.complete else text + " incomplete"


class RequestLog:
    """ASGI middleware: one line per HTTP request, when its response ends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = _Record(scope)

        async def noted_send(message) -> None:
            try:
                record.see(message)
            except Exception:  # a log line must never fail a request
                logger.debug("request log: %s", record.path, exc_info=True)
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, noted_send)
        except Exception:  # a bug: the server answers 500 further out (a cancel is no failure: no status)
            failed = True
            raise
        finally:
            try:
                level = logging.DEBUG if record.path in PROBES else logging.INFO
                logger.log(level, "%s", record.line(failed))
            except Exception:  # as above
                logger.debug("request log: no line for %s", record.path, exc_info=True)
