"""Logit edits before sampling (vLLM's order): allowed_token_ids, bad_words, min_tokens and
logit_bias, then the repetition, frequency and presence penalties. All on the device.

What a request needs lives in its slot's row of `ProcessorState`, on the device:

- `counts` [slots, vocab] int32: how often each token was generated (frequency and presence
  penalties; repetition too). The step adds each row's sampled token, so no count crosses to the
  host and back; it is installed afresh from the host's tokens when the request is admitted
  (at admission the host knows every token: a sequence waits until its last one is read).
- `flags` [slots, vocab] int8: PROMPT (the token is in the prompt: repetition penalty) and
  STOP (EOS or a stop token id: banned while fewer than min_tokens are generated).
- `bias` [slots, vocab] float32: logit_bias, -inf outside allowed_token_ids, -inf for
  single-token bad words. Fixed for the request's life, so computed once on the host.
- `words` [slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32 and `history` [slots,
  MAX_BAD_WORD_TOKENS - 1] int32: multi-token bad words (right-aligned, ANY on the left) and the
  last generated tokens, so a word's last token is banned when the tokens before it were just
  generated (vLLM matches bad words against the generated tokens only).

The state lives on the device for the runner's life, replicated over the mesh like the slot
tokens; an admitted request's rows are built dense on the host and written in one small call of
fixed shapes (`install`). Values per row (the penalties, min_tokens, whether the row uses its
slot's state) travel in the packed step input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PROMPT, STOP = 1, 2  # bits of `flags`
MAX_BAD_WORDS = 32  # multi-token bad words per request (single-token ones are unlimited)
MAX_BAD_WORD_TOKENS = 8
ANY = -1  # a word position that matches any token (left padding of a short word)
NONE = -2  # a history position before the first generated token: matches no word token


@dataclasses.dataclass(frozen=True)
class LogitsSpec:
    """A request's fixed logit edits, as installed into its slot (made once per request).

    bias_ids/bias_values [K]: the bias row's entries that differ from `bias_base` (0, or -inf
    with allowed_token_ids). flag_ids/flag_bits [F]: prompt and stop tokens. words [W, L]:
    multi-token bad words, right-aligned.
    """

    bias_base: float
    bias_ids: np.ndarray
    bias_values: np.ndarray
    flag_ids: np.ndarray
    flag_bits: np.ndarray
    words: np.ndarray


def logits_spec(params, prompt_ids: list[int], eos_ids, bad_word_ids: list[list[int]]) -> LogitsSpec | None:
    """The edits `params` ask for (None: none, the row samples the model's logits as they are).

    eos_ids: the model's EOS tokens (banned with the stop token ids under min_tokens, unless
    ignore_eos). bad_word_ids: `params.bad_words` tokenized (each one or more token ids).
    """
    penalised = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
    if not (penalised or params.logit_bias or params.allowed_token_ids is not None or bad_word_ids
            or params.min_tokens):
        return None
    allowed = params.allowed_token_ids
    base = 0.0 if allowed is None else -np.inf
    bias = {} if allowed is None else dict.fromkeys(allowed, 0.0)
    for token, value in (params.logit_bias or {}).items():
        if allowed is None or token in bias:  # a bias never re-allows a token outside allowed_token_ids
            bias[int(token)] = bias.get(int(token), 0.0) + float(value)
    words = [w for w in bad_word_ids if len(w) > 1]
    for word in bad_word_ids:
        if len(word) == 1:
            bias[word[0]] = -np.inf
    flags: dict[int, int] = {}
    if params.repetition_penalty != 1:
        for token in prompt_ids:
            flags[token] = PROMPT
    if params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        for token in stops:
            flags[token] = flags.get(token, 0) | STOP
    table = np.full((len(words), MAX_BAD_WORD_TOKENS), ANY, np.int32)  # unused rows (last token ANY) ban nothing
    for i, word in enumerate(words):
        table[i, -len(word):] = word
    return LogitsSpec(base, np.fromiter(bias, np.int32, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)),
                      np.fromiter(flags, np.int32, len(flags)), np.fromiter(flags.values(), np.int8, len(flags)),
                      table)


class ProcessorState(NamedTuple):
    """The per-slot rows (see the module docstring), replicated over the mesh."""

    counts: jax.Array  # [S, V] int32
    flags: jax.Array  # [S, V] int8
    bias: jax.Array  # [S, V] float32
    words: jax.Array  # [S, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32
    history: jax.Array  # [S, MAX_BAD_WORD_TOKENS - 1] int32


def empty_state(num_slots: int, vocab_size: int) -> ProcessorState:
    return ProcessorState(
        jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), jnp.int8),
        jnp.zeros((num_slots, vocab_size), jnp.float32),
        jnp.full((num_slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), ANY, jnp.int32),
        jnp.full((num_slots, MAX_BAD_WORD_TOKENS - 1), NONE, jnp.int32))


class Install(NamedTuple):
    """One admitted request's slot rows, dense (fixed shapes: one compile serves every request)."""

    slot: np.ndarray  # [] int32
    bias: np.ndarray  # [V] float32
    flags: np.ndarray  # [V] int8
    counts: np.ndarray  # [V] int32: the tokens generated so far (after a preemption)
    words: np.ndarray  # [MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32
    history: np.ndarray  # [MAX_BAD_WORD_TOKENS - 1] int32


