"""The OpenAPI document (/openapi.json) as the server really behaves.

Each route lists every status it can send (`route_responses`), with its content type:
JSON bodies (`protocol`'s models, errors as `ErrorResponse`), text/plain for /health
and /metrics, text/event-stream for streamed completions (each event's `data` a JSON
chunk, the last one `[DONE]`). `install_openapi` then makes the generated document
exact: no 422 (validation errors are 400s), the served model's name, max_model_len and
the vocabulary as bounds, request examples, and the bearer scheme when the server has an API key.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dcpjax.serve.protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse

ERRORS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of its bounds, n != 1, a prompt of "
         "max_model_len tokens or more, max_tokens over max_model_len, prompt token ids outside the vocabulary, or "
         "prompt + output larger than the whole KV cache. `error.message` says what to change.",
    401: "Missing or wrong `Authorization: Bearer <key>` (the server runs with --api-key).",
    404: "`model` is not the model this server serves (see GET /v1/models).",
    413: "The request body is larger than the server's --max-request-bytes.",
    500: "Internal error (a bug): the request was not served.",
    503: "The server is shutting down, or its engine failed: it admits no request; retry elsewhere after "
         "`Retry-After` seconds.",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
STREAMED = {"/v1/completions": CompletionChunk, "/v1/chat/completions": ChatCompletionChunk}
ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorResponse"}
SECURITY_SCHEME = "bearerAuth"


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI `responses=` for these error statuses, each with the OpenAI-style JSON error body."""
    docs = {}
    for status in statuses:  # content spelled out: a text/plain route's errors are JSON too
        docs[status] = {"description": ERRORS[status], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        if status == 503:
            docs[status]["headers"] = RETRY_AFTER
    return docs


def route_responses(path: str, *, api_key: bool) -> dict[int | str, dict]:
    """Every status `path` can answer besides 200 (413: the body-size guard sees every request;
    503: the availability guard (`process.shutdown`) answers everything but /metrics while draining or after an
    engine failure)."""
    statuses = [413] if path == "/metrics" else [413, 503]
    if path.startswith("/v1/"):
        statuses += [401] if api_key else []
    if path in STREAMED:
        statuses += [400, 404, 500]
    elif path in ("/tokenize", "/detokenize"):
        statuses += [400, 404]
    return error_responses(*sorted(statuses))


def _sse_content(chunk_model) -> dict:
    """text/event-stream whose events' `data` is a JSON `chunk_model`, or `[DONE]` to end."""
    data = {"anyOf": [{"type": "string", "const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"$ref": f"#/components/schemas/{chunk_model.__name__}"}}]}
    # `itemSchema` (one event, as FastAPI writes streams): a `schema` next to it would describe the whole stream
    return {"itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


def _bound(node, **bounds) -> None:
    """Set `bounds` on every integer schema under `node` (the branches of an anyOf, array items)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(bounds)
        for value in node.values():
            _bound(value, **bounds)
    elif isinstance(node, list):
        for value in node:
            _bound(value, **bounds)


def _patch_requests(schemas: dict, model: str, max_model_len: int, vocab_size: int) -> None:
    for name in ("CompletionRequest", "ChatRequest"):
        props = schemas[name]["properties"]
        props["model"]["enum"] = [model]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _bound(props[field], maximum=max_model_len)
    _bound(schemas["CompletionRequest"]["properties"]["prompt"], maximum=vocab_size - 1)
    _bound(schemas["DetokenizeRequest"]["properties"]["tokens"], maximum=vocab_size - 1)
    schemas["CompletionRequest"]["examples"] = [{"model": model, "prompt": "The capital of France is",
                                                 "max_tokens": 8, "temperature": 0}]
    schemas["ChatRequest"]["examples"] = [{"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                                           "max_tokens": 8, "stream": True}]


def _patch(doc: dict, *, model: str, max_model_len: int, vocab_size: int, api_key: bool) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422: this server answers 400
        schemas.pop(name, None)
    for extra in (ErrorResponse, *STREAMED.values()):  # models no route names as its response_model
        spec = extra.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        schemas.update(spec.pop("$defs", {}))
        schemas[extra.__name__] = spec
    _patch_requests(schemas, model, max_model_len, vocab_size)
    if api_key:
        doc["components"]["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for operation in item.values():
            operation["responses"].pop("422", None)
            if path in STREAMED:
                ok = operation["responses"]["200"]
                ok["content"]["text/event-stream"] = _sse_content(STREAMED[path])
                ok["description"] = ("the completion: JSON, or with `stream: true` server-sent events (one chunk "
                                     "each, then `data: [DONE]`)")
            if api_key and path.startswith("/v1/"):
                operation["security"] = [{SECURITY_SCHEME: []}]


def install_openapi(app: FastAPI, *, model: str, max_model_len: int, vocab_size: int, api_key: bool) -> None:
    """Serve the patched document at /openapi.json (built once, on first use)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _patch(doc, model=model, max_model_len=max_model_len, vocab_size=vocab_size, api_key=api_key)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
