"""A dispatched step's output: its sampled tokens (and logprobs) packed into one array on the
device, copied home asynchronously and unpacked by name on the host."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dcpjax.sampling import SamplerConfig
from dcpjax.sequence import ScheduledRow


def as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def pack_logprobs(values) -> jax.Array:
    """(logprob [...], rank [...], top_ids [..., k], top_logprobs [..., k]) -> [..., 2 + 2k] float32."""
    logprob, rank, top_ids, top_logprobs = values
    return jnp.concatenate([logprob[..., None], as_bits(rank)[..., None], as_bits(top_ids), top_logprobs], axis=-1)


@dataclasses.dataclass
class StepResult:
    """A dispatched step: its rows, and its sampled output still on (or coming from) the device."""

    rows: list[ScheduledRow]
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

    def fetch(self) -> dict[str, np.ndarray]:
        """Block until the step is done; tokens [R], and with logprobs: logprobs, ranks, top_ids,
        top_logprobs; with prompt logprobs "prompt": the same per chunk position of each row,
        [rows, longest chunk(, k)]; when verifying drafts "num_accepted" [B]."""
        out = np.asarray(self.output)
        values = {"tokens": out} if self.config.num_top is None else _unpack_logprobs(out, self.config.num_top)
        if self.prompt_output is not None:
            flat = np.asarray(self.prompt_output).reshape(-1, self.prompt_output.shape[-1])
            longest = max(row.count for row in self.rows)
            at = np.minimum(self.token_offsets[:, None] + np.arange(longest)[None, :], flat.shape[0] - 1)
            values["prompt"] = _unpack_logprobs(flat[at], self.prompt_top, has_token=False)
        if self.accepted is not None:
            values["num_accepted"] = np.asarray(self.accepted)
        return values


def _unpack_logprobs(out: np.ndarray, k: int, has_token: bool = True) -> dict[str, np.ndarray]:
    """[..., (token,) logprob, rank, top_ids * k, top_logprobs * k] float32 (ints bit-cast) -> named arrays."""
    as_int = lambda x: np.ascontiguousarray(x).view(np.int32)
    values = {"tokens": as_int(out[..., 0])} if has_token else {}
    out = out[..., 1:] if has_token else out
    return values | {"logprobs": out[..., 0], "ranks": as_int(out[..., 1]), "top_ids": as_int(out[..., 2 : 2 + k]),
                     "top_logprobs": out[..., 2 + k :]}
