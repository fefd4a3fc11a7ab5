"""/tokenize and /detokenize as vLLM has them: a prompt or a conversation (rendered by the
chat template, the same as /v1/chat/completions renders it) to token ids, and back."""

from __future__ import annotations

from fastapi import FastAPI

from dcpjax.serve.context import ServerContext
from dcpjax.serve.errors import APIError
from dcpjax.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from dcpjax.serve.routes.chat_completions import chat_prompt
from dcpjax.serve.tools.calls import tool_definitions


def _tokenizer(server: ServerContext):
    if server.tokenizer is None:
        raise APIError(400, "this model folder has no tokenizer.json, so it cannot tokenize")
    return server.tokenizer


def add_tokenize_routes(app: FastAPI, server: ServerContext, responses) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=responses("/tokenize"))
    async def tokenize(body: TokenizeRequest):
        """Token ids of `prompt`, or of `messages` rendered by the chat template (+ `tools`)."""
        if body.model is not None:
            server.check_model(body.model)
        tokenizer = _tokenizer(server)
        if isinstance(body, TokenizeChatRequest):
            ids, _ = chat_prompt(server, body, tool_definitions(body))
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                "token_strs": [server.piece(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=responses("/detokenize"))
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids."""
        if body.model is not None:
            server.check_model(body.model)
        vocab = server.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": _tokenizer(server).decode(body.tokens)}
