"""What the runner keeps of each running request, keyed by request id (vLLM's `InputBatch`): the
request's fixed sampling values, packed once into the call's field columns, and what its logits
processors need at admission. Filled from each `ScheduledCall`'s `new_requests`, emptied by its
`finished_request_ids`; the engine's `Sequence` objects never reach it."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpjax.runner.messages import NewRequestData, ScheduledCall
from dcpjax.runner.step_input import request_values


@dataclasses.dataclass(frozen=True)
class RequestState:
    data: NewRequestData
    values: np.ndarray  # [len(step_input.REQUEST_FIELDS)] int32: its packed sampling values


class RequestStates:
    """The running requests the runner has heard of, by id."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def update(self, call: ScheduledCall) -> None:
        """Forget the finished requests, then learn the newly admitted ones (in that order: an id may be
        reused by a new request once the old one finished)."""
        for request_id in call.finished_request_ids:
            self._states.pop(request_id, None)
        for new in call.new_requests:
            values = request_values(new.params, new.seed, new.logits_spec is not None)
            self._states[new.request_id] = RequestState(new, values)

    def __getitem__(self, request_id: str) -> RequestState:
        try:
            return self._states[request_id]
        except KeyError:
            raise KeyError(f"the runner was never told of request {request_id!r}: its first chunk after admission "
                           "must come with its NewRequestData") from None

    def __len__(self) -> int:
        return len(self._states)
