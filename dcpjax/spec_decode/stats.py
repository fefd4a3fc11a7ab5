"""Acceptance counters of speculative decoding (vLLM's metric names, see `serve.metrics`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodeStats:
    """num_drafts: verify rows that carried at least one draft; num_draft_tokens: drafts verified;
    num_accepted_tokens: drafts accepted; accepted_per_position[j]: rows whose draft j was accepted
    (so every draft before it was too)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, drafts: int, accepted: int) -> None:
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per sequence on average: 1 + accepted drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"mean_acceptance_length": self.mean_acceptance_length,
                                           "acceptance_rate": self.acceptance_rate}
