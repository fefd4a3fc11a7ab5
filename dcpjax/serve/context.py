"""What the route handlers share: the model, the engine, request validation, and the
plumbing of several choices (`n`) per request.

A request with n > 1 becomes n engine sequences (each its own seed stream: with a seed,
choice i uses seed + i, as vLLM does); the prefix cache lets the later ones reuse the
first one's prompt KV in whole blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from dcpjax.chat_template import ChatTemplate
from dcpjax.sampling import SamplingParams
from dcpjax.serve import admission
from dcpjax.serve.errors import APIError
from dcpjax.serve.tool_calls import ToolConfig


@dataclasses.dataclass
class ServerContext:
    llm: object
    async_engine: object
    metrics: object
    model: str  # the served model name
    chat_template: ChatTemplate
    created: int
    tools: ToolConfig = dataclasses.field(default_factory=ToolConfig)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model!r}",
                           "invalid_request_error", "model_not_found", param="model")

    def sampling(self, body, max_tokens, logprobs, max_tokens_param: str = "max_tokens",
                 prompt_logprobs: int | None = None) -> SamplingParams:
        admission.check_max_tokens(max_tokens, self.llm.max_model_len, max_tokens_param)
        top_k = body.top_k or 0
        values = dict(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k >= self.llm.model_config.vocab_size else top_k,  # the whole vocabulary: no filter
            min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def sequences(self, ids: list[int], text: str | None, params: SamplingParams, n: int = 1,
                  param: str = "prompt") -> list:
        """The engine sequences of a prompt's n choices, once it passed admission (else a 400 naming the fix)."""
        llm = self.llm
        admission.check_token_ids(ids, llm.model_config.vocab_size)
        admission.check_prompt_length(len(ids), llm.max_model_len, param)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        seqs = []
        for i in range(n):
            choice = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            try:
                seqs.append(llm.make_sequence({"prompt_token_ids": ids, "prompt": text}, choice, 0,
                                              request_id=request_id if n == 1 else f"{request_id}-{i}"))
            except ValueError as err:
                raise APIError(400, str(err), param=param) from err
        scheduler = llm.engine.scheduler
        admission.check_kv_capacity(len(ids), seqs[0].max_total, kv_cache_size_tokens=llm.kv_cache_size_tokens,
                                    block_size=scheduler.block_size, dcp=scheduler.dcp)
        return seqs

    def encode(self, text: str, **kwargs) -> list[int]:
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return self.llm.tokenizer.encode(text, **kwargs)

    def piece(self, token: int) -> str:
        """A token's text, as logprobs show it."""
        tokenizer = self.llm.tokenizer
        return tokenizer.token_text(token) if tokenizer is not None else str(token)

    async def stream_all(self, seqs: list) -> AsyncIterator[tuple[int, object]]:
        """(choice index, Update) of every sequence as they come; aborts them all if the consumer goes away."""
        updates: asyncio.Queue = asyncio.Queue()

        async def pump(index, seq):
            try:
                async for update in self.async_engine.generate(seq):
                    await updates.put((index, update, None))
            except Exception as err:  # noqa: BLE001 - handed to the handler (EngineDeadError: 503)
                await updates.put((index, None, err))
            await updates.put((index, None, None))

        tasks = [asyncio.create_task(pump(i, seq)) for i, seq in enumerate(seqs)]
        try:
            running = len(seqs)
            while running:
                index, update, error = await updates.get()
                if error is not None:
                    raise error
                if update is None:
                    running -= 1
                else:
                    yield index, update
        finally:
            for task in tasks:  # cancelling a pump aborts its sequence (AsyncEngine.generate)
                task.cancel()

    async def collect_all(self, seqs: list) -> list:
        """Run the sequences to the end; returns them finished."""
        async for _ in self.stream_all(seqs):
            pass
        return seqs


def usage(seqs: list) -> dict:
    """OpenAI's usage of one request: the prompt once, the completion tokens of every choice."""
    first = seqs[0]
    completion = sum(seq.num_output_tokens for seq in seqs)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion,
            # the most any choice reused (the first of n usually computes the prefix the others share)
            "prompt_tokens_details": {"cached_tokens": max(seq.num_cached_tokens or 0 for seq in seqs)}}


def sse(chunks, body, seqs: list, head: dict, usage_of=usage) -> StreamingResponse:
    """The chunks as server-sent events; with `stream_options.include_usage`, a last chunk
    holding the usage and no choices (OpenAI's form), then `[DONE]`."""
    async def events():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        if body.stream_options is not None and body.stream_options.include_usage:
            last = {**head, "created": int(time.time()), "choices": [], "usage": usage_of(seqs)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
