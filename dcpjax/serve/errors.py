"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} for every failure.

`add_error_handling` installs the request guard (API key, body size) and the exception
handlers, so whatever goes wrong (a bad body, an unknown path, a bug) the client gets
that JSON body with the right status, never a bare text page.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID = "invalid_request_error"
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """A request the server refuses: `status` (4xx), what is wrong and how to fix it (`message`)."""

    def __init__(self, status: int, message: str, kind: str = INVALID, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code or kind, param


def error_response(status: int, message: str, kind: str = INVALID, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}
    return JSONResponse(body, status_code=status, headers=headers)


class RequestGuard:
    """ASGI middleware: 401 without the API key on /v1/*, 413 for a body over `max_body_bytes`
    (by its Content-Length up front, or counted as it arrives when it is sent chunked)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.too_large = f"request body over {max_body_bytes} bytes (the server's --max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
            response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      "authentication_error", "invalid_api_key")
            return await response(scope, receive, send)
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body_bytes:
            return await error_response(413, self.too_large, code=_CODES[413])(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # FastAPI re-raises it as it reads the body
                    raise HTTPException(413, self.too_large)
            return message

        await self.app(scope, counted_receive, send)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """('invalid request: field: problem; ...', the first field at fault) for a body that fails its model."""
    problems, params = [], []
    for e in err.errors()[:5]:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}", None
        if len(e["loc"]) < 2:  # no body, or not an object (a form, a list, ...)
            return f"the body must be a JSON object (Content-Type: application/json): {e['msg']}", None
        params.append(str(e["loc"][1]))  # the top-level field; the message has the whole path
        problems.append(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}")
    return f"invalid request: {'; '.join(problems)}", params[0] if params else None


def add_error_handling(app: FastAPI, api_key: str | None, max_body_bytes: int,
                       on_invalid_body: Callable[[object], None] | None = None) -> None:
    """The request guard, and an OpenAI-style body for every error the app can raise.
    on_invalid_body(body): told of each body its model refused (the JSON as read), before the 400."""
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return error_response(err.status, err.message, err.kind, err.code, err.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, err: RequestValidationError):
        message, param = _validation_message(err)
        if on_invalid_body is not None:
            on_invalid_body(err.body)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), code=_CODES.get(err.status_code),
                              headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, err: Exception):  # a bug: still JSON (uvicorn logs the traceback)
        logger.error("%s %s failed: %r", request.method, request.url.path, err)
        return error_response(500, f"internal server error: {type(err).__name__}: {err}", "internal_server_error",
                              "internal_server_error")
