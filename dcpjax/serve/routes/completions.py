"""/v1/completions: OpenAI's completions with vLLM's extras, what evaluation harnesses call.

- `echo`: the prompt comes first in each choice's text, and with `logprobs` its tokens and
  their log-probabilities come first too (the first token's null), as OpenAI and vLLM return
  them; lm-evaluation-harness scores loglikelihoods this way.
- `max_tokens: 0` with `echo`: the prompt (and its logprobs) alone. The engine still samples
  one token, which is dropped.
- `prompt_logprobs` (vLLM's field): per prompt token `{token id: {logprob, rank, decoded_token}}`.
- `n`: choices drawn independently, streamed interleaved by `index`; `best_of`: that many drawn,
  the n with the highest cumulative logprob returned (not streamed).
- a list of prompts: each prompt's n choices, indexed prompt by prompt (index = prompt * n + j).
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from dcpjax.engine.requests import best_of
from dcpjax.serve.context import ServerContext, prompt_key, sse, usage
from dcpjax.serve.errors import APIError
from dcpjax.serve.protocol import CompletionRequest, CompletionResponse
from dcpjax.serve.routes import logprob_format


def _prompts(server: ServerContext, body: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt of a body as (token ids, text): a text, token ids, or a list of either;
    token-id prompts are decoded for echo."""
    prompt = body.prompt
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    prompts = list(prompt) if many else [prompt]
    if not prompts:
        raise APIError(400, "the prompt list is empty: send at least one prompt", param="prompt")
    tokenizer = server.tokenizer
    out = []
    for one in prompts:
        if isinstance(one, list):
            out.append((list(one), tokenizer.decode(one) if tokenizer is not None and body.echo else ""))
        else:
            out.append((server.encode(one), one))
    return out


class _Choices:
    """Builds each choice of one request, whole or as stream deltas."""

    def __init__(self, server: ServerContext, body: CompletionRequest, ids: list[int], text: str):
        self.server, self.body, self.ids, self.text = server, body, ids, text
        self.prompt_only = body.max_tokens == 0  # echo of the prompt alone: the sampled token is dropped

    def logprobs(self, seq, tokens, entries, text_start, echo_prompt: bool):
        if self.body.logprobs is None:
            return None
        if echo_prompt:
            tokens, entries = [*self.ids, *tokens], [*seq.prompt_logprobs, *entries]
        return logprob_format.completion_logprobs(self.server.piece, tokens, entries, self.body.logprobs, text_start)

    def choice(self, index: int, seq, text: str, tokens, entries, finish_reason, first: bool, text_start: int = 0):
        """A choice (or a delta of one); `first`: the first piece of this choice (where echo goes)."""
        echo = self.body.echo and first
        stop_reason = seq.stop_reason if finish_reason else None
        if self.prompt_only:  # whatever ended the dropped token, the answer is the prompt: "length"
            text, tokens, entries = "", [], []
            finish_reason, stop_reason = ("length" if finish_reason else None), None
        choice = {"index": index, "text": (self.text if echo else "") + text, "finish_reason": finish_reason,
                  "stop_reason": stop_reason,
                  "logprobs": self.logprobs(seq, tokens, entries, 0 if echo else text_start, echo)}
        if first and self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = logprob_format.prompt_logprobs(seq.prompt_logprobs, self.body.prompt_logprobs)
        return choice

    def usage(self, seqs) -> dict:
        counted = usage(seqs)
        if self.prompt_only:
            counted["total_tokens"] -= counted["completion_tokens"]
            counted["completion_tokens"] = 0
        return counted


def _check_echo(body: CompletionRequest) -> None:
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens=0 generates nothing: it needs echo=true (the prompt and its logprobs alone)",
                       param="max_tokens")


def add_completions_route(app: FastAPI, server: ServerContext, responses) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=responses("/v1/completions"))
    async def completions(body: CompletionRequest):
        """Complete a prompt (text or token ids); `stream: true` answers with server-sent events."""
        with server.releasing_refused_handle(body):  # a refused decode request frees its KV at once
            server.check_model(body.model)
            _check_echo(body)
            prompts = _prompts(server, body)
            if body.kv_transfer_params is not None and len(prompts) > 1:  # one handle: one prompt's KV
                raise APIError(400, f"kv_transfer_params goes with one prompt; this request has {len(prompts)}: send "
                                    "one request per prompt", param="kv_transfer_params")
            for ids, _ in prompts:  # an explicit max_tokens (0 with echo: the prompt alone)
                server.check_context(len(ids), body.max_tokens or None, "max_tokens", body.kv_transfer_params)
            max_tokens = 16 if body.max_tokens is None else max(body.max_tokens, 1)
            # echo with logprobs returns the prompt's logprobs too
            prompt_top = body.logprobs if body.echo and body.logprobs is not None else None
            if prompt_top is not None and body.prompt_logprobs is not None:
                prompt_top = max(prompt_top, body.prompt_logprobs)
            params = server.sampling(body, max_tokens, body.logprobs, prompt_logprobs=prompt_top)
            groups = [server.sequences(ids, text, params, index=i) for i, (ids, text) in enumerate(prompts)]
            seqs = [seq for group in groups for seq in group]
        head = {"id": prompt_key(seqs[0]), "object": "text_completion", "model": server.model}
        builders = [_Choices(server, body, ids, text) for ids, text in prompts]
        if body.stream:
            return sse(_stream(server, body, groups, builders, head), body, seqs, head, builders[0].usage)
        await server.collect_all(seqs)
        choices = []
        for p, (group, build) in enumerate(zip(groups, builders)):
            for j, seq in enumerate(best_of(group, body.n)):  # choice index: prompt by prompt, as OpenAI orders them
                choices.append(build.choice(p * body.n + j, seq, seq.text or "", seq.output_ids, seq.logprobs,
                                            seq.finish_reason, True))
        return {**head, "created": int(time.time()), "choices": choices, "usage": builders[0].usage(seqs),
                "kv_transfer_params": seqs[0].kv_transfer_params}


async def _stream(server: ServerContext, body: CompletionRequest, groups: list[list], builders: list, head: dict):
    """The chunks of a streamed completion: each choice's deltas, interleaved as they come."""
    seqs = [seq for group in groups for seq in group]
    owner = [(p, j) for p, group in enumerate(groups) for j in range(len(group))]
    offset = [0] * len(seqs)  # text_offset of each choice's next token (token texts, as unstreamed)
    started = [False] * len(seqs)
    async for i, u in server.stream_all(seqs):
        p, j = owner[i]
        choice = builders[p].choice(p * body.n + j, u.seq, u.text_delta, u.token_ids, u.logprobs, u.finish_reason,
                                    not started[i], offset[i])
        started[i] = True
        if choice["logprobs"] is not None:
            offset[i] += sum(len(token) for token in choice["logprobs"]["tokens"])
        yield {**head, "created": int(time.time()), "choices": [choice]}
