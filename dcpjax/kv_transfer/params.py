"""A request's `kv_transfer_params` (vLLM's field), parsed once: the OpenAI body's field is this
model, and an offline `SamplingParams.extra_args["kv_transfer_params"]` dict is parsed into it by the
request builder. Everything after reads typed fields.

Two shapes, as vLLM's connectors use them:

- a prefill request: `{"do_remote_decode": true}`, and (from the router) `client_max_tokens`, the
  output the client asked of the pair, so the prefill server refuses prompt + output past
  max_model_len before it runs the prompt;
- a decode request: the handle a prefill server returned (`do_remote_prefill: true`, where and under
  which key the KV waits, the transport, the producer's `kv_layout`, the prompt's digest, the first
  token the producer sampled with its logprobs, and the seed it sampled with).

No JAX here: the router and the server's protocol import it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

FIX = "send the prefill server's kv_transfer_params unchanged"


class FirstToken(BaseModel):
    """The token the producer sampled after the prompt: id, logprob entries [id, logprob, rank] (the
    sampled one first) when logprobs were asked for, and the running sum of its logprobs."""

    model_config = ConfigDict(extra="forbid")
    id: Annotated[StrictInt, Field(ge=0)]
    logprobs: list[tuple[StrictInt, StrictFloat | StrictInt, StrictInt]] | None = None
    cumulative_logprob: StrictFloat | StrictInt | None = None


class KVTransferParams(BaseModel):
    """What a request says of prefill/decode disaggregation (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    # a prefill request's: the client's max_tokens for the whole pair (the prefill itself asks for 1)
    client_max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    # the handle (do_remote_prefill): where the KV waits and what it is
    kv_connector: StrictStr | None = None
    remote_host: StrictStr | None = None
    remote_port: Annotated[StrictInt, Field(gt=0, lt=65536)] | None = None
    remote_address: dict[str, Any] | None = None  # the transport's own address fields
    remote_request_id: StrictStr | None = None
    num_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    wire_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # tokens per rank as padded on the wire
    kv_layout: dict[str, Any] | None = None
    prompt_sha256: StrictStr | None = None
    transfer_bytes: Annotated[StrictInt, Field(ge=0)] | None = None
    seed: StrictInt | None = None
    first_token: FirstToken | None = None

    @model_validator(mode="after")
    def _one_role(self) -> KVTransferParams:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params sets both do_remote_decode (a prefill request) and "
                             "do_remote_prefill (a decode request): send one")
        if self.do_remote_prefill:
            missing = [k for k in HANDLE_FIELDS if getattr(self, k) is None]
            if missing:
                raise ValueError(f"kv_transfer_params lacks {missing}: {FIX}")
        return self

    @classmethod
    def parse(cls, value) -> KVTransferParams:
        """A dict (offline, or a proxy's JSON) or an instance; ValueError naming the first problem."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(value).__name__}")  # noqa: TRY004
        try:
            return cls.model_validate(value)
        except ValueError as err:  # pydantic's ValidationError: one line per problem; keep the first
            errors = getattr(err, "errors", list)()
            if errors:
                first = errors[0]
                where = ".".join(str(x) for x in first["loc"])
                message = first["msg"].removeprefix("Value error, ")
                if message.startswith("kv_transfer_params"):  # the model's own check: whole already
                    raise ValueError(message) from None
                raise ValueError(f"kv_transfer_params{'.' + where if where else ''}: {message} ({FIX})") from None
            raise


HANDLE_FIELDS = ("kv_connector", "remote_host", "remote_port", "remote_address", "remote_request_id", "num_tokens",
                 "kv_layout", "prompt_sha256", "first_token")


def prompt_digest(ids) -> str:
    """What a handle carries of the prompt, for the consumer's check: a hash, not the ids (a
    million-token prompt's ids would be megabytes of JSON)."""
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()
