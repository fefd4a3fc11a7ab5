"""The request body, read, and what a prefill/decode pair cannot do refused (400) up front.

A prefill server hands one prompt's KV to one decode sequence, and its own answer (one
token) stays with the router. So several sequences per prompt (`n`, `best_of`), several
prompts per request, and what only the prefill server computes (`prompt_logprobs`, the
echoed prompt's logprobs) cannot be split over the two hops. Refusing them before any
backend is contacted names the field and the fix, instead of a backend's puzzling error
or, worse, a prefill whose KV nobody pulls.
"""

from __future__ import annotations

import json

from dcpjax.serve.errors import APIError

ONE_SEQUENCE = ("a prefill/decode pair decodes one sequence per prompt: send n=1 through the P/D router (or send "
                "this request to a server of its own)")


def _reject_constant(name: str):
    """json.loads accepts NaN and Infinity; JSON does not (and the backends would choke on them)."""
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; an APIError 400 for anything else (never a 500 for bad input)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # ValueError: also bad UTF-8; RecursionError: absurd nesting
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object (Content-Type: application/json), not "
                            f"{type(body).__name__}")
    return body


def _as_number(value) -> float | None:
    """`value` as the number the backend would read it as ("2" and 2.0 both count as 2), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def several_prompts(prompt) -> bool:
    """A completions `prompt` holding more than one prompt: a list of strings or of token-id lists
    with more than one entry (a list whose first element is an int is ONE prompt, its token ids)."""
    return isinstance(prompt, list) and len(prompt) > 1 and not (isinstance(prompt[0], int)
                                                                 and not isinstance(prompt[0], bool))


def check_pd_request(body: dict, *, completions: bool) -> None:
    """APIError 400 (naming the field in `param`) for what one prefill + one decode cannot serve;
    everything else goes through untouched, for the backends to judge."""
    for field in ("n", "best_of"):
        value = _as_number(body.get(field))
        if value is not None and value > 1:
            raise APIError(400, f"{field}={body[field]}: {ONE_SEQUENCE}", param=field)
    if body.get("prompt_logprobs") is not None:
        raise APIError(400, "prompt_logprobs: the prefill server computes the prompt and its answer stays with the "
                            "router, so a P/D pair cannot return them: drop prompt_logprobs (or send this request "
                            "to a server of its own)", param="prompt_logprobs")
    if not completions:
        return
    if body.get("echo") not in (None, False):
        raise APIError(400, "echo: the prompt's logprobs are computed on the prefill server, whose answer stays "
                            "with the router: drop echo (or send this request to a server of its own)", param="echo")
    if several_prompts(body.get("prompt")):
        raise APIError(400, f"prompt: {len(body['prompt'])} prompts in one request; the P/D router takes one "
                            "prompt per request (a string, or one list of token ids): send one request per prompt",
                       param="prompt")