def make_install(spec: LogitsSpec, slot: int, output_ids: Sequence[int], vocab_size: int) -> Install:
    """The install of an admitted request with `spec` into `slot`, its rows built on the host;
    `output_ids`: the tokens it generated before (after a preemption), counted by the penalties."""
    bias = np.full(vocab_size, spec.bias_base, np.float32)
    bias[spec.bias_ids] = spec.bias_values
    flags = np.zeros(vocab_size, np.int8)
    flags[spec.flag_ids] = spec.flag_bits
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab_size)[:vocab_size].astype(np.int32)
    words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), ANY, np.int32)
    words[: len(spec.words)] = spec.words
    history = np.full(MAX_BAD_WORD_TOKENS - 1, NONE, np.int32)
    tail = list(output_ids)[-(MAX_BAD_WORD_TOKENS - 1):]
    if tail:
        history[-len(tail):] = tail
    return Install(np.int32(slot), bias, flags, counts, words, history)


def install(state: ProcessorState, new: Install) -> ProcessorState:
    """Write an admitted request's rows (a whole row each: nothing of the slot's last owner stays);
    jit it with the state donated (`ModelRunner`)."""
    return ProcessorState(*(table.at[new.slot].set(row) for table, row in zip(
        state, (new.counts, new.flags, new.bias, new.words, new.history))))


class ProcessorRows(NamedTuple):
    """Per-row values of one step, [B] each."""

    uses_state: jax.Array  # bool: the row's request has a LogitsSpec (its slot's rows are its own)
    presence: jax.Array  # float32
    frequency: jax.Array  # float32
    repetition: jax.Array  # float32, 1 = off
    min_tokens: jax.Array  # int32
    generated: jax.Array  # int32: tokens generated before this draw


def apply(logits: jax.Array, state: ProcessorState, slots: jax.Array, rows: ProcessorRows) -> jax.Array:
    """logits [B, V] float32 -> the logits to sample from (rows without a spec unchanged).

    slots [B] int32: each row's slot (padding rows: any value; their result is unused).
    """
    s = jnp.clip(slots, 0, state.counts.shape[0] - 1)
    counts, flags = state.counts[s], state.flags[s]
    x = logits + state.bias[s]
    stop = (flags & STOP) != 0
    x = jnp.where(stop & (rows.generated < rows.min_tokens)[:, None], -jnp.inf, x)
    words, history = state.words[s], state.history[s]  # [B, W, L], [B, L - 1]
    prefix = words[..., :-1]
    matched = jnp.all((prefix == ANY) | (prefix == history[:, None, :]), axis=-1) & (words[..., -1] >= 0)
    banned = jnp.where(matched, words[..., -1], logits.shape[-1])  # V: dropped
    x = x.at[jnp.arange(x.shape[0])[:, None], banned].set(-jnp.inf, mode="drop")
    seen = (counts > 0) | ((flags & PROMPT) != 0)
    repetition = rows.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
    x = x - rows.frequency[:, None] * counts - rows.presence[:, None] * (counts > 0)
    return jnp.where(rows.uses_state[:, None], x, logits)


def record(state: ProcessorState, slots: jax.Array, tokens: jax.Array) -> ProcessorState:
    """Count each row's sampled token in its slot: slots [B] (S: not a sampling row), tokens [B]."""
    counts = state.counts.at[slots, tokens].add(1, mode="drop")
    s = jnp.clip(slots, 0, state.counts.shape[0] - 1)
    history = jnp.concatenate([state.history[s, 1:], tokens[:, None]], axis=1)
    return state._replace(counts=counts, history=state.history.at[slots].set(history, mode="drop"))
