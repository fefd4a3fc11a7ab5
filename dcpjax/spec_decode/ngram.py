"""Prompt lookup (vLLM's "ngram" method): propose what followed the last n tokens before.

For a sequence t[0..L), find earlier occurrences of its suffix t[L-n..L) for the largest n in
[prompt_lookup_min, prompt_lookup_max] that has one, take the latest such occurrence (the most
recent context is the best guess), and propose the tokens that followed it. When that continuation
runs into the end of the sequence it continues periodically: a match ending p tokens before the end
says the text repeats with period p, so a loop of one or two tokens still yields k drafts.

Host work per sequence and step is O(L) vectorised numpy over a token buffer that grows in place
(not a list conversion per step).
"""

from __future__ import annotations

import weakref

import numpy as np

from dcpjax.sequence import ScheduledRow, Sequence


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to k proposed next tokens for `tokens` [L] int32 (empty: no earlier occurrence of even
    the last n_min tokens)."""
    length = len(tokens)
    if length < n_min + 1 or k < 1:
        return tokens[:0]
    # ends[i]: where an earlier occurrence would end (its last token equals the sequence's last one)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    matched = np.ones(len(ends), np.int32)  # suffix tokens matched backwards from each end
    alive = np.ones(len(ends), bool)
    for back in range(1, min(n_max, length - 1)):
        at = ends - back
        same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - back])
        alive &= same
        matched += alive
        if not alive.any():
            break
    best = matched.max(initial=0)
    if best < n_min:
        return tokens[:0]
    end = ends[np.flatnonzero(matched == best)[-1]]  # the latest of the longest matches
    follow = tokens[end + 1 :]  # its continuation, to the end: the last length - 1 - end tokens
    if len(follow) >= k:
        return follow[:k]
    return np.resize(follow, k)  # continue the repeat with its period


class NgramProposer:
    """Drafts for a step's decode rows by prompt lookup over each sequence's prompt + output."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        # per sequence: (buffer, tokens copied into it); dropped with the sequence
        self._buffers: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens as int32 numpy, appended in place as it grows (amortised O(new))."""
        buffer, filled = self._buffers.get(seq, (None, 0))
        length = seq.length
        if buffer is None or len(buffer) < length:
            buffer = np.empty(max(2 * length, 64), np.int32)
            buffer[:length] = seq.token_ids
        elif filled < length:
            buffer[filled:length] = seq.token_ids[filled:length]
        self._buffers[seq] = buffer, length
        return buffer[:length]

    def propose(self, rows: list[ScheduledRow], block_tables: np.ndarray | None = None) -> list[list[int]]:
        """Each row's drafts (at most its `lookahead`; none for a row without room)."""
        return [propose_ngram(self._tokens(row.seq), row.lookahead, self.n_min, self.n_max).tolist()
                if row.lookahead > 0 else [] for row in rows]

    def after_prefill(self, rows: list[ScheduledRow], block_tables: np.ndarray) -> None:
        """Nothing to keep up to date (the draft model's proposer mirrors prefill chunks here)."""
