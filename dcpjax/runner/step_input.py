"""A model call's inputs as one flat int32 array (one host-to-device transfer): its layout, the
host side that packs it and the device side that unpacks it, side by side.

Two layouts (`CallShape.kind`), both a grid of B rows x T tokens:
  "decode" / "verify"  B sequences, one row each: T = 1 (decode), or T = 1 + k (a verify row:
                       the input and k drafts; also a draft model's catch-up), R = B sampling rows;
  "prefill" / "prompt" one packed row (B = 1) of N = T tokens: several sequences' chunks back to
                       back, and their block tables too (the row's table is their concatenation;
                       `page_offsets` says where each token's sequence's blocks begin). R =
                       `packed_samples(N)` sampling rows. "prompt" also returns the logprob of
                       each token's next prompt token (`targets`).

    flat = [tokens | positions | from_slot | seq_slots | page_offsets (packed) | targets (prompt)]  each [B * T]
         + [block tables [G, B, W]] + [fields [R, F]]

G: one block table per KV cache group (`models.kv_groups`; 1 without sliding-window layers).

A padding token has position -1 (never stored, sees nothing) and seq_slot num_slots (no state);
a padding sampling row has slot = num_slots (its writes are dropped). `seq_slots` is each token's
sequence's slot, where a linear-attention layer keeps that sequence's state. Each field is one
int32 column per sampling row; the float fields travel bit-cast.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PACKED_KINDS = ("prefill", "prompt")
KINDS = ("decode", "verify", *PACKED_KINDS)


class CallShape(NamedTuple):
    """The static shape of one model call: its compile key (`dcpjax.runner.shape_grid`).

    kind: "decode" | "verify" | "prefill" | "prompt" (see the module docstring); rows: B;
    chunk: T tokens per row; width: W block-table entries per row and group; samples: R sampling
    rows; groups: G block tables per row.
    """

    kind: str
    rows: int
    chunk: int
    width: int
    samples: int
    groups: int = 1

    @property
    def packed(self) -> bool:
        return self.kind in PACKED_KINDS

    @property
    def token_arrays(self) -> tuple[str, ...]:
        """The per-token arrays of this layout, in order."""
        return (("tokens", "positions", "from_slot", "seq_slots") + (("page_offsets",) if self.packed else ())
                + (("targets",) if self.kind == "prompt" else ()))

    def __str__(self) -> str:
        rows = f"{self.rows} rows x {self.chunk} token{'s' if self.chunk > 1 else ''}" if not self.packed else \
            f"{self.chunk} tokens"
        return f"{self.kind} call of {rows}, block-table width {self.width}, {self.samples} sampling rows"

    @property
    def size(self) -> int:
        """Length of the flat array."""
        tokens = self.rows * self.chunk
        return len(self.token_arrays) * tokens + self.tables_size + self.samples * len(FIELDS)

    @property
    def tables_size(self) -> int:
        return self.groups * self.rows * self.width


class StepFields(NamedTuple):
    """Per sampling row values of a call, [R] each (on the device: unpacked; float fields as float32)."""

    sample_at: jax.Array  # flat index (b * T + t) of the row's last token: its logits are the row's
    count: jax.Array  # tokens of the row's chunk (0: padding row)
    slot: jax.Array  # the sequence's slot (num_slots: padding)
    samples: jax.Array  # 1: sample a token after the chunk
    temperature: jax.Array  # float; TEMPERATURE .. WANTS_LOGPROBS are the request's fixed values
    top_k: jax.Array
    top_p: jax.Array  # float
    min_p: jax.Array  # float
    seed: jax.Array  # uint32 as int32
    presence: jax.Array  # float
    frequency: jax.Array  # float
    repetition: jax.Array  # float
    min_tokens: jax.Array
    uses_state: jax.Array  # 1: the request edits its logits (`logits_processors`)
    wants_logprobs: jax.Array  # 1: the request reports its samples' logprobs
    counter: jax.Array  # tokens generated before this step's draw (the draw's index)


FIELDS = StepFields._fields
COLUMN = {name: i for i, name in enumerate(FIELDS)}
FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence", "frequency", "repetition"})
REQUEST_FIELDS = FIELDS[COLUMN["temperature"] : COLUMN["wants_logprobs"] + 1]  # fixed for a request's life


class StepInput(NamedTuple):
    """The unpacked call on the device: per-token arrays [B, T], block tables [G, B, W], the fields [R]."""

    tokens: jax.Array
    positions: jax.Array
    from_slot: jax.Array  # the slot whose last sample is this token (-1: the host's token)
    seq_slots: jax.Array  # the slot of the token's sequence (num_slots: padding)
    page_offsets: jax.Array | None  # packed layouts only
    targets: jax.Array | None  # "prompt" only: the next prompt token (-1: none)
    block_tables: jax.Array
    fields: StepFields


def unpack(flat: jax.Array, shape: CallShape) -> StepInput:
    """flat [shape.size] int32 -> its named parts (inside the jitted step)."""
    b, t, n = shape.rows, shape.chunk, shape.rows * shape.chunk
    arrays, offset = {}, 0
    for name in shape.token_arrays:
        arrays[name] = flat[offset : offset + n].reshape(b, t)
        offset += n
    tables = flat[offset : offset + shape.tables_size].reshape(shape.groups, b, shape.width)
    return StepInput(arrays["tokens"], arrays["positions"], arrays["from_slot"], arrays["seq_slots"],
                     arrays.get("page_offsets"), arrays.get("targets"), tables,
                     unpack_fields(flat[offset + shape.tables_size :]))


def unpack_fields(meta: jax.Array) -> StepFields:
    """The fields part of a flat input, [R * F] int32 -> named [R] columns (floats bit-cast back)."""
    meta = meta.reshape(-1, len(FIELDS))
    return StepFields(**{name: jax.lax.bitcast_convert_type(meta[:, i], jnp.float32) if name in FLOAT_FIELDS
                         else meta[:, i] for i, name in enumerate(FIELDS)})


def request_values(params, seed: int, uses_state: bool) -> np.ndarray:
    """A request's REQUEST_FIELDS as int32 (floats bit-cast), [len(REQUEST_FIELDS)]."""
    top_k = min(max(params.top_k, 0), 2**31 - 1)  # past the vocabulary it keeps everything: same draw
    values = {"temperature": params.temperature, "top_k": top_k, "top_p": params.top_p, "min_p": params.min_p,
              "seed": np.uint32(seed % 2**32).view(np.int32), "presence": params.presence_penalty,
              "frequency": params.frequency_penalty, "repetition": params.repetition_penalty,
              "min_tokens": params.min_tokens, "uses_state": int(uses_state),
              "wants_logprobs": int(params.needs_logprobs)}
    return np.array([np.float32(values[f]).view(np.int32) if f in FLOAT_FIELDS else values[f]
                     for f in REQUEST_FIELDS], np.int32)


