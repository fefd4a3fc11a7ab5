"""Offline generation's progress bar (vLLM's `LLM.generate(use_tqdm=True)`): prompts done of all,
and the output tokens so far with their rate, so a long run is never silent. tqdm leaves the bar
out where stderr is not a terminal (a log file, a pipe, CI)."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from dcpjax.sequence import Sequence

REFRESH_SECONDS = 0.5  # the token count is a sum over every sequence: not every step


class GenerationProgress:
    """A bar over `requests` (each prompt's completions: one list of sequences per prompt); a prompt
    counts as done when its every completion is. Use as a context manager; `enabled` False: no bar;
    `file`: where it draws (stderr)."""

    def __init__(self, requests: list[list[Sequence]], enabled: bool, file=None):
        self.requests = requests
        self._prompt_of = {id(seq): i for i, seqs in enumerate(requests) for seq in seqs}
        self._left = [len(seqs) for seqs in requests]
        # disable=None: tqdm shows the bar only on a terminal
        self.bar = tqdm(total=len(requests), desc="Generating", unit="prompt", disable=None if enabled else True,
                        file=file)
        self._start = self._shown = time.monotonic()

    def __enter__(self) -> GenerationProgress:  # noqa: PYI034 (Self needs Python 3.11's typing; this reads as well)
        return self

    def __exit__(self, *exc) -> None:
        self._show_tokens()
        self.bar.close()

    def finished(self, seq: Sequence) -> None:
        """One completion is done (the engine's on_finish)."""
        prompt = self._prompt_of[id(seq)]
        self._left[prompt] -= 1
        if not self._left[prompt]:
            self.bar.update()

    def stepped(self) -> None:
        """One engine step is done (the engine's on_step): the output tokens, now and then."""
        if not self.bar.disable and time.monotonic() - self._shown >= REFRESH_SECONDS:
            self._show_tokens()

    def _show_tokens(self) -> None:
        if self.bar.disable:
            return
        self._shown = time.monotonic()
        tokens = sum(seq.num_output_tokens for seqs in self.requests for seq in seqs)
        rate = tokens / max(self._shown - self._start, 1e-9)
        self.bar.set_postfix_str(f"output {tokens:,} tokens, {rate:,.1f} tok/s", refresh=True)
