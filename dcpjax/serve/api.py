"""The HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every bad request gets an OpenAI-style body {"error": {"message", "type", "code"}} with
a 4xx status; one request's error never touches the others (the engine thread only
ever sees requests that passed validation).

`build_app` assembles the app from small builders: the request guards and error
handlers, the info routes, and one builder per generation endpoint. What the route
handlers share (the model, the engine, request validation) is one `_Server`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dcpjax.sampling import SamplingParams
from dcpjax.serve.chat import ChatTemplate
from dcpjax.serve.protocol import ChatRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        self.status, self.message, self.kind, self.code = status, message, kind, code or kind


def error_response(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code or kind}}, status_code=status)


def build_app(llm, async_engine, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="dcpjax", docs_url=None, redoc_url=None)
    server = _Server(llm, async_engine, metrics, served_model_name, ChatTemplate(llm.tokenizer), int(time.time()))
    _add_guards(app, api_key, max_body_bytes)
    _add_info_routes(app, server)
    _add_completions_route(app, server)
    _add_chat_route(app, server)
    return app


# -- what the handlers share ----------------------------------------------------------------------
@dataclasses.dataclass
class _Server:
    llm: object
    async_engine: object
    metrics: object
    model: str  # the served model name
    chat_template: ChatTemplate
    created: int

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model!r}",
                           "invalid_request_error", "model_not_found")

    def sampling(self, body, max_tokens, logprobs) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, "n must be 1 (one completion per request)")
        values = dict(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        if max_tokens is not None and max_tokens > self.llm.max_model_len:
            raise APIError(400, f"max_tokens={max_tokens} is larger than max_model_len={self.llm.max_model_len}")
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def sequence(self, prompt, params):
        try:
            return self.llm.make_sequence(prompt, params, 0, request_id=f"cmpl-{uuid.uuid4().hex}")
        except ValueError as err:
            raise APIError(400, str(err)) from err

    async def collect(self, seq):
        async for update in self.async_engine.generate(seq):
            if update.finish_reason is not None:
                return update.seq
        return seq

    def completion_logprobs(self, seq, entries, tokens):
        if seq.params.logprobs is None:
            return None
        tokenizer = self.llm.tokenizer
        text = lambda t: tokenizer.token_text(t) if tokenizer else str(t)
        return {
            "tokens": [text(t) for t in tokens],
            "token_logprobs": [e[t].logprob for e, t in zip(entries, tokens)],
            "top_logprobs": [{text(k): v.logprob for k, v in e.items()} for e in entries],
        }


def _usage(seq) -> dict:
    return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens,
            "total_tokens": seq.length}


def _sse(chunks) -> StreamingResponse:
    async def body():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


# -- route builders -------------------------------------------------------------------------------
def _add_guards(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """The API key and body-size checks, and OpenAI-style bodies for every error."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if (api_key is not None and request.url.path.startswith("/v1/")
                and request.headers.get("authorization", "") != f"Bearer {api_key}"):
            return error_response(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return error_response(413, f"request body over {max_body_bytes} bytes", "invalid_request_error",
                                  "request_too_large")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return error_response(err.status, err.message, err.kind, err.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in err.errors())
        return error_response(400, f"invalid request: {problems}", "invalid_request_error", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), "invalid_request_error", "not_found"
                              if err.status_code == 404 else None)


def _add_info_routes(app: FastAPI, server: _Server) -> None:
    """/health, /metrics (Prometheus) and /v1/models."""

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        llm = server.llm
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": server.created,
                                             "owned_by": "dcpjax", "max_model_len": llm.max_model_len,
                                             "kv_cache_size_tokens": llm.kv_cache_size_tokens}]}


def _completion_prompt(body: CompletionRequest):
    """The one prompt of a /v1/completions body: text, or {"prompt_token_ids": [...]}."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "send one prompt per request (a list of prompts is not supported)")
        prompt = prompt[0]
    return {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt


def _add_completions_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        server.check_model(body.model)
        prompt = _completion_prompt(body)
        params = server.sampling(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        seq = server.sequence(prompt, params)
        request_id, model = seq.request_id, server.model

        def choice(text, finish_reason, seq, entries, tokens):
            return {"index": 0, "text": text, "finish_reason": finish_reason,
                    "stop_reason": seq.stop_reason if finish_reason else None,
                    "logprobs": server.completion_logprobs(seq, entries, tokens)}

        if body.stream:
            async def chunks():
                async for u in server.async_engine.generate(seq):
                    yield {"id": request_id, "object": "text_completion", "created": int(time.time()),
                           "model": model, "choices": [choice(u.text_delta, u.finish_reason, u.seq, u.logprobs,
                                                              u.token_ids)]}
            return _sse(chunks())
        done = await server.collect(seq)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [choice(done.text or "", done.finish_reason, done, done.logprobs, done.output_ids)],
                "usage": _usage(done)}


def _chat_prompt(server: _Server, body: ChatRequest) -> dict:
    """The chat template applied to the messages (text parts of multi-part contents), as token ids."""
    tokenizer = server.llm.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot serve chat")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            part.get("text", "") for part in m.content if part.get("type") == "text")
        messages.append({"role": m.role, "content": content or ""})
    try:
        prompt_text = server.chat_template.render(messages)
    except Exception as err:  # a template that rejects these messages
        raise APIError(400, f"chat template failed: {err}") from err
    return {"prompt_token_ids": tokenizer.encode(prompt_text, add_special_tokens=False), "prompt": prompt_text}


def _add_chat_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        server.check_model(body.model)
        prompt = _chat_prompt(server, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = server.sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        seq = server.sequence(prompt, params)
        request_id, model = seq.request_id.replace("cmpl-", "chatcmpl-"), server.model
        if body.stream:
            async def chunks():
                first = True
                async for u in server.async_engine.generate(seq):
                    delta = {"role": "assistant", "content": u.text_delta} if first else {"content": u.text_delta}
                    first = False
                    yield {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": [{"index": 0, "delta": delta,
                                                        "finish_reason": u.finish_reason}]}
            return _sse(chunks())
        done = await server.collect(seq)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text or ""},
                             "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}],
                "usage": _usage(done)}
