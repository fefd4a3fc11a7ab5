"""The OpenAI API's bodies (with vLLM's extra sampling fields): requests, responses, errors.

Request fields carry the bounds the server enforces (a value outside them is a 400
naming the field), so the OpenAPI document generated from these models is the contract.
Bounds that depend on the loaded model (max_model_len, the vocabulary) are checked by
the API layer and added to the document by `dcpjax.serve.responses.openapi_schema`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dcpjax.sampling import MAX_LOGPROBS

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
FinishReason = Literal["stop", "length", "abort"]


# -- requests ---------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="end the stream with a chunk holding `usage` and no choices")


class SamplingFields(BaseModel):
    # clients send fields we do not use (user, ...); NaN and infinities are no sampling values
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(description="the served model's name (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most, <= max_model_len (default: "
                                   "16 for completions, up to max_model_len for chat); generation also stops at "
                                   "max_model_len tokens in all")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="completions per request: only 1 is supported")
    stream: bool = Field(False, description="answer with server-sent events (text/event-stream)")
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    seed: int | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables it")
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="text or token ids; a list of prompts must hold exactly one")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="accepted for compatibility; the prompt is not echoed")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = Field("", description="text, or parts whose 'text' ones are used")


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = Field(False, description="accepted; chat responses carry no logprobs yet")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# -- responses --------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong and how to fix it")
    type: str = Field(description="e.g. invalid_request_error, authentication_error")
    param: str | None = Field(None, description="the request field at fault, if one is")
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = Field(description="null until the last chunk of a stream")
    stop_reason: int | str | None = Field(None, description="the stop token id or string that ended it")
    logprobs: CompletionLogprobs | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`data: {...}`); `data: [DONE]` ends the stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="in the last chunk (no choices) with "
                                "stream_options.include_usage")


class CompletionResponse(CompletionChunk):
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="in the first chunk only")
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; `data: [DONE]` ends the stream."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="in the last chunk (no choices) with "
                                "stream_options.include_usage")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int = Field(description="longest prompt + output, in tokens")
    kv_cache_size_tokens: int = Field(description="tokens the whole KV cache holds")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
