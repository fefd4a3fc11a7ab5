"""Sampling: the request's `SamplingParams` (params), and on the device the filters and draws
(sampler), the logit edits before them (logits_processors) and speculative verification (verify)."""

from dcpjax.sampling.params import MAX_LOGPROBS, MAX_LOGPROBS_LIMIT, SamplingParams
from dcpjax.sampling.sampler import (
    GREEDY,
    MIN_CANDIDATES,
    Sampled,
    SamplerConfig,
    SamplingRows,
    argmax,
    full_config,
    pow2_at_least,
    sample,
    sampler_config,
    token_logprobs,
)

__all__ = [
    "GREEDY",
    "MAX_LOGPROBS",
    "MAX_LOGPROBS_LIMIT",
    "MIN_CANDIDATES",
    "Sampled",
    "SamplerConfig",
    "SamplingParams",
    "SamplingRows",
    "argmax",
    "full_config",
    "pow2_at_least",
    "sample",
    "sampler_config",
    "token_logprobs",
]
