"""The OpenAI API's bodies (with vLLM's extra sampling fields): requests, responses, errors.

Request fields carry the bounds the server enforces (a value outside them is a 400
naming the field), so the OpenAPI document generated from these models is the contract.
Bounds that depend on the loaded model (max_model_len, the vocabulary) are checked by
the API layer and added to the document by `dcpjax.serve.routes.openapi.install_openapi`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dcpjax.kv_transfer.params import KVTransferParams

MAX_N = 16  # choices per request

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


# -- requests ---------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="end the stream with a chunk holding `usage` and no choices")


class SamplingFields(BaseModel):
    # A field this server does not know is a 400 naming it (never silently ignored), except the
    # OpenAI fields that do not change the output (`ACCEPTED_EXTRA_FIELDS`); NaN and infinities
    # are no sampling values.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(description="the served model's name (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most, <= max_model_len (default: "
                                   "16 for completions, up to max_model_len for chat); generation also stops at "
                                   "max_model_len tokens in all")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1 (or the model's "
                                      "generation_config.json)")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt, each drawn on its own (with a seed: "
                   "choice i uses seed + i); the prompt's KV is shared through the prefix cache")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="draw this many (>= n) and return the n with the "
                                "highest cumulative logprob; not with stream")
    stream: bool = Field(False, description="answer with server-sent events (text/event-stream)")
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted from the logit of every token "
                                           "generated before (once)")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted from a token's logit once per "
                                            "time it was generated")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit")
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables it")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, description="a logit of a token in the prompt or generated "
                                             "before is divided by it if positive, multiplied if negative (1: off)")
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids cannot end the output before this many "
                            "tokens")
    bad_words: list[StopString] | None = Field(None, description="words never generated")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="only these tokens are sampled")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, description="top logprobs per prompt token (vLLM's field; "
                                        "returned as prompt_logprobs, null for the first); at most --max-logprobs")
    kv_transfer_params: KVTransferParams | None = Field(
        None, description="prefill/decode disaggregation (vLLM's field): {\"do_remote_decode\": true} on a prefill "
        "server (kv_producer), which answers with the handle to send a decode server (kv_consumer)")


# OpenAI fields accepted although they do not change what is generated, with the values that are
# honoured by doing nothing (None: any value). Any other unknown field is a 400.
ACCEPTED_EXTRA_FIELDS: dict[str, tuple | None] = {
    "user": None, "metadata": None, "store": (None, False), "service_tier": None,
    "parallel_tool_calls": (None, True), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "suffix": (None, ""), "use_beam_search": (None, False), "skip_special_tokens": (None, True),
}


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="text or token ids, or a list of prompts (choices then go prompt by prompt: index = prompt * n "
        "+ choice)")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most (default 16); 0 only with "
                                   "echo (the prompt and, with logprobs, its logprobs alone)")
    logprobs: int | None = Field(None, ge=0, description="top logprobs per token; at most --max-logprobs")
    echo: bool = Field(False, description="the prompt comes first in the text (and, with logprobs, its tokens and "
                       "logprobs, the first token's null)")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = Field("", description="text, or parts whose 'text' ones are used")


class ChatTemplateFields(BaseModel):
    """How the chat template renders the messages (vLLM's fields)."""

    add_generation_prompt: bool = Field(True, description="end with the assistant's turn header")
    continue_final_message: bool = Field(False, description="leave the last message open for the model to continue "
                                         "(needs add_generation_prompt false)")
    chat_template_kwargs: dict | None = Field(None, description="extra template variables, e.g. enable_thinking")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON schema of the arguments")


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = Field(None, description="functions the model may call (rendered by the template)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without; auto needs --enable-auto-tool-choice; required "
        "and a named function need --tool-call-parser and open the call for the model (no constrained decoding)")
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = Field(False, description="return each generated token's logprob (choices[].logprobs.content)")
    top_logprobs: int | None = Field(None, ge=0, description="with logprobs: the most likely "
                                     "tokens at each position")


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
    token_logprobs: list[float | None] = Field(description="null for the first prompt token (echo)")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="where each token starts in the choice's text")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = Field(description="null until the last chunk of a stream")
    stop_reason: int | str | None = Field(None, description="the stop token id or string that ended it")
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="with prompt_logprobs, per prompt token (keyed by token id): null for the first")


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
    kv_transfer_params: dict | None = Field(None, description="a prefill server's handle for the decode server")


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="with prompt_logprobs, per prompt token (keyed by token id): null for the first")
    kv_transfer_params: dict | None = Field(None, description="a prefill server's handle for the decode server")


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(None, description="in a call's first delta")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="in the first chunk only")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; `data: [DONE]` ends the stream."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="in the last chunk (no choices) with "
                                "stream_options.include_usage")


class TokenizePromptRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model's name (optional)")
    prompt: str = Field(description="text to tokenize")
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS)")
    return_token_strs: bool = Field(False, description="also return each token's text")


class TokenizeChatRequest(ChatTemplateFields):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model's name (optional)")
    messages: list[ChatMessage] = Field(min_length=1, description="a conversation, rendered by the chat template")
    tools: list[ChatTool] | None = Field(None, description="tools, rendered by the chat template")
    return_token_strs: bool = Field(False, description="also return each token's text")


TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest  # vLLM's two forms


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


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
