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

The state is allocated the first time a request needs it (a step without such a request does
not pass it), replicated over the mesh like the slot tokens. Values per row (the penalties,
min_tokens, whether the row uses its slot's state) travel in the packed step input.
"""

from __future__ import annotations

import dataclasses
import functools
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
    """Rows to (re)write at admission, [A, ...] each, padded: slot = S and ids = V are dropped."""

    slots: np.ndarray  # [A] int32
    bias_base: np.ndarray  # [A] float32
    bias_ids: np.ndarray  # [A, K] int32
    bias_values: np.ndarray  # [A, K] float32
    flag_ids: np.ndarray  # [A, F] int32
    flag_bits: np.ndarray  # [A, F] int8
    output_ids: np.ndarray  # [A, O] int32: the tokens generated so far (after a preemption)
    words: np.ndarray  # [A, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32
    history: np.ndarray  # [A, MAX_BAD_WORD_TOKENS - 1] int32


def _padded(arrays: list[np.ndarray], fill, dtype) -> np.ndarray:
    """Ragged rows -> [A, a power of two >= the longest] (few compile keys)."""
    width = 1 << max(0, (max(len(a) for a in arrays) - 1).bit_length())
    out = np.full((len(arrays), width), fill, dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


def make_install(seqs, num_slots: int, vocab_size: int) -> Install:
    """The install of the admitted sequences `seqs` (each with a `logits_spec`)."""
    rows = 1 << max(0, (len(seqs) - 1).bit_length())
    pad = rows - len(seqs)
    specs = [s.logits_spec for s in seqs]
    history = np.full((rows, MAX_BAD_WORD_TOKENS - 1), NONE, np.int32)
    words = np.full((rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), ANY, np.int32)
    for i, (seq, spec) in enumerate(zip(seqs, specs)):
        words[i, : len(spec.words)] = spec.words
        tail = seq.output_ids[-(MAX_BAD_WORD_TOKENS - 1):]
        if tail:
            history[i, -len(tail):] = tail
    ragged = lambda get, fill, dtype: _padded([get(x) for x in zip(seqs, specs)] + [np.zeros(0)] * pad, fill, dtype)
    return Install(
        np.array([s.slot for s in seqs] + [num_slots] * pad, np.int32),
        np.array([sp.bias_base for sp in specs] + [0.0] * pad, np.float32),
        ragged(lambda x: x[1].bias_ids, vocab_size, np.int32), ragged(lambda x: x[1].bias_values, 0, np.float32),
        ragged(lambda x: x[1].flag_ids, vocab_size, np.int32), ragged(lambda x: x[1].flag_bits, 0, np.int8),
        ragged(lambda x: np.asarray(x[0].output_ids, np.int32), vocab_size, np.int32), words, history)


@functools.partial(jax.jit, donate_argnums=0)
def install(state: ProcessorState, new: Install) -> ProcessorState:
    """Write the admitted requests' rows (a whole row each: nothing of the slot's last owner stays)."""
    a, v = new.bias_ids.shape[0], state.bias.shape[1]
    rows = jnp.arange(a)[:, None]
    bias = jnp.broadcast_to(new.bias_base[:, None], (a, v)).at[rows, new.bias_ids].set(new.bias_values, mode="drop")
    flags = jnp.zeros((a, v), jnp.int8).at[rows, new.flag_ids].set(new.flag_bits, mode="drop")
    counts = jnp.zeros((a, v), jnp.int32).at[rows, new.output_ids].add(1, mode="drop")
    put = lambda table, value: table.at[new.slots].set(value, mode="drop")
    return ProcessorState(put(state.counts, counts), put(state.flags, flags), put(state.bias, bias),
                          put(state.words, new.words), put(state.history, new.history))


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
