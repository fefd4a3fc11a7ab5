"""Request results, shaped like vLLM's (`RequestOutput.outputs[0].text`, ...)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int | None = None  # prompt tokens taken from the prefix cache (None: not scheduled yet)
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token_id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a prefill server's handle for the decode server (vLLM's field; `dcpjax.kv_transfer`), else None
    kv_transfer_params: dict | None = None
