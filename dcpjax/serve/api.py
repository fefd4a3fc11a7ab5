"""The HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every bad request gets an OpenAI-style body {"error": {"message", "type", "code"}} with
a 4xx status; one request's error never touches the others (the engine thread only
ever sees requests that passed validation).
"""

from __future__ import annotations

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
    chat_template = ChatTemplate(llm.tokenizer)
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
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

    # -- helpers --------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}",
                           "invalid_request_error", "model_not_found")

    def sampling(body, max_tokens, logprobs) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, "n must be 1 (one completion per request)")
        values = dict(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        if max_tokens is not None and max_tokens > llm.max_model_len:
            raise APIError(400, f"max_tokens={max_tokens} is larger than max_model_len={llm.max_model_len}")
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def sequence(prompt, params):
        try:
            return llm.make_sequence(prompt, params, 0, request_id=f"cmpl-{uuid.uuid4().hex}")
        except ValueError as err:
            raise APIError(400, str(err)) from err

    async def collect(seq):
        async for update in async_engine.generate(seq):
            if update.finish_reason is not None:
                return update.seq
        return seq

    def usage(seq) -> dict:
        return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens,
                "total_tokens": seq.length}

    def sse(chunks):
        async def body():
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    def completion_logprobs(seq, entries, tokens):
        if seq.params.logprobs is None:
            return None
        text = lambda t: llm.tokenizer.token_text(t) if llm.tokenizer else str(t)
        return {
            "tokens": [text(t) for t in tokens],
            "token_logprobs": [e[t].logprob for e, t in zip(entries, tokens)],
            "top_logprobs": [{text(k): v.logprob for k, v in e.items()} for e in entries],
        }

    # -- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                             "owned_by": "dcpjax", "max_model_len": llm.max_model_len,
                                             "kv_cache_size_tokens": llm.kv_cache_size_tokens}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request (a list of prompts is not supported)")
            prompt = prompt[0]
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        params = sampling(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        seq = sequence(prompt, params)
        request_id, model = seq.request_id, served_model_name

        def choice(text, finish_reason, seq, entries, tokens):
            return {"index": 0, "text": text, "finish_reason": finish_reason,
                    "stop_reason": seq.stop_reason if finish_reason else None,
                    "logprobs": completion_logprobs(seq, entries, tokens)}

        if body.stream:
            async def chunks():
                async for u in async_engine.generate(seq):
                    yield {"id": request_id, "object": "text_completion", "created": int(time.time()),
                           "model": model, "choices": [choice(u.text_delta, u.finish_reason, u.seq, u.logprobs,
                                                              u.token_ids)]}
            return sse(chunks())
        done = await collect(seq)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [choice(done.text or "", done.finish_reason, done, done.logprobs, done.output_ids)],
                "usage": usage(done)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot serve chat")
        messages = []
        for m in body.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else "".join(
                part.get("text", "") for part in m.content if part.get("type") == "text")
            messages.append({"role": m.role, "content": content or ""})
        try:
            prompt_text = chat_template.render(messages)
        except Exception as err:  # a template that rejects these messages
            raise APIError(400, f"chat template failed: {err}") from err
        prompt = {"prompt_token_ids": llm.tokenizer.encode(prompt_text, add_special_tokens=False),
                  "prompt": prompt_text}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        seq = sequence(prompt, params)
        request_id, model = seq.request_id.replace("cmpl-", "chatcmpl-"), served_model_name
        if body.stream:
            async def chunks():
                first = True
                async for u in async_engine.generate(seq):
                    delta = {"role": "assistant", "content": u.text_delta} if first else {"content": u.text_delta}
                    first = False
                    yield {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": [{"index": 0, "delta": delta,
                                                        "finish_reason": u.finish_reason}]}
            return sse(chunks())
        done = await collect(seq)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text or ""},
                             "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}],
                "usage": usage(done)}

    return app
