"""/v1/chat/completions: the model's chat template, then the engine; logprobs and n choices.

`logprobs: true` (+ `top_logprobs`) returns `choices[].logprobs.content` as OpenAI does, in
streamed deltas too; `n` choices are drawn independently; `prompt_logprobs` (vLLM's field)
comes at the top level as vLLM returns it; `tools` and `tool_choice` as `tools.calls` explains.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from dcpjax.engine.requests import best_of
from dcpjax.serve.context import ServerContext, prompt_key, sse, usage
from dcpjax.serve.errors import APIError
from dcpjax.serve.protocol import ChatCompletionResponse, ChatRequest
from dcpjax.serve.routes import logprob_format
from dcpjax.serve.tools.calls import StreamedToolCalls, parsed_message, tool_definitions
from dcpjax.text.chat_template import text_content


def message_dicts(body) -> list[dict]:
    """The request's messages as template input: text parts of multi-part contents joined,
    extra fields (tool_calls, tool_call_id, name) passed through."""
    return [{**(m.model_extra or {}), "role": m.role, "content": text_content(m.content)} for m in body.messages]


def chat_prompt(server: ServerContext, body, tools: list[dict] | None = None,
                opening: str = "") -> tuple[list[int], str]:
    """The chat template applied to the messages, then `opening` (the start of the assistant's
    answer, when a tool call is required): (token ids, text)."""
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot serve chat: use /v1/completions with token ids")
    try:
        text = server.chat_template.render(
            message_dicts(body), tools=tools, add_generation_prompt=getattr(body, "add_generation_prompt", True),
            continue_final_message=getattr(body, "continue_final_message", False),
            chat_template_kwargs=getattr(body, "chat_template_kwargs", None))
    except Exception as err:  # a template that rejects these messages
        raise APIError(400, f"chat template failed: {err}", param="messages") from err
    return server.encode(text + opening, add_special_tokens=False), text + opening


def _logprobs(server: ServerContext, body: ChatRequest, tokens, entries):
    if not body.logprobs:
        return None
    return logprob_format.chat_logprobs(server.piece, tokens, entries, body.top_logprobs or 0)


def add_chat_route(app: FastAPI, server: ServerContext, responses) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=responses("/v1/chat/completions"))
    async def chat(body: ChatRequest):
        """Answer a conversation (the model's chat template); `stream: true` answers with server-sent events."""
        with server.releasing_refused_handle(body):  # a refused decode request frees its KV at once
            server.check_model(body.model)
            parser, opening = server.tools.parser_for(body)
            ids, text = chat_prompt(server, body, tool_definitions(body), opening)
            limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            server.check_context(len(ids), getattr(body, limit), limit, body.kv_transfer_params)
            params = server.sampling(body, getattr(body, limit), (body.top_logprobs or 0) if body.logprobs else None,
                                     limit)
            seqs = server.sequences(ids, text, params, param="messages")
        head = {"id": prompt_key(seqs[0]).replace("cmpl-", "chatcmpl-"), "model": server.model}
        if body.stream:
            async def chunks():
                started = [False] * len(seqs)
                calls = [StreamedToolCalls(parser, opening) for _ in seqs]
                async for i, u in server.stream_all(seqs):
                    deltas = calls[i].deltas(u.text_delta, u.finish_reason is not None) or [{}]
                    for n, delta in enumerate(deltas):
                        last = n == len(deltas) - 1
                        choice = {"index": i, "delta": delta | ({} if started[i] else {"role": "assistant"}),
                                  "finish_reason": calls[i].finish_reason(u.finish_reason) if last else None,
                                  "logprobs": _logprobs(server, body, u.token_ids, u.logprobs) if n == 0 else None}
                        started[i] = True
                        yield {**head, "object": "chat.completion.chunk", "created": int(time.time()),
                               "choices": [choice]}
            return sse(chunks(), body, seqs, {**head, "object": "chat.completion.chunk"})
        await server.collect_all(seqs)
        choices = []
        for i, seq in enumerate(best_of(seqs, body.n)):
            message, finish_reason = parsed_message(parser, opening + (seq.text or ""), seq.finish_reason)
            choices.append({"index": i, "message": message, "finish_reason": finish_reason,
                            "stop_reason": seq.stop_reason,
                            "logprobs": _logprobs(server, body, seq.output_ids, seq.logprobs)})
        response = {**head, "object": "chat.completion", "created": int(time.time()), "choices": choices,
                    "usage": usage(seqs), "kv_transfer_params": seqs[0].kv_transfer_params}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = logprob_format.prompt_logprobs(seqs[0].prompt_logprobs, body.prompt_logprobs)
        return response
