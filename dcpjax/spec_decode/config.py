"""`speculative_config` as vLLM spells it: a dict (or `--speculative-config '{json}'`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verify chunk of 1 + k positions, bucketed to a power of two


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose tokens for the target model to verify.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
      sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min) or
      "draft_model" (a smaller model with the same vocabulary, run greedily on the same mesh with its
      own paged DCP cache).
    num_speculative_tokens: k, the drafts verified per sequence and step.
    model: the draft model (a Hugging Face folder or a built-in name); draft_model only.
    draft_tensor_parallel_size: the draft's TP; it shares the target's mesh and block tables, so
      only the target's TP is accepted (None means that).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Check a user's dict (vLLM's keys); unknown keys are an error that lists the known ones."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):  # ValueError like every bad argument: callers report those
            raise ValueError(  # noqa: TRY004
                f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                f"got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        value = dict(value)
        if "method" not in value and value.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            value["method"], value["model"] = "ngram", None
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else None
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (the drafts verified per step)")
        return cls(**value)

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> None:
            raise ValueError(f"speculative_config {field} {rule}, got {getattr(self, field)!r}")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if self.method not in METHODS:
            bad("method", f"must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "ngram":
            # vLLM: one bound given sets the other; neither gives 5 and 5
            high = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min or 5
            low = self.prompt_lookup_min if self.prompt_lookup_min is not None else high
            object.__setattr__(self, "prompt_lookup_max", high)
            object.__setattr__(self, "prompt_lookup_min", low)
            for field in ("prompt_lookup_min", "prompt_lookup_max"):
                if not is_int(getattr(self, field)) or getattr(self, field) < 1:
                    bad(field, "must be an integer >= 1")
            if low > high:
                bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({high})")
            if self.model is not None:
                bad("model", "is for method 'draft_model' only")
        else:
            if not isinstance(self.model, str) or not self.model:
                bad("model", "must name the draft model (a Hugging Face folder or a built-in name)")
            for field in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, field) is not None:
                    bad(field, "is for method 'ngram' only")
        if self.draft_tensor_parallel_size is not None and not is_int(self.draft_tensor_parallel_size):
            bad("draft_tensor_parallel_size", "must be an integer")

    def check_draft_tp(self, tensor_parallel_size: int) -> None:
        """The draft runs on the target's mesh and shares its block tables: same TP only."""
        tp = self.draft_tensor_parallel_size
        if tp is not None and tp != tensor_parallel_size:
            raise ValueError(
                f"speculative_config draft_tensor_parallel_size={tp} is not supported: the draft model shares the "
                f"target's ('tp', 'dcp') mesh and KV block tables, so it must equal tensor_parallel_size="
                f"{tensor_parallel_size} (or be left out)")

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
