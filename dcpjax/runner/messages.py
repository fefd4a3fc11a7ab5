"""The host messages between the engine and the runner, both ways (vLLM v1's `SchedulerOutput` and
`ModelRunnerOutput`): plain, immutable data of request ids, token counts, token ids and block ids (NamedTuples where
one is made per row and step: they cost a fraction of a frozen dataclass to build).

    engine -> runner   `ScheduledCall`: one model call's chunks, the requests admitted since the
                       runner last heard of them (`NewRequestData`) and the ids of those finished
    runner -> engine   `ModelRunnerOutput`: what the call sampled, row by row, with request ids

The runner never sees the engine's `Sequence` objects nor the scheduler's arrays: what it must
remember of a request (its sampling values) it keeps itself, keyed by request id
(`runner.request_states`), as vLLM's worker keeps its `InputBatch`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from dcpjax.sampling import SamplingParams
from dcpjax.sampling.logits_processors import LogitsSpec


class NewRequestData(NamedTuple):
    """A request the runner has not seen since it was admitted (new, or back after a preemption).

    output_ids: the tokens it generated before (after a preemption; the logits processors count them).
    """

    request_id: str
    params: SamplingParams
    seed: int  # the request's seed, or one drawn from the LLM's seed
    logits_spec: LogitsSpec | None = None  # its penalties, logit_bias, bad words, ... (None: none)
    output_ids: tuple[int, ...] = ()


class ScheduledChunk(NamedTuple):
    """One request's part of a model call: positions [start, start + count) of its tokens.

    input_ids [count]: the tokens at those positions, drafts last; () for a device input (its one
    token is the slot's last sample, still on the device, which the host has not read).
    prompt_targets: with prompt logprobs, the prompt token after each position of the chunk (the
    ones the prompt has), else ().
    """

    request_id: str
    slot: int  # the request's row of the device-side buffers while it runs
    start: int
    count: int
    samples: bool  # the chunk reaches the last known token: sample the next one
    device_input: bool
    input_ids: tuple[int, ...]
    counter: int  # tokens generated before this chunk's draw (the draw's index)
    num_drafts: int = 0  # speculative drafts at the end of input_ids, verified by the call
    wants_prompt_logprobs: bool = False
    prompt_targets: tuple[int, ...] = ()
    admitted: bool = False  # the request's first chunk since it was admitted (its slot is new)


class ScheduledCall(NamedTuple):
    """One model call of a step, as the scheduler hands it to the runner (a step has up to three: its
    prefill chunks, its prompt-logprobs chunks, its decode rows).

    block_tables [chunks, groups, blocks]: row i is chunk i's request's block tables, one per KV cache
    group (`models.kv_groups`), every block it holds (a read-only copy; entries past its blocks are
    left over, and no query reaches them; a sliding group's entries behind its window are
    `NULL_BLOCK`); chunk i reaches the first `layout.blocks_needed(start + count, block_size, dcp)`.
    greedy: sample every chunk by argmax and report no logprobs (a draft model's proposals).
    """

    chunks: tuple[ScheduledChunk, ...]
    block_tables: np.ndarray
    new_requests: tuple[NewRequestData, ...] = ()
    finished_request_ids: frozenset[str] = frozenset()
    greedy: bool = False


@dataclasses.dataclass(frozen=True)
class SampledLogprobs:
    """Logprobs of some tokens, each array [...] (the rows and positions of its owner), top [..., k]."""

    logprobs: np.ndarray  # float32: the token's logprob
    ranks: np.ndarray  # int32: its rank among all tokens (1 = most likely)
    top_ids: np.ndarray  # int32 [..., k]: the most likely tokens
    top_logprobs: np.ndarray  # float32 [..., k]: their logprobs


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """What one dispatched call computed, brought home: row i is request `request_ids[i]`.

    sampled_token_ids: [R] int32, or [B, T] when verifying drafts (the samples at every position:
    the accepted drafts, then the token after them).
    """

    request_ids: tuple[str, ...]
    sampled_token_ids: np.ndarray
    logprobs: SampledLogprobs | None = None  # of the sampled tokens, shaped like them
    prompt_logprobs: SampledLogprobs | None = None  # [rows, longest chunk]: of each position's next prompt token
    num_accepted: np.ndarray | None = None  # [B] int32 when verifying: the drafts each row kept
