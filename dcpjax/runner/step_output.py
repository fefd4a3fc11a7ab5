"""A dispatched call's output: its sampled tokens (and logprobs) packed into one array on the
device, copied home asynchronously and unpacked on the host into a `ModelRunnerOutput`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dcpjax.runner.messages import ModelRunnerOutput, SampledLogprobs
from dcpjax.sampling import SamplerConfig


def as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def pack_logprobs(values) -> jax.Array:
    """(logprob [...], rank [...], top_ids [..., k], top_logprobs [..., k]) -> [..., 2 + 2k] float32."""
    logprob, rank, top_ids, top_logprobs = values
    return jnp.concatenate([logprob[..., None], as_bits(rank)[..., None], as_bits(top_ids), top_logprobs], axis=-1)


class ModelStepOutput(NamedTuple):
    """What the jitted model call returns (R sampling rows; B rows of T tokens when verifying)."""

    greedy: jax.Array  # [R] int32 argmax tokens ([B, T] verifying)
    accepted: jax.Array | None  # [B] int32 drafts kept (verifying), else None
    prompt_logprobs: jax.Array | None  # [1, N, 2 + 2k] float32 packed ("prompt" calls), else None
    logits: jax.Array  # [R, V] float32 ([B, T, V] verifying): what the sampler's program draws from
    fields: jax.Array  # [R * F] int32: the call's per-row fields (`step_input.FIELDS`), for the sampler
    verify_tokens: jax.Array | None  # [B, T] int32 the verify rows' input tokens, else None
    kv_caches: tuple  # the layers' caches, updated (donated in)
    slot_tokens: jax.Array  # [max_num_seqs] int32: each slot's last sample (donated in)


class SamplerStepOutput(NamedTuple):
    """What the jitted sampler call returns."""

    sampled: jax.Array  # [R(, T), 3 + 2k] float32: tokens (bit-cast) and their logprobs
    accepted: jax.Array | None  # [B] int32 drafts kept (verifying), else None
    slot_tokens: jax.Array  # [max_num_seqs] int32 (donated in)
    processor_state: object  # the logits processors' per-slot rows (donated in)


@dataclasses.dataclass
class StepResult:
    """A dispatched call: its rows' request ids, and its sampled output still on (or coming from) the
    device; `fetch` brings it home as a `ModelRunnerOutput`."""

    request_ids: tuple[str, ...]
    counts: tuple[int, ...]  # each row's chunk length
    output: jax.Array  # [R] int32 tokens, or [R, 3 + 2 * num_top] float32 with logprobs ([B, T, ...] if verify)
    config: SamplerConfig
    prompt_output: jax.Array | None = None  # [1, N, 2 + 2 * prompt_top] float32: prompt logprobs (packed)
    prompt_top: int | None = None
    # verifying drafts: [B] int32, the drafts each row kept; output then has a chunk axis,
    # [B, T(, ...)], the samples at every position
    accepted: jax.Array | None = None
    token_offsets: np.ndarray | None = None  # [rows]: each row's first token in the call's flat tokens

    @property
    def verify(self) -> bool:
        return self.accepted is not None

    def block_until_ready(self) -> None:
        self.output.block_until_ready()

    def fetch(self) -> ModelRunnerOutput:
        """Block until the call is done; its samples [R] (with logprobs if asked), prompt logprobs per
        chunk position of each row [rows, longest chunk(, k)], and when verifying num_accepted [B]."""
        out = np.asarray(self.output)
        tokens, logprobs = (out, None) if self.config.num_top is None else _unpack(out, self.config.num_top)
        prompt = None
        if self.prompt_output is not None:
            flat = np.asarray(self.prompt_output).reshape(-1, self.prompt_output.shape[-1])
            at = np.minimum(self.token_offsets[:, None] + np.arange(max(self.counts))[None, :], flat.shape[0] - 1)
            prompt = _unpack_logprobs(flat[at], self.prompt_top)
        accepted = None if self.accepted is None else np.asarray(self.accepted)
        return ModelRunnerOutput(self.request_ids, tokens, logprobs, prompt, accepted)


def _as_int(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.int32)


def _unpack_logprobs(out: np.ndarray, k: int) -> SampledLogprobs:
    """[..., logprob, rank, top_ids * k, top_logprobs * k] float32 (ints bit-cast) -> named arrays."""
    return SampledLogprobs(out[..., 0], _as_int(out[..., 1]), _as_int(out[..., 2 : 2 + k]), out[..., 2 + k :])


def _unpack(out: np.ndarray, k: int) -> tuple[np.ndarray, SampledLogprobs]:
    """[..., token, logprob, rank, top_ids * k, top_logprobs * k] -> (tokens, their logprobs)."""
    return _as_int(out[..., 0]), _unpack_logprobs(out[..., 1:], k)
