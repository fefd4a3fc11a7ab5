"""One request as the engine tracks it (its tokens, its KV blocks, how far it has got), and its
part of a step (`ScheduledRow`), which the scheduler makes; `scheduled_call` turns a call's rows
into the runner's message (`runner.messages.ScheduledCall`: ids, counts, token and block ids), so
the runner never sees a `Sequence`.

Above the runner, below the proposers and the engine. Who writes what:
the scheduler alone writes the scheduler state (blocks, slot, num_computed, num_pending, the
prefix-cache fields) and a row's drafts; the output processor alone writes the output state
(token_ids after the prompt, logprobs, text, finish_reason and stop_reason; the engine writes
finish_reason "abort"); the runner and the draft model keep what they need of a request in their
own state, keyed by request id (`runner.request_states`) or by the sequence (`DraftModelProposer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from collections.abc import Sequence as Seq

import numpy as np

from dcpjax.outputs import Logprob
from dcpjax.runner.messages import NewRequestData, ScheduledCall, ScheduledChunk
from dcpjax.sampling import SamplingParams
from dcpjax.sampling.logits_processors import LogitsSpec


@dataclasses.dataclass(eq=False)  # identity, not field-by-field: queues look sequences up often
class Sequence:
    """A request: prompt and generated tokens in one list, plus the scheduler's bookkeeping.

    `token_ids` holds the prompt followed by every generated token the host has read.
    With asynchronous scheduling the tokens sampled by steps the host has not read yet are
    still on the device: `num_pending` counts them (at most two: the step in flight and
    the one just scheduled) and `num_tokens` includes them.
    """

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_total: int  # prompt + output tokens this sequence may reach
    seed: int  # the request's seed, or one drawn from the LLM's seed
    logits_spec: LogitsSpec | None = None  # its penalties, logit_bias, bad words, ... (None: none)
    token_ids: list[int] = dataclasses.field(init=False)
    num_prompt_tokens: int = dataclasses.field(init=False)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = dataclasses.field(default_factory=lambda: [None])
    cumulative_logprob: float | None = None  # only when logprobs are requested, as in vLLM
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str | None = None
    # scheduler state
    blocks: list[list[int]] = dataclasses.field(default_factory=list)  # per KV cache group, all one length
    slot: int | None = None  # row of the device-side token buffer while running
    num_computed: int = 0  # tokens whose KV is in the cache (or written by the step in flight)
    num_pending: int = 0  # sampled on the device, not yet read by the host
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    num_hashed_blocks: int = 0  # leading blocks registered in (or taken from) the prefix cache
    sliding_cache_from: int = 0  # a loaded prompt: its sliding groups' blocks before this are not registered
    prefix_key: int = 0  # key id the next full block chains to (`block_pool.ROOT` at the start)
    # output processor state
    detokenizer: object | None = dataclasses.field(default=None, repr=False)
    # prefill/decode disaggregation (`dcpjax.kv_transfer`): on a prefill server, the handle a decode
    # server pulls the prompt's KV with (the connector sets it when the prompt finishes)
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, counting the one still on the device."""
        return len(self.token_ids) + self.num_pending

    @property
    def length(self) -> int:
        """Prompt + generated tokens the host has read."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    def output_ids_since(self, start: int) -> list[int]:
        """Generated tokens from output index `start` on (O(new tokens))."""
        return self.token_ids[self.num_prompt_tokens + start :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has not got them all (a recompute after a preemption
        that had them is an ordinary prefill)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class ScheduledRow:
    """One sequence's part of a step: tokens [start, start + count) of the sequence."""

    seq: Sequence
    start: int
    count: int
    samples: bool  # the chunk reaches the last known token: sample the next one
    device_input: bool  # the one input token is the previous step's sample, still on the device
    admitted: bool = False  # the sequence's first row since it left the waiting queue (its slot is new)
    # speculative decoding: a decode row may verify up to `lookahead` drafts (room reserved by the
    # scheduler); `drafts` are the proposed tokens after the input, so count = 1 + len(drafts)
    lookahead: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The chunk holds prompt positions whose next-token logprob the request asked for."""
        return self.seq.needs_prompt_logprobs and self.start < self.seq.num_prompt_tokens - 1

    @property
    def is_decode(self) -> bool:
        """One token that samples (and its drafts, if any): runs in the step's decode call, after its
        prefill call."""
        return self.count == 1 + len(self.drafts) and self.samples

    @property
    def input_ids(self) -> list[int]:
        """The chunk's tokens as the host knows them, drafts last (none for a device input: its token
        is still on the device)."""
        known = self.seq.token_ids[self.start : self.start + self.count - len(self.drafts)]
        return known + self.drafts

    def chunk(self) -> ScheduledChunk:
        """The row as the runner's message."""
        seq, wants = self.seq, self.wants_prompt_logprobs
        targets = seq.token_ids[self.start + 1 : min(self.start + self.count + 1, seq.num_prompt_tokens)] if wants \
            else ()
        return ScheduledChunk(seq.request_id, seq.slot, self.start, self.count, self.samples, self.device_input,
                              tuple(self.input_ids), seq.num_tokens - 1 - seq.num_prompt_tokens, len(self.drafts),
                              wants, tuple(targets), self.admitted)


def new_request_data(seq: Sequence) -> NewRequestData:
    """What the runner keeps of `seq` from its admission on."""
    return NewRequestData(seq.request_id, seq.params, seq.seed, seq.logits_spec, tuple(seq.output_ids))


def scheduled_call(rows: Seq[ScheduledRow], block_tables: np.ndarray, *, greedy: bool = False,
                   finished_request_ids: Collection[str] = ()) -> ScheduledCall:
    """A model call's rows as the runner's message: their requests' block-table rows copied out of the
    scheduler's `block_tables` [slots, groups, blocks_per_seq] (one gather, read-only), the rows admitted since
    the runner last saw their requests as `NewRequestData`."""
    slots = np.fromiter((row.seq.slot for row in rows), np.int32, len(rows))
    width = max((len(row.seq.blocks[0]) if row.seq.blocks else 0 for row in rows), default=0)
    tables = block_tables[slots, :, :width]  # fancy indexing: a copy
    tables.flags.writeable = False
    return ScheduledCall(tuple(row.chunk() for row in rows), tables,
                         tuple(new_request_data(row.seq) for row in rows if row.admitted),
                         frozenset(finished_request_ids), greedy)


@dataclasses.dataclass
class ScheduledStep:
    """One step's rows (the engine's side: they point at the sequences). Prefill chunks and decode
    tokens run as separate model calls (a decode row padded to a prefill chunk would cost a whole
    chunk of compute), in this order: prefill, prefill with prompt logprobs (logits at every
    position, for those rows only), decode."""

    prefill: list[ScheduledRow]
    decode: list[ScheduledRow]
    preempted: int = 0
    prompt_logprobs: list[ScheduledRow] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode or self.prompt_logprobs)

    @property
    def calls(self) -> list[list[ScheduledRow]]:
        """The non-empty model calls of the step, in dispatch order."""
        return [rows for rows in (self.prefill, self.prompt_logprobs, self.decode) if rows]
