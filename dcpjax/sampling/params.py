"""What a request asks of sampling: `SamplingParams` (vLLM's fields, defaults and checks).

The device side that honours them is `sampler` (filters and draws), `logits_processors`
(penalties, biases, bad words, min_tokens) and `verify` (speculative drafts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most a request may ask for (LLM(max_logprobs=...))
MAX_LOGPROBS_LIMIT = 1024  # what SamplingParams itself accepts (top-k over the vocabulary on the device)


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's fields and defaults).

    n: completions to return for the prompt; best_of: completions to draw, of which the n with
    the highest cumulative logprob are returned (default n). Completion i draws with seed + i.
    temperature 0 is greedy. top_k 0 or -1 and top_p 1 disable those filters.
    presence_penalty / frequency_penalty: subtracted from a token's logit once if it was
    generated before / once per time it was (OpenAI's, in [-2, 2]); repetition_penalty: a
    logit of a token in the prompt or generated before is divided by it if positive, multiplied
    if negative (Hugging Face's and vLLM's; > 1 discourages repeats, 1 is off).
    logit_bias: {token id: bias} added to the logits (in [-100, 100]). allowed_token_ids: only these
    tokens can be sampled. bad_words: words never generated (each tokenized with and without a
    leading space; a word of several tokens bans its last token after the others were generated).
    min_tokens: EOS and stop_token_ids cannot end the output before this many tokens, and stop
    strings are not looked for before them.
    logprobs: how many top log-probabilities to return per generated token
    (the sampled token's is always included); None returns none.
    prompt_logprobs: the same for every prompt token after the first (vLLM's field; the
    prompt is then computed in full, not taken from the prefix cache).
    Log-probabilities are those of the model's logits, before penalties and biases (vLLM's default).
    extra_args: what a connector reads (vLLM's field): {"kv_transfer_params": {...}} asks a prefill
    server to hand the prompt's KV on, or a decode server to pull it (`dcpjax.kv_transfer`).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_filters()
        self._check_penalties()
        self._check_lengths()
        self._check_token_lists()

    def _bad(self, field: str, rule: str):
        raise ValueError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

    def _number(self, field: str, low: float, high: float, *, low_open: bool = False) -> None:
        value = getattr(self, field)
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high
                or (low_open and value == low)):
            self._bad(field, f"must be a number in {'(' if low_open else '['}{low}, {high}]")

    def _check_choices(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            self._bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            self._bad("best_of", f"must be an integer >= n ({self.n}) or None")
        if self.seed is not None and not _is_int(self.seed):
            self._bad("seed", "must be an integer or None")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            self._bad("extra_args", "must be a dict or None")

    def _check_filters(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            self._bad("temperature", "must be a finite number >= 0 (0 is greedy)")
        self._number("top_p", 0, 1, low_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            self._bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        self._number("min_p", 0, 1)

    def _check_penalties(self) -> None:
        self._number("presence_penalty", -2, 2)
        self._number("frequency_penalty", -2, 2)
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty < float("inf"):
            self._bad("repetition_penalty", "must be a finite number > 0 (1 is off)")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or any(
                not _is_int(k) or k < 0 or not isinstance(v, (int, float)) or not -100 <= v <= 100
                for k, v in bias.items())):
            self._bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            self._bad("max_tokens", "must be an integer >= 1 (or None: up to max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            self._bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            self._bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS_LIMIT):
                self._bad(field, f"must be an integer in [0, {MAX_LOGPROBS_LIMIT}] or None")

    def _check_token_lists(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            self._bad("stop", "must be a non-empty string or a list of them")
        self.stop = stops
        words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in words):
            self._bad("bad_words", "must be a list of non-empty strings")
        self.bad_words = words
        for field in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, field)
            ids = None if value is None else list(value)
            if ids is not None and any(not _is_int(t) or t < 0 for t in ids):
                self._bad(field, "must be a list of token ids >= 0")
            setattr(self, field, ids)
        self.stop_token_ids = self.stop_token_ids or []
        if self.allowed_token_ids == []:
            self._bad("allowed_token_ids", "must hold at least one token id (or be None: every token)")

    @property
    def num_draws(self) -> int:
        """Completions drawn for the prompt (best_of, else n)."""
        return self.best_of or self.n

    @property
    def needs_logprobs(self) -> bool:
        """The sampled tokens' logprobs are needed: asked for, or to rank best_of > n draws."""
        return self.logprobs is not None or self.num_draws > self.n

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