class PackedCall:
    """The host side: a flat array for `shape` to fill by name (padding everywhere to start with).

    Per-token arrays are [B, T] views, the block tables a [G, B, W] view, a field a column of the
    [R, F] view; n of the R sampling rows are real."""

    def __init__(self, shape: CallShape, num_rows: int, num_slots: int):
        self.shape, self.n = shape, num_rows
        self.array = np.zeros(shape.size, np.int32)
        b, t, offset = shape.rows, shape.chunk, 0
        self._tokens = {}
        for name in shape.token_arrays:
            self._tokens[name] = self.array[offset : offset + b * t].reshape(b, t)
            offset += b * t
        end = offset + shape.tables_size
        self.block_tables = self.array[offset:end].reshape(shape.groups, b, shape.width)
        self._meta = self.array[end:].reshape(shape.samples, len(FIELDS))
        for name in ("positions", "from_slot", "targets"):
            if name in self._tokens:
                self._tokens[name][:] = -1
        self._tokens["seq_slots"][:] = num_slots  # padding tokens: no sequence
        self._meta[:, COLUMN["slot"]] = num_slots  # padding rows: no slot

    def tokens(self, name: str) -> np.ndarray:
        """The [B, T] view of per-token array `name` (`CallShape.token_arrays`)."""
        return self._tokens[name]

    def set(self, name: str, values, row: int | None = None) -> None:
        """Field `name` of the real sampling rows (or of one `row`), ints (a float field: floats)."""
        values = np.asarray(values, np.float32).view(np.int32) if name in FLOAT_FIELDS else values
        rows = slice(0, self.n) if row is None else slice(row, row + 1)
        self._meta[rows, COLUMN[name]] = values

    def set_request_values(self, values: np.ndarray) -> None:
        """REQUEST_FIELDS of the real rows, [n, len(REQUEST_FIELDS)] int32 (`request_values`)."""
        first = COLUMN[REQUEST_FIELDS[0]]
        self._meta[: self.n, first : first + len(REQUEST_FIELDS)] = values
