"""The scheduler's sequences whose KV moves through the KV connector (prefill/decode
disaggregation, `dcpjax.kv_transfer`), between the scheduler's own queues:

- `loading`: a decode server's sequences holding blocks and a slot while their prompt's KV arrives;
- `loaded`: arrived, admitted at the next schedule with one row for their first token;
- `saving`: a prefill server's finished prompts whose blocks the runner has still to read.

`report` applies the runner's `KVConnectorOutput` through the scheduler's own `release` (blocks and
slot back) and `requeue` (a failed load computes its prompt here) callbacks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from dcpjax.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput
from dcpjax.sequence import Sequence


class TransferQueues:
    def __init__(self, connector=None):
        self.connector = connector  # the connector's scheduler side, or None
        self.loading: dict[str, Sequence] = {}
        self.loaded: collections.deque[Sequence] = collections.deque()
        self.saving: dict[str, Sequence] = {}
        self.waits_for_buffer = False  # the queue's head waits for the transfer buffer (last schedule)

    def __bool__(self) -> bool:
        return bool(self.loading or self.loaded or self.saving)

    def meta(self) -> KVConnectorMetadata:
        """The saves and loads for the runner since the last call (empty without a connector)."""
        return self.connector.build_connector_meta() if self.connector is not None else KVConnectorMetadata()

    def report(self, output: KVConnectorOutput, release: Callable[[Sequence], None],
               requeue: Callable[[Sequence], None]) -> None:
        """The runner's report: saved prompts free their blocks; a loaded prompt waits for its first
        row; a failed load computes its prompt here (a sequence aborted meanwhile just frees)."""
        self.connector.update_connector_output(output)
        for request_id in output.saved:
            release(self.saving.pop(request_id))
        for request_id in output.finished_recving:
            seq = self.loading.pop(request_id)
            if seq.finished:
                release(seq)
            else:
                seq.num_computed = seq.num_tokens - 1
                self.loaded.append(seq)
        for request_id in output.failed_recving:
            seq = self.loading.pop(request_id)
            release(seq)
            if not seq.finished:
                seq.num_computed = 0
                requeue(seq)
