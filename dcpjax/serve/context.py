"""What the route handlers share: the model, the engine, request validation, and the
plumbing of several choices (`n`) per request.

A request with n > 1 (or best_of) becomes that many engine sequences, built by the LLM's
`dcpjax.engine.requests.RequestBuilder` as offline requests are (with a seed, choice i uses
seed + i, as vLLM does); the prefix cache lets the later ones reuse the first one's
prompt KV in whole blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from dcpjax.engine.requests import RequestError
from dcpjax.kv_transfer.params import KVTransferParams
from dcpjax.sampling import SamplingParams
from dcpjax.serve.errors import APIError
from dcpjax.serve.protocol import ACCEPTED_EXTRA_FIELDS, ChatRequest, CompletionRequest
from dcpjax.serve.tools.calls import ToolConfig
from dcpjax.text.chat_template import ChatTemplate

if TYPE_CHECKING:  # for the types only: the routes receive these objects, they do not build them
    from dcpjax.llm import LLM
    from dcpjax.sequence import Sequence
    from dcpjax.serve.async_engine import AsyncEngine, Update
    from dcpjax.serve.metrics import Metrics


@dataclasses.dataclass
class ServerContext:
    """What every route handler reads: the loaded model, the engine's asyncio front, the metrics."""

    llm: LLM
    async_engine: AsyncEngine | None  # None: an app that only admits (tests of the 400s)
    metrics: Metrics
    model: str  # the served model name
    chat_template: ChatTemplate
    created: int
    tools: ToolConfig = dataclasses.field(default_factory=ToolConfig)

    # what the routes ask of the model (not reached through `llm`)
    tokenizer = property(lambda self: self.llm.tokenizer)  # None: a model folder without tokenizer.json
    max_model_len = property(lambda self: self.llm.max_model_len)
    vocab_size = property(lambda self: self.llm.vocab_size)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model!r}",
                           "invalid_request_error", "model_not_found", param="model")

    def sampling(self, body: CompletionRequest | ChatRequest, max_tokens: int | None, logprobs: int | None,
                 max_tokens_param: str = "max_tokens", prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams: its fields, else the model's generation_config defaults,
        else vLLM's; a 400 naming the field for a value or a field the server cannot honour."""
        check_extra_fields(body)
        _check_max_tokens(max_tokens, self.max_model_len, max_tokens_param)
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise APIError(400, "best_of > n cannot stream (the best choices are known only at the end): send "
                                "stream=false, or drop best_of", param="best_of")
        defaults = self.llm.default_sampling

        def given(name: str, vllm_default):
            value = getattr(body, name)
            return value if value is not None else defaults.get(name, vllm_default)

        top_k = given("top_k", 0)
        values = dict(
            n=body.n, best_of=body.best_of, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=0 if top_k >= self.vocab_size else top_k,  # the whole vocabulary: no filter
            min_p=given("min_p", 0.0), presence_penalty=given("presence_penalty", 0.0),
            frequency_penalty=given("frequency_penalty", 0.0), repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias=_logit_bias(body.logit_bias), min_tokens=body.min_tokens, bad_words=body.bad_words,
            allowed_token_ids=body.allowed_token_ids, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            extra_args=self._transfer_args(body),
        )
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err), param=_field_of(str(err))) from err

    def _transfer_args(self, body: CompletionRequest | ChatRequest) -> dict | None:
        """extra_args carrying the body's kv_transfer_params (parsed by the protocol); a 400 for what no
        server with this body can do of them (the connector's own checks run with the request)."""
        params = body.kv_transfer_params
        if params is None:
            return None
        if self.llm.kv_connector is None:
            raise APIError(400, "kv_transfer_params needs a server started with --kv-transfer-config (kv_producer "
                                "for prefill, kv_consumer for decode)", param="kv_transfer_params")
        if params.do_remote_decode and body.stream:
            raise APIError(400, "kv_transfer_params.do_remote_decode needs stream false (the handle is in the "
                                "response)", param="kv_transfer_params")
        if params.do_remote_prefill and (body.prompt_logprobs is not None or getattr(body, "echo", False)):
            raise APIError(400, "prompt logprobs (prompt_logprobs, echo) need the prompt computed here: not with a "
                                "transfer", param="kv_transfer_params")
        return {"kv_transfer_params": params}

    def release_invalid_handle(self, body) -> None:
        """A body its model refused (a 400 before any route): if it carries a handle that parses, the
        prefill server frees that KV now (best effort: the rest of the body may be what was wrong)."""
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if params is None or self.llm.kv_connector is None:
            return
        try:
            self.llm.kv_connector.release(KVTransferParams.parse(params))
        except ValueError:
            pass  # the handle itself is malformed: its producer frees it at its timeout

    @contextlib.contextmanager
    def releasing_refused_handle(self, body: CompletionRequest | ChatRequest):
        """Around a request's checks: a decode request this server refuses (4xx) frees its prompt's KV on
        the prefill server now, rather than at the prefill server's timeout."""
        try:
            yield
        except APIError as err:
            params, connector = body.kv_transfer_params, self.llm.kv_connector
            if err.status < 500 and params is not None and connector is not None:
                connector.release(params)
            raise

    def check_context(self, prompt_tokens: int, max_tokens: int | None, param: str,
                      transfer: KVTransferParams | None) -> None:
        """A 400 before any work when the prompt and the output the client asked for (`max_tokens`,
        given by `param`; None: up to the context) pass max_model_len, as vLLM answers. A prefill
        request from the router asks for 1 token and carries the client's own in `client_max_tokens`:
        the pair's request is refused here, before its prompt runs."""
        if prompt_tokens >= self.max_model_len:  # the prompt alone is too long: its own 400 says so
            return
        if transfer is not None and transfer.do_remote_decode and transfer.client_max_tokens is not None:
            max_tokens = transfer.client_max_tokens
        _check_max_tokens(max_tokens, self.max_model_len, param, prompt_tokens)

    def sequences(self, ids: list[int], text: str | None, params: SamplingParams, param: str = "prompt",
                  index: int = 0) -> list[Sequence]:
        """The engine sequences of a prompt's n (or best_of) choices, built by the LLM's own request
        checks (`engine.requests`): what it refuses is a 400 naming the field (`param` for the prompt:
        "prompt", or "messages" for a chat; `index`: the prompt's place in a list of prompts)."""
        try:
            return self.llm.make_sequences({"prompt_token_ids": ids, "prompt": text}, params, index,
                                           request_id=f"cmpl-{uuid.uuid4().hex}")
        except RequestError as err:
            raise APIError(400, str(err), param=param if err.param == "prompt" else err.param, code=err.code) from err
        except ValueError as err:  # a check that raised a plain ValueError: still the request's fault
            raise APIError(400, str(err), param=_field_of(str(err)) or param) from err

    def encode(self, text: str, **kwargs) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return self.tokenizer.encode(text, **kwargs)

    def piece(self, token: int) -> str:
        """A token's text, as logprobs show it."""
        tokenizer = self.tokenizer
        return tokenizer.token_text(token) if tokenizer is not None else str(token)

    async def stream_all(self, seqs: list[Sequence]) -> AsyncIterator[tuple[int, Update]]:
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

    async def collect_all(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run the sequences to the end; returns them finished."""
        async for _ in self.stream_all(seqs):
            pass
        return seqs


def usage(seqs: list[Sequence]) -> dict:
    """OpenAI's usage of one request: each prompt once, the completion tokens of every choice drawn
    (best_of counts every draw, as OpenAI bills it)."""
    prompts: dict[str, list] = {}  # the choices of each prompt (a completions request may hold several)
    for seq in seqs:
        prompts.setdefault(prompt_key(seq), []).append(seq)
    prompt = sum(group[0].num_prompt_tokens for group in prompts.values())
    completion = sum(seq.num_output_tokens for seq in seqs)
    # per prompt, the most any choice reused (the first of n usually computes the prefix the others share)
    cached = sum(max(seq.num_cached_tokens or 0 for seq in group) for group in prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def prompt_key(seq: Sequence) -> str:
    """The request id shared by a prompt's choices (`id-i` each when it draws several)."""
    return seq.request_id.rsplit("-", 1)[0] if seq.params.num_draws > 1 else seq.request_id


def check_extra_fields(body: CompletionRequest | ChatRequest) -> None:
    """A 400 for a request field this server does not know, or an OpenAI field it accepts only with
    the values it honours by doing nothing (`protocol.ACCEPTED_EXTRA_FIELDS`)."""
    for name, value in (body.model_extra or {}).items():
        if name not in ACCEPTED_EXTRA_FIELDS:
            raise APIError(400, f"unsupported field {name!r}: this server does not implement it (the request's "
                                "fields are listed in /openapi.json); drop it", param=name)
        accepted = ACCEPTED_EXTRA_FIELDS[name]
        if accepted is not None and value not in accepted:
            raise APIError(400, f"{name}={json.dumps(value)} is not supported by this server (it accepts only "
                                f"{' or '.join(json.dumps(a) for a in accepted)}); drop it", param=name)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {token id: bias}."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (strings of integers, as OpenAI's tokenizer "
                            "gives them)", param="logit_bias") from None


