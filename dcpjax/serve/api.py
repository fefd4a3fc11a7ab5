"""The HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every bad request gets an OpenAI-style body {"error": {"message", "type", "param", "code"}}
with a 4xx status (`errors`); one request's error never touches the others: the engine
thread only ever sees requests that passed admission (`admission`). /openapi.json
documents every status each route can send (`openapi`).

`build_app` assembles the app from small builders: the error handling, the info routes,
and one builder per generation endpoint. What the route handlers share (the model, the
engine, request validation) is one `_Server`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import dcpjax
from dcpjax.sampling import SamplingParams
from dcpjax.serve import admission
from dcpjax.serve.chat import ChatTemplate
from dcpjax.serve.errors import APIError, add_error_handling, error_response
from dcpjax.serve.openapi import install_openapi, route_responses
from dcpjax.serve.protocol import ChatCompletionResponse, ChatRequest, CompletionRequest, CompletionResponse, ModelList

__all__ = ["APIError", "build_app", "error_response"]

DESCRIPTION = ("OpenAI-compatible text generation (vLLM's extra sampling fields) served by dcpjax. Errors are "
               '`{"error": {"message", "type", "param", "code"}}`; `message` says what to change.')


def build_app(llm, async_engine, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="dcpjax", version=dcpjax.__version__, description=DESCRIPTION, docs_url=None,
                  redoc_url=None)
    server = _Server(llm, async_engine, metrics, served_model_name, ChatTemplate(llm.tokenizer), int(time.time()))
    add_error_handling(app, api_key, max_body_bytes)
    responses = functools.partial(route_responses, api_key=api_key is not None)
    _add_info_routes(app, server, responses)
    _add_completions_route(app, server, responses)
    _add_chat_route(app, server, responses)
    install_openapi(app, model=served_model_name, max_model_len=llm.max_model_len,
                    vocab_size=llm.model_config.vocab_size, api_key=api_key is not None)
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
                           "invalid_request_error", "model_not_found", param="model")

    def sampling(self, body, max_tokens, logprobs, max_tokens_param: str = "max_tokens") -> SamplingParams:
        admission.check_max_tokens(max_tokens, self.llm.max_model_len, max_tokens_param)
        top_k = body.top_k or 0
        values = dict(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k >= self.llm.model_config.vocab_size else top_k,  # the whole vocabulary: no filter
            min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def sequence(self, ids: list[int], text: str | None, params: SamplingParams, param: str = "prompt"):
        """The engine sequence for a prompt, once it passed admission (else a 400 naming the fix)."""
        llm = self.llm
        admission.check_token_ids(ids, llm.model_config.vocab_size)
        admission.check_prompt_length(len(ids), llm.max_model_len, param)
        try:
            seq = llm.make_sequence({"prompt_token_ids": ids, "prompt": text}, params, 0,
                                    request_id=f"cmpl-{uuid.uuid4().hex}")
        except ValueError as err:
            raise APIError(400, str(err), param=param) from err
        scheduler = llm.engine.scheduler
        admission.check_kv_capacity(len(ids), seq.max_total, kv_cache_size_tokens=llm.kv_cache_size_tokens,
                                    block_size=scheduler.block_size, dcp=scheduler.dcp)
        return seq

    def encode(self, text: str, **kwargs) -> list[int]:
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return self.llm.tokenizer.encode(text, **kwargs)

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
            "total_tokens": seq.length, "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens or 0}}


def _sse(chunks, body, seq, head: dict) -> StreamingResponse:
    """The chunks as server-sent events; with `stream_options.include_usage`, a last chunk
    holding the usage and no choices (OpenAI's form), then `[DONE]`."""
    async def events():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        if body.stream_options is not None and body.stream_options.include_usage:
            yield f"data: {json.dumps({**head, 'created': int(time.time()), 'choices': [], 'usage': _usage(seq)})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


# -- route builders -------------------------------------------------------------------------------
def _add_info_routes(app: FastAPI, server: _Server, responses) -> None:
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
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=responses("/v1/models"))
    async def models():
        """The one served model, with its max_model_len and KV cache size."""
        llm = server.llm
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": server.created,
                                             "owned_by": "dcpjax", "max_model_len": llm.max_model_len,
                                             "kv_cache_size_tokens": llm.kv_cache_size_tokens}]}


def _completion_prompt(server: _Server, body: CompletionRequest) -> tuple[list[int], str | None]:
    """The one prompt of a /v1/completions body as (token ids, text or None)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, f"send one prompt per request (got a list of {len(prompt)})", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return list(prompt), None
    return server.encode(prompt), prompt


def _add_completions_route(app: FastAPI, server: _Server, responses) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=responses("/v1/completions"))
    async def completions(body: CompletionRequest):
        """Complete a prompt (text or token ids); `stream: true` answers with server-sent events."""
        server.check_model(body.model)
        ids, text = _completion_prompt(server, body)
        params = server.sampling(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        seq = server.sequence(ids, text, params)
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
            return _sse(chunks(), body, seq, {"id": request_id, "object": "text_completion", "model": model})
        done = await server.collect(seq)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [choice(done.text or "", done.finish_reason, done, done.logprobs, done.output_ids)],
                "usage": _usage(done)}


def _chat_prompt(server: _Server, body: ChatRequest) -> tuple[list[int], str]:
    """The chat template applied to the messages (text parts of multi-part contents): (token ids, text)."""
    if server.llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot serve chat: use /v1/completions with token ids")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            part.text or "" for part in m.content if part.type == "text")
        messages.append({"role": m.role, "content": content or ""})
    try:
        prompt_text = server.chat_template.render(messages)
    except Exception as err:  # a template that rejects these messages
        raise APIError(400, f"chat template failed: {err}", param="messages") from err
    return server.encode(prompt_text, add_special_tokens=False), prompt_text


def _add_chat_route(app: FastAPI, server: _Server, responses) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=responses("/v1/chat/completions"))
    async def chat(body: ChatRequest):
        """Answer a conversation (the model's chat template); `stream: true` answers with server-sent events."""
        server.check_model(body.model)
        ids, text = _chat_prompt(server, body)
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = server.sampling(body, getattr(body, limit), (body.top_logprobs or 0) if body.logprobs else None,
                                 limit)
        seq = server.sequence(ids, text, params, param="messages")
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
            return _sse(chunks(), body, seq, {"id": request_id, "object": "chat.completion.chunk", "model": model})
        done = await server.collect(seq)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text or ""},
                             "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}],
                "usage": _usage(done)}
