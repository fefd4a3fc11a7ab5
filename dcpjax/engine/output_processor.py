"""What the host does with a step's sampled tokens: append, detokenize, stop, report.

O(1) host work per token and sequence: the token goes onto the sequence's one token
list, text grows through an incremental decoder, and stop strings are searched only
in the new tail (plus the longest stop string's length - 1 characters before it).
A row whose sequence already finished (a stop seen one step late under asynchronous
scheduling, or an abort) is dropped, so no token leaks past a stop.

A verify row (speculative decoding) appends its accepted drafts (as many as the step counted)
and the token after them one by one, stopping at the first stop condition. The scheduler's state
(what is computed, what is pending) is the scheduler's: `Scheduler.update_from_output` runs first.
"""

from __future__ import annotations

from collections.abc import Iterable

from dcpjax.outputs import CompletionOutput, Logprob, RequestOutput
from dcpjax.runner.messages import ModelRunnerOutput, SampledLogprobs
from dcpjax.sequence import ScheduledRow, Sequence
from dcpjax.text.tokenizer import decode_stream


class OutputProcessor:
    """Sampled tokens -> each sequence's tokens, logprobs, text and finish reason."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer, self.eos = tokenizer, frozenset(eos_token_ids)

    def process(self, rows: list[ScheduledRow], output: ModelRunnerOutput) -> list[Sequence]:
        """Apply one call's samples (`output`, row i for `rows[i]`); returns the sequences this call
        finished (a row whose sequence had already finished is dropped)."""
        finished, tokens, accepted = [], output.sampled_token_ids, output.num_accepted
        for i, row in enumerate(rows):
            if output.prompt_logprobs is not None and row.wants_prompt_logprobs and not row.seq.finished:
                self._record_prompt_logprobs(row, output.prompt_logprobs, i)
            seq = row.seq
            if not row.samples or seq.finished:
                continue  # nothing sampled, or stopped (or aborted) after this step was scheduled
            if accepted is not None:  # a verify row: its accepted drafts, then the next sample
                for j in range(int(accepted[i]) + 1):
                    self.append(seq, int(tokens[i, j]), output.logprobs, (i, j))
                    if seq.finished:
                        break  # nothing past a stop
            else:
                self.append(seq, int(tokens[i]), output.logprobs, (i,))
            if seq.finished:
                finished.append(seq)
        return finished

    def append(self, seq: Sequence, token: int, logprobs: SampledLogprobs | None = None, at: tuple = (0,)) -> None:
        """Add one sampled token to `seq`: its logprobs (`logprobs` at index `at`), text, stop checks."""
        seq.token_ids.append(token)
        params = seq.params
        if params.needs_logprobs and logprobs is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + float(logprobs.logprobs[at])
            if params.logprobs is not None:
                seq.logprobs.append(self._entry(token, logprobs, at, params.logprobs))
        self._check_stop(seq, token)

    def _entry(self, token: int, values: SampledLogprobs, at: tuple, top: int) -> dict[int, Logprob]:
        """{token: its Logprob, then the `top` most likely tokens'} from `values` at index `at`."""
        entry = {token: Logprob(float(values.logprobs[at]), int(values.ranks[at]), self._piece(token))}
        for rank, (tid, lp) in enumerate(zip(values.top_ids[at], values.top_logprobs[at])):
            if rank < top and int(tid) not in entry:
                entry[int(tid)] = Logprob(float(lp), rank + 1, self._piece(int(tid)))
        return entry

    def _record_prompt_logprobs(self, row, prompt: SampledLogprobs, i: int) -> None:
        """The logprobs of the prompt tokens after each position of the chunk (each prompt token's
        once: a chunk recomputed after a preemption adds nothing)."""
        seq = row.seq
        for t in range(row.count):
            target = row.start + t + 1
            if target >= seq.num_prompt_tokens:
                break
            if target == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(self._entry(seq.token_ids[target], prompt, (i, t),
                                                       seq.params.prompt_logprobs))

    def _piece(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_text(token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if not params.ignore_eos and token in self.eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finished:  # EOS and stop token ids are not part of the text
            self._final_text(seq, seq.output_ids[:-1])
            return
        if self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.detokenizer, seq.text = decode_stream(self.tokenizer), ""
            before = len(seq.text)
            seq.text += seq.detokenizer.step(token)
            # as vLLM: stop strings count once the output is longer than min_tokens
            if (params.stop and seq.num_output_tokens > params.min_tokens
                    and (hit := _first_stop(seq.text, params.stop, before)) is not None):
                at, stop = hit
                seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if seq.length >= seq.max_total:
            seq.finish_reason = "length"
            self._final_text(seq, seq.output_ids)

    def _final_text(self, seq: Sequence, ids: list[int]) -> None:
        """The whole text decoded once at the end: exactly `tokenizer.decode`, whatever the
        incremental decoder held back (an unfinished character, say), as long as it only
        extends what may already have been streamed (after a decoder restart it might not)."""
        if self.tokenizer is not None:
            full = self.tokenizer.decode(ids)
            if seq.text is None or full.startswith(seq.text):
                seq.text = full

    @staticmethod
    def make_output(seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=seq.text, token_ids=seq.output_ids, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        )
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_ids), [completion], finished=seq.finished,
                             num_cached_tokens=seq.num_cached_tokens,
                             prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                             kv_transfer_params=seq.kv_transfer_params)


def _first_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string that ends after `new_from` (text before it was searched already)."""
    longest = max(len(s) for s in stops)
    start = max(0, new_from - longest + 1)
    hits = [(at, s) for s in stops if (at := text.find(s, start)) >= 0]
    return min(hits) if hits else None
