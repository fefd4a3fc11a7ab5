"""Admission: what a request must satisfy before it reaches the engine, as 400s that say how to fix it.

The engine never sees a request it cannot finish: prompt token ids in the vocabulary,
a prompt shorter than max_model_len, max_tokens within max_model_len, and prompt +
output within the whole KV cache (a request needing more blocks than exist would wait
forever, or fail the engine's step for everyone).
"""

from __future__ import annotations

from dcpjax.serve.errors import APIError
from dcpjax.sharding.layout import blocks_needed


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A prompt given as token ids: every id in [0, vocab_size)."""
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise APIError(400, f"prompt token id {token} (position {position}) is outside this model's vocabulary "
                                f"[0, {vocab_size}); send ids the model's tokenizer produces", param="prompt",
                           code="invalid_token_id")


def check_prompt_length(num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """The prompt leaves room for at least one generated token."""
    if num_tokens == 0:
        raise APIError(400, "the prompt is empty: send at least one token", param=param)
    if num_tokens >= max_model_len:
        raise APIError(400, f"the prompt is {num_tokens} tokens; this server's max_model_len={max_model_len} (prompt + "
                            f"output) leaves no room to generate: shorten it to at most {max_model_len - 1} tokens",
                       param=param, code="context_length_exceeded")


def check_max_tokens(max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """max_tokens within max_model_len (a prompt + max_tokens beyond it stops at max_model_len, finish 'length')."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise APIError(400, f"{param}={max_tokens} is larger than this server's max_model_len={max_model_len} "
                            "(prompt + output tokens): ask for at most max_model_len minus the prompt's length", param=param,
                       code="context_length_exceeded")


def check_kv_capacity(num_prompt_tokens: int, max_total: int, *, kv_cache_size_tokens: int, block_size: int,
                      dcp: int) -> None:
    """prompt + output (`max_total` tokens) fits in the whole KV cache, in whole blocks."""
    needed = blocks_needed(max_total, block_size, dcp) * block_size * dcp
    if needed > kv_cache_size_tokens:
        raise APIError(400, f"this request needs KV cache for {max_total} tokens ({num_prompt_tokens} of prompt + up to "
                            f"{max_total - num_prompt_tokens} generated; {needed} in whole blocks), more than the whole "
                            f"KV cache holds ({kv_cache_size_tokens} tokens): shorten the prompt or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
