"""Log-probabilities in the API's three shapes: completions (OpenAI's legacy form, with echo),
chat (`choices[].logprobs.content`), and vLLM's `prompt_logprobs`.

Entries come from the engine as `{token_id: Logprob(logprob, rank, decoded_token)}`: the
chosen (or prompt) token first, then the most likely tokens by rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dcpjax.outputs import Logprob

Entry = dict[int, Logprob]


def _top(entry: Entry, top: int) -> list[tuple[int, Logprob]]:
    """The `top` most likely tokens of an entry, by rank."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top]
    return sorted(ranked, key=lambda item: item[1].rank)


def completion_logprobs(piece: Callable[[int], str], tokens: Sequence[int], entries: Sequence[Entry | None],
                        top: int, text_start: int = 0) -> dict:
    """OpenAI's completions form: tokens, token_logprobs, top_logprobs, text_offset.

    entries[i] belongs to tokens[i]; None (the first prompt token under echo) gives nulls.
    top_logprobs hold the chosen token and the `top` most likely ones, as OpenAI and vLLM do.
    """
    texts = [piece(t) for t in tokens]
    offsets, at = [], text_start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e[t].logprob for e, t in zip(entries, tokens)],
        "top_logprobs": [None if e is None else {piece(k): v.logprob for k, v in [(t, e[t]), *_top(e, top)]}
                         for e, t in zip(entries, tokens)],
        "text_offset": offsets,
    }


def chat_logprobs(piece: Callable[[int], str], tokens: Sequence[int], entries: Sequence[Entry], top: int) -> dict:
    """OpenAI's chat form: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def one(token: int, logprob: Logprob) -> dict:
        text = piece(token)
        return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [one(t, e[t]) | {"top_logprobs": [one(k, v) for k, v in _top(e, top)]}
                        for t, e in zip(tokens, entries)]}


def prompt_logprobs(entries: Sequence[Entry | None] | None, top: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {"<token id>": {logprob,
    rank, decoded_token}} for the prompt token and the `top` most likely ones."""
    if entries is None:
        return None

    def one(entry: Entry) -> dict:
        token = next(iter(entry))  # the prompt token comes first
        kept = [(token, entry[token]), *_top(entry, top)]
        return {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token} for t, v in kept}

    return [None if e is None else one(e) for e in entries]