def _check_max_tokens(max_tokens: int | None, max_model_len: int, param: str, prompt_tokens: int = 0) -> None:
    """The server's rule (vLLM's): the prompt and an explicit max_tokens within max_model_len (where
    `LLM.generate` would stop at max_model_len, finish 'length')."""
    if max_tokens is None or prompt_tokens + max_tokens <= max_model_len:
        return
    asked = f"{param}={max_tokens}" + (f" with a prompt of {prompt_tokens} tokens ({prompt_tokens + max_tokens} in all)"
                                      if prompt_tokens else "")
    raise APIError(400, f"{asked} is larger than this server's max_model_len={max_model_len} (prompt + output "
                        f"tokens): ask for at most max_model_len minus the prompt's length"
                        + (f" ({max_model_len - prompt_tokens})" if prompt_tokens else ""),
                   param=param, code="context_length_exceeded")


def _field_of(message: str) -> str | None:
    """The field a 'SamplingParams.<field> ...' message names (the 400's param)."""
    if message.startswith("SamplingParams."):
        return message.removeprefix("SamplingParams.").split(" ", 1)[0].split("=", 1)[0]
    return None


def sse(chunks: AsyncIterator[dict], body: CompletionRequest | ChatRequest, seqs: list[Sequence], head: dict,
        usage_of=usage) -> StreamingResponse:
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
