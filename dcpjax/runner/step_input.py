"""A step's inputs as one packed int32 array (one host-to-device transfer): its layout, the host
side that packs it and the device side that unpacks it, side by side.

    packed [B, T + P + len(FIELDS)] int32 = [tokens [B, T] | block tables [B, P] | fields [B, F]]

T is the chunk (tokens per row), P the block-table width; both are compile keys, B too. Each
field is one int32 column per row; the float fields travel bit-cast. A padding row (B is a
power of two) has slot = num_slots (its writes are dropped) and count 0.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dcpjax.sampling import pow2_at_least


class StepFields(NamedTuple):
    """Per-row values of a step, [B] each (on the device: unpacked; float fields as float32)."""

    start: jax.Array  # first position of the chunk
    count: jax.Array  # tokens of the chunk (0: padding row)
    slot: jax.Array  # the sequence's slot (num_slots: padding)
    device_input: jax.Array  # 1: the chunk's one input token is the slot's last sample, on the device
    samples: jax.Array  # 1: sample a token after the chunk
    temperature: jax.Array  # float; TEMPERATURE .. USES_STATE are the request's fixed values
    top_k: jax.Array
    top_p: jax.Array  # float
    min_p: jax.Array  # float
    seed: jax.Array  # uint32 as int32
    presence: jax.Array  # float
    frequency: jax.Array  # float
    repetition: jax.Array  # float
    min_tokens: jax.Array
    uses_state: jax.Array  # 1: the request edits its logits (`logits_processors`)
    counter: jax.Array  # tokens generated before this step's draw (the draw's index)
    next: jax.Array  # the prompt token after the chunk (its last position's prompt logprob), or -1


FIELDS = StepFields._fields
COLUMN = {name: i for i, name in enumerate(FIELDS)}
FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence", "frequency", "repetition"})
REQUEST_FIELDS = FIELDS[COLUMN["temperature"] : COLUMN["uses_state"] + 1]  # fixed for a request's life


class StepInput(NamedTuple):
    """The unpacked step on the device: tokens [B, T], block tables [B, P], and the fields."""

    tokens: jax.Array
    block_tables: jax.Array
    fields: StepFields


def unpack(packed: jax.Array, chunk: int) -> StepInput:
    """packed [B, T + P + F] int32 (T = `chunk`) -> its named parts (inside the jitted step)."""
    width = packed.shape[1] - chunk - len(FIELDS)
    meta = packed[:, chunk + width :]
    columns = {name: jax.lax.bitcast_convert_type(meta[:, i], jnp.float32) if name in FLOAT_FIELDS else meta[:, i]
               for i, name in enumerate(FIELDS)}
    return StepInput(packed[:, :chunk], packed[:, chunk : chunk + width], StepFields(**columns))


def request_values(params, seed: int, uses_state: bool) -> np.ndarray:
    """A request's REQUEST_FIELDS as int32 (floats bit-cast), [len(REQUEST_FIELDS)]."""
    top_k = min(max(params.top_k, 0), 2**31 - 1)  # past the vocabulary it keeps everything: same draw
    values = {"temperature": params.temperature, "top_k": top_k, "top_p": params.top_p, "min_p": params.min_p,
              "seed": np.uint32(seed % 2**32).view(np.int32), "presence": params.presence_penalty,
              "frequency": params.frequency_penalty, "repetition": params.repetition_penalty,
              "min_tokens": params.min_tokens, "uses_state": int(uses_state)}
    return np.array([np.float32(values[f]).view(np.int32) if f in FLOAT_FIELDS else values[f]
                     for f in REQUEST_FIELDS], np.int32)


class RequestCache:
    """What the runner packs of each request and that never changes (its REQUEST_FIELDS), made once
    per request and dropped with it (a weak reference: the engine owns the request)."""

    def __init__(self) -> None:
        self._values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def values(self, seq) -> np.ndarray:
        cached = self._values.get(seq)
        if cached is None:
            cached = self._values[seq] = request_values(seq.params, seq.seed, seq.logits_spec is not None)
        return cached


class PackedStep:
    """The host side: a zeroed packed array for B rows (n of them real) to fill by name."""

    def __init__(self, batch: int, num_rows: int, chunk: int, width: int, num_slots: int):
        self.array = np.zeros((batch, chunk + width + len(FIELDS)), np.int32)
        self.n, self.chunk, self.width = num_rows, chunk, width
        self._meta = self.array[:, chunk + width :]
        self._meta[:, COLUMN["slot"]] = num_slots  # padding rows: no slot
        self._meta[:, COLUMN["next"]] = -1

    @property
    def tokens(self) -> np.ndarray:
        """[B, T] view: the chunks' input tokens."""
        return self.array[:, : self.chunk]

    @property
    def block_tables(self) -> np.ndarray:
        """[B, P] view."""
        return self.array[:, self.chunk : self.chunk + self.width]

    def set(self, name: str, values, row: int | None = None) -> None:
        """Column `name` of the real rows (or of one `row`), ints (a float field: floats)."""
        values = np.asarray(values, np.float32).view(np.int32) if name in FLOAT_FIELDS else values
        rows = slice(0, self.n) if row is None else slice(row, row + 1)
        self._meta[rows, COLUMN[name]] = values

    def set_request_values(self, values: np.ndarray) -> None:
        """REQUEST_FIELDS of the real rows, [n, len(REQUEST_FIELDS)] int32 (from `RequestCache`)."""
        first = COLUMN[REQUEST_FIELDS[0]]
        self._meta[: self.n, first : first + len(REQUEST_FIELDS)] = values


def width_bucket(pages: int) -> int:
    """The block-table width a step with rows of up to `pages` blocks compiles for: a power of
    two up to 8, then 8, 12, 16, 24, 32, 48, ... (2^k and 1.5 x 2^k). Attention reads every page
    of the width: powers of two alone read up to twice what the rows hold, these steps less than
    1.5 times, for one extra compile per octave."""
    pow2 = pow2_at_least(pages)
    return pow2 * 3 // 4 if pow2 >= 16 and pages <= pow2 * 3 // 4 else pow2
