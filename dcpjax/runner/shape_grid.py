"""The finite set of shapes a model call can take, and the rounding of a call onto it.

Every model call is rounded up to a point of this grid, so the shapes a configuration can
dispatch are known before the first request: `dcpjax.runner.precompile` compiles each of them
at start-up, and no request ever waits for XLA (vLLM captures a CUDA graph per batch size;
tpu-inference precompiles its token and request paddings).

  rows B     decode and verify calls (one row per sequence): powers of two up to max_num_seqs.
  tokens N   packed calls (`step_input`: prefill chunks of several sequences in one row): powers
             of two from `MIN_PACKED_TOKENS` up to the token budget; prompt-logprobs calls up to
             their own budget.
  widths W   block-table entries per row. An attention kernel that walks only the pages inside
             each query's bound (the GPU Pallas kernel: a loop with a traced trip count) takes
             the whole table: one width. One that reads every page of the width (the jnp
             reference, as on CPU; the TPU kernel, whose grid spans the pages) gets powers of
             two from `MIN_WIDTH_TOKENS` per rank up to the table: a call reads at most twice
             the pages its longest row needs. A packed call's table holds its rows' tables back
             to back: its widths go up to what a full token budget of new sequences fills.
  samples R  decode / verify: B; packed: min(N, the largest row bucket): every sequence of a
             packed call has a token, and at most max_num_seqs run. The sampler is its own
             small program keyed by R (`SamplerShape`).

So a configuration has about |B| x |W| decode calls and |N| x |W| prefill calls, not their
product with each other and with every sampling variant.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from dcpjax.runner.step_input import CallShape
from dcpjax.sampling import pow2_at_least

MIN_WIDTH_TOKENS = 128  # per DCP rank: narrower tables read too little to be worth a compile of their own
MIN_PACKED_TOKENS = 16  # fewer tokens cost about as much (a step of so few reads the weights, computes little)


def powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two from `low` (a power of two) up to the first >= high."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


class SamplerShape(NamedTuple):
    """The static shape of a sampler call: R sampling rows, T positions each (verify: 1 + k)."""

    samples: int
    chunk: int

    def __str__(self) -> str:
        return f"sampler call of {self.samples} rows x {self.chunk} position{'s' if self.chunk > 1 else ''}"


@dataclasses.dataclass(frozen=True)
class ShapeGrid:
    """The bucket lists of one engine (see the module docstring).

    rows, tokens, prompt_tokens, widths (rows layout), packed_widths: ascending buckets;
    tokens_per_block: a virtual block's positions (block_size x DCP); whole_table: attention
    reads only the pages within bounds; verify_chunk: 1 + k with speculative decoding, else 0.
    """

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    widths: tuple[int, ...]
    packed_widths: tuple[int, ...]
    tokens_per_block: int
    whole_table: bool = False
    verify_chunk: int = 0
    packed_align: int = 1  # a packed call's sequences start at multiples of this (linear attention's chunk)
    kv_groups: int = 1  # block tables per row: one per KV cache group (`models.kv_groups`)

    @classmethod
    def build(cls, *, max_num_seqs: int, max_num_batched_tokens: int, prompt_logprobs_tokens: int,
              blocks_per_seq: int, block_size: int, dcp: int, whole_table: bool,
              num_speculative_tokens: int = 0, packed_align: int = 1, kv_groups: int = 1) -> ShapeGrid:
        """The grid of an engine. whole_table: attention walks only the pages within bounds (one width)."""
        floor = pow2_at_least(-(-MIN_WIDTH_TOKENS // block_size))
        widths = lambda top: (top,) if whole_table else tuple(
            [w for w in powers_of_two(floor, top) if w < top] + [top])
        budget, prompt_budget = max_num_batched_tokens, min(max_num_batched_tokens, prompt_logprobs_tokens)
        least = lambda most: max(min(MIN_PACKED_TOKENS, pow2_at_least(most)), pow2_at_least(packed_align))
        # a packed call of new sequences: each row's tokens, and at most one part-filled page each
        packed_top = max(blocks_per_seq, -(-budget // (block_size * dcp)) + min(max_num_seqs, budget))
        return cls(
            rows=tuple(powers_of_two(1, max_num_seqs)),
            tokens=tuple(powers_of_two(least(budget), budget)),
            prompt_tokens=tuple(powers_of_two(least(prompt_budget), prompt_budget)),
            widths=widths(blocks_per_seq),
            packed_widths=widths(packed_top),
            tokens_per_block=block_size * dcp,
            whole_table=whole_table,
            verify_chunk=1 + num_speculative_tokens if num_speculative_tokens else 0,
            packed_align=packed_align,
            kv_groups=kv_groups,
        )

    # -- rounding a call onto the grid -------------------------------------------------------------
    @staticmethod
    def _bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")

    def row_bucket(self, rows: int) -> int:
        return self._bucket(self.rows, rows, "rows")

    def token_bucket(self, tokens: int, prompt: bool = False) -> int:
        return self._bucket(self.prompt_tokens if prompt else self.tokens, tokens, "tokens")

    def width_bucket(self, pages: int, packed: bool = False) -> int:
        return self._bucket(self.packed_widths if packed else self.widths, pages, "pages")

    @property
    def max_packed_width(self) -> int:
        """The most pages a packed call's table holds (a packed call over it is split)."""
        return self.packed_widths[-1]

    def packed_samples(self, tokens: int) -> int:
        """R of a packed call of `tokens` (a bucket)."""
        return min(tokens, self.rows[-1])

    def rows_call(self, rows: int, pages: int, chunk: int = 1, verify: bool = False) -> CallShape:
        """The shape of a decode (chunk 1), verify or catch-up (chunk 1 + k) call."""
        b = self.row_bucket(rows)
        return CallShape("verify" if verify else "decode", b, chunk, self.width_bucket(pages), b, self.kv_groups)

    def packed_call(self, tokens: int, pages: int, prompt: bool = False) -> CallShape:
        """The shape of a packed call of `tokens` tokens over `pages` concatenated pages."""
        n = self.token_bucket(tokens, prompt)
        return CallShape("prompt" if prompt else "prefill", 1, n, self.width_bucket(pages, packed=True),
                         self.packed_samples(n), self.kv_groups)

    # -- every shape a runner can meet (for the precompile) ------------------------------------------
    def _least_pages(self, tokens: int) -> int:
        """The fewest pages a packed call in token bucket `tokens` can hold: more than half the
        bucket's tokens (the one below it holds the rest)."""
        if self.packed_align > 1:  # aligned places: a row of 1 token takes a whole chunk
            return 1
        fewest_tokens = tokens // 2 + 1 if tokens > self.tokens[0] else 2
        return -(-fewest_tokens // self.tokens_per_block)

    def call_shapes(self, *, prompt_logprobs: bool = True, catch_up: bool = False) -> list[CallShape]:
        """Every model call shape of a runner: decode, packed prefill, prompt logprobs (a target
        model's, `prompt_logprobs`), verify (with speculation), and a draft model's catch-up
        rows of 1 + k tokens (`catch_up`: a draft runner's, instead of verify and prompt logprobs)."""
        shapes = []
        for rows in self.rows:
            for width in self.widths:
                shapes.append(self.rows_call(rows, width))
                if self.verify_chunk:
                    shapes.append(self.rows_call(rows, width, self.verify_chunk, verify=not catch_up))
        packed = [(n, False) for n in self.tokens] + ([(n, True) for n in self.prompt_tokens]
                                                      if prompt_logprobs else [])
        for tokens, prompt in packed:
            least = self._least_pages(tokens)
            for width in self.packed_widths:
                if width >= least:  # fewer pages cannot hold the tokens
                    shapes.append(self.packed_call(tokens, width, prompt))
        return list(dict.fromkeys(shapes))

    def sampler_shapes(self) -> list[SamplerShape]:
        """Every sampler call: R of each call shape, and verify's R x (1 + k)."""
        samples = sorted(set(self.rows) | {self.packed_samples(n) for n in self.tokens + self.prompt_tokens})
        return [SamplerShape(r, 1) for r in samples] + (
            [SamplerShape(r, self.verify_chunk) for r in self.rows] if self.verify_chunk else [])

    def describe(self) -> str:
        """One line for the logs: the buckets."""
        spec = f", verify chunk {self.verify_chunk}" if self.verify_chunk else ""
        return (f"rows {list(self.rows)}, tokens {list(self.tokens)} (prompt logprobs up to {self.prompt_tokens[-1]}), "
                f"block-table widths {list(self.widths)} (packed calls {list(self.packed_widths)}){spec}")
