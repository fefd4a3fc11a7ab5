"""The HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/v1/models, /health, /metrics.

Every bad request gets an OpenAI-style body {"error": {"message", "type", "param", "code"}}
with a 4xx status (`errors`); one request's error never touches the others: the engine
thread only ever sees requests that passed the LLM's own request checks
(`engine.requests.RequestError`, each a 400 naming its field). /openapi.json
documents every status each route can send (`routes.openapi`).

`build_app` assembles the app from small builders: the error handling, the info routes,
and one module per endpoint family (`routes.completions`, `routes.chat_completions`,
`routes.tokenization`). What the route handlers share (the model, the engine, request
validation) is one `context.ServerContext`.
"""

from __future__ import annotations

import functools
import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

import dcpjax
from dcpjax.serve.context import ServerContext
from dcpjax.serve.errors import APIError, add_error_handling, error_response
from dcpjax.serve.protocol import ModelList
from dcpjax.serve.request_log import RequestLog
from dcpjax.serve.routes.chat_completions import add_chat_route
from dcpjax.serve.routes.completions import add_completions_route
from dcpjax.serve.routes.openapi import install_openapi, route_responses
from dcpjax.serve.routes.tokenization import add_tokenize_routes
from dcpjax.serve.tools.calls import ToolConfig
from dcpjax.text.chat_template import ChatTemplate

__all__ = ["APIError", "build_app", "error_response"]

DESCRIPTION = ("OpenAI-compatible text generation (vLLM's extra sampling fields) served by dcpjax. Errors are "
               '`{"error": {"message", "type", "param", "code"}}`; `message` says what to change.')


def build_app(llm, async_engine, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 << 20, chat_template: str | None = None,
              tools: ToolConfig | None = None, log_requests: bool = True) -> FastAPI:
    """The app; `log_requests`: one log line per finished request (`request_log`)."""
    app = FastAPI(title="dcpjax", version=dcpjax.__version__, description=DESCRIPTION, docs_url=None,
                  redoc_url=None)
    server = ServerContext(llm, async_engine, metrics, served_model_name, ChatTemplate(llm.tokenizer, chat_template),
                           int(time.time()), tools or ToolConfig())
    add_error_handling(app, api_key, max_body_bytes, on_invalid_body=server.release_invalid_handle)
    if log_requests:  # added after the request guard, so outside it: its 401s and 413s are logged too
        app.add_middleware(RequestLog)
    responses = functools.partial(route_responses, api_key=api_key is not None)
    _add_info_routes(app, server, responses)
    add_completions_route(app, server, responses)
    add_chat_route(app, server, responses)
    add_tokenize_routes(app, server, responses)
    install_openapi(app, model=served_model_name, max_model_len=llm.max_model_len,
                    vocab_size=llm.model_config.vocab_size, api_key=api_key is not None)
    return app


# -- route builders -------------------------------------------------------------------------------
def _add_info_routes(app: FastAPI, server: ServerContext, responses) -> None:
    """/health, /metrics (Prometheus) and /v1/models."""

    @app.get("/health", response_class=PlainTextResponse, responses=responses("/health"),
             response_description="the server is up: an empty body")
    async def health():
        """200 while the server admits requests."""
        return PlainTextResponse("")

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses("/metrics"),
             response_description="Prometheus text exposition format")
    async def prometheus():
        """vLLM's metrics under the `dcpjax:` prefix."""
        return PlainTextResponse(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=responses("/v1/models"))
    async def models():
        """The one served model, with its max_model_len and KV cache size."""
        llm = server.llm
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": server.created,
                                             "owned_by": "dcpjax", "max_model_len": llm.max_model_len,
                                             "kv_cache_size_tokens": llm.kv_cache_size_tokens}]}
