"""Requests in: a prompt and its SamplingParams become engine Sequences, checked against the model.

One prompt draws `params.num_draws` completions (n, or best_of), each its own Sequence: with a
seed, completion i draws with seed + i (as vLLM does); the prefix cache lets the later ones reuse
the first one's prompt KV. `request_output` folds them back into one RequestOutput, keeping the
n best by cumulative logprob when best_of > n. The server and `LLM.generate` both build requests
here, so a request the one accepts the other accepts too: a refused one raises `RequestError`
(a ValueError naming the field and the fix), which the server turns into a 400 with that param.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable

from dcpjax.kv_transfer.params import KVTransferParams
from dcpjax.models.config import ModelConfig
from dcpjax.outputs import RequestOutput
from dcpjax.sampling import MAX_LOGPROBS, SamplingParams
from dcpjax.sampling.logits_processors import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, logits_spec
from dcpjax.sequence import Sequence

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request this engine cannot serve as given: what is wrong and how to fix it (the message),
    the field at fault (`param`: "prompt" or a SamplingParams field) and an OpenAI error `code`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, index: int = 0) -> None:
    """A prompt's token ids: at least one, each in [0, vocab_size), and fewer than max_model_len
    (at least one token left to generate)."""
    if not ids:
        raise RequestError(f"prompt {index} is empty: send at least one token", "prompt")
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestError(f"prompt {index}: token id {token} (position {position}) is outside this model's "
                               f"vocabulary [0, {vocab_size}); send ids the model's tokenizer produces", "prompt",
                               "invalid_token_id")
    if len(ids) >= max_model_len:
        raise RequestError(f"prompt {index} is {len(ids)} tokens; max_model_len={max_model_len} (prompt + output) "
                           f"leaves no room to generate: shorten it to at most {max_model_len - 1} tokens", "prompt",
                           "context_length_exceeded")


def warn_past_context(requests: list[list[Sequence]], max_model_len: int) -> None:
    """Offline generation's word for prompts whose max_tokens cannot fit: they stop at max_model_len
    (finish 'length'); the server refuses them instead (vLLM's 400). One warning for all of them."""
    short = [(i, seqs[0]) for i, seqs in enumerate(requests)
             if seqs[0].params.max_tokens is not None
             and len(seqs[0].prompt_ids) + seqs[0].params.max_tokens > max_model_len]
    if not short:
        return
    i, seq = short[0]
    n = len(seq.prompt_ids)
    more = f" (and {len(short) - 1} more prompt(s))" if len(short) > 1 else ""
    logger.warning("prompt %d: %d tokens + max_tokens %d = %d passes max_model_len %d%s: its output stops at %d "
                   "tokens (finish_reason 'length'); lower max_tokens (--max-tokens) or raise max_model_len "
                   "(--max-model-len)", i, n, seq.params.max_tokens, n + seq.params.max_tokens, max_model_len, more,
                   max_model_len - n)


class RequestBuilder:
    """Prompts -> Sequences for one loaded model (ValueError names what is wrong and the fix)."""

    def __init__(self, cfg: ModelConfig, tokenizer, eos_token_ids: Iterable[int], *, max_model_len: int,
                 seed: int, speculative: bool = False, max_logprobs: int = MAX_LOGPROBS, kv_connector=None):
        self.cfg, self.tokenizer, self.eos = cfg, tokenizer, frozenset(eos_token_ids)
        self.max_logprobs, self.kv_connector = max_logprobs, kv_connector
        self.max_model_len, self.seed, self.speculative = max_model_len, seed, speculative
        self._ids = itertools.count()

    def prompt_ids(self, prompt, index: int) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: text, or {"prompt_token_ids": [...], "prompt": optional text}."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer (no tokenizer.json in its folder, or no tokenizer "
                               "metadata in its GGUF): pass {'prompt_token_ids': [...]}, or tokenizer= a Hugging "
                               "Face folder", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise RequestError(f"prompt {index} must be a string or {{'prompt_token_ids': [...]}}, got "
                           f"{type(prompt).__name__}", "prompt")

    def sequences(self, prompt, params: SamplingParams, index: int = 0,
                  request_id: str | None = None) -> list[Sequence]:
        """The `params.num_draws` sequences of one prompt (ids `request_id`, or `request_id-i` for several)."""
        text, ids = self.prompt_ids(prompt, index)
        check_prompt_ids(ids, self.cfg.vocab_size, self.max_model_len, index)
        self._check_params(params)
        params = self._check_transfer(params, ids)
        bad_words = self._bad_word_ids(params)
        spec = logits_spec(params, ids, self.eos, bad_words)
        budget = self.max_model_len - len(ids) if params.max_tokens is None else params.max_tokens
        numbers = [next(self._ids) for _ in range(params.num_draws)]
        base_id = request_id or str(numbers[0])
        seqs = []
        for i, number in enumerate(numbers):
            seed = params.seed + i if params.seed is not None else self.seed * 1_000_003 + number
            seqs.append(Sequence(
                request_id=base_id if len(numbers) == 1 else f"{base_id}-{i}", prompt=text, prompt_ids=ids,
                params=params, max_total=min(len(ids) + budget, self.max_model_len), seed=seed % 2**32,
                logits_spec=spec))
        return seqs

    def _check_transfer(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """extra_args["kv_transfer_params"]: parsed once into `KVTransferParams` (the server's protocol
        parsed them already), and what this engine's connector (`dcpjax.kv_transfer`) cannot do of them."""
        transfer = (params.extra_args or {}).get("kv_transfer_params")
        if transfer is None:
            return params
        try:
            parsed = KVTransferParams.parse(transfer)
        except ValueError as err:
            raise RequestError(str(err), "kv_transfer_params") from None
        if self.kv_connector is None:
            raise RequestError("kv_transfer_params needs an engine with a kv_transfer_config (kv_producer for "
                               "prefill, kv_consumer for decode; --kv-transfer-config on a server)",
                               "kv_transfer_params")
        if problem := self.kv_connector.request_problem(parsed, ids, params.max_tokens, params.num_draws):
            raise RequestError(problem, "kv_transfer_params")
        if parsed.do_remote_prefill and params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs need the prompt computed here, not transferred: drop one of them",
                               "kv_transfer_params")
        return dataclasses.replace(params, extra_args={**params.extra_args, "kv_transfer_params": parsed})

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: the vocabulary, the tokenizer, speculative decoding."""
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(params, field) or 0) > self.max_logprobs:
                raise RequestError(f"SamplingParams.{field}={getattr(params, field)} is more than this engine's "
                                   f"max_logprobs={self.max_logprobs}: ask for fewer, or start with a larger "
                                   "--max-logprobs", field)
        vocab = self.cfg.vocab_size
        for field in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(params, field) or ()
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise RequestError(f"SamplingParams.{field} has token ids outside this model's vocabulary "
                                   f"[0, {vocab}): {outside[:5]}", field, "invalid_token_id")
        if params.bad_words and self.tokenizer is None:
            raise RequestError("SamplingParams.bad_words needs a tokenizer; this model has none (pass tokenizer=)",
                               "bad_words")
        edits = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                 "repetition_penalty": params.repetition_penalty != 1, "logit_bias": params.logit_bias,
                 "allowed_token_ids": params.allowed_token_ids is not None, "bad_words": params.bad_words,
                 "min_tokens": params.min_tokens}
        if self.speculative and any(edits.values()):
            raise RequestError("penalties, logit_bias, allowed_token_ids, bad_words and min_tokens are not "
                               "supported with speculative decoding (drafts are verified against unedited logits): "
                               "drop them, or start without speculative_config",
                               next(field for field, used in edits.items() if used))

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (how it appears mid-text), as vLLM bans them."""
        words: list[list[int]] = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        too_long = [w for w in words if len(w) > MAX_BAD_WORD_TOKENS]
        if too_long:
            raise RequestError(f"SamplingParams.bad_words: a word of {len(too_long[0])} tokens; at most "
                               f"{MAX_BAD_WORD_TOKENS} tokens per word", "bad_words")
        if sum(len(w) > 1 for w in words) > MAX_BAD_WORDS:
            raise RequestError(f"SamplingParams.bad_words: more than {MAX_BAD_WORDS} words of several tokens "
                               "(counting each with and without a leading space)", "bad_words")
        return words


def best_of(seqs: list[Sequence], n: int) -> list[Sequence]:
    """The n of `seqs` to return: all of them in order, or with more drawn (best_of) the n with the
    highest cumulative logprob, best first (vLLM's order)."""
    if len(seqs) <= n:
        return seqs
    ranked = sorted(seqs, key=lambda s: -(s.cumulative_logprob if s.cumulative_logprob is not None else -1e30))
    return ranked[:n]


def request_output(seqs: list[Sequence], make_output) -> RequestOutput:
    """One RequestOutput for a prompt's sequences (`make_output(seq)` makes each one's)."""
    params = seqs[0].params
    chosen = best_of(seqs, params.n)
    outputs = [dataclasses.replace(make_output(seq).outputs[0], index=i) for i, seq in enumerate(chosen)]
    if params.best_of and params.logprobs is None:
        for out in outputs:  # drawn only to rank the choices
            out.logprobs, out.cumulative_logprob = None, None
    first = make_output(seqs[0])
    request_id = first.request_id.rsplit("-", 1)[0] if len(seqs) > 1 else first.request_id
    return dataclasses.replace(first, request_id=request_id, outputs=outputs,
                               finished=all(s.finished for s in seqs))
