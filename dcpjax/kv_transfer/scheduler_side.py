"""The connector's scheduler-side half (vLLM v1's `KVConnectorBase_V1` scheduler role): which
requests' KV is remote, what the buffer may still hold, what the runner must save and load.

The scheduler asks it, and only it, about transfers:

- `can_admit(seq)`: a prefill server admits a `do_remote_decode` prompt only while its KV fits in
  `kv_buffer_size` with every transfer not yet pulled (reserved at admission, freed when the producer
  stops holding it), so the held bytes never pass the bound, whatever the concurrency: a prompt that
  does not fit waits in the queue.
- `num_remote_tokens(seq)`: a decode request whose prompt's KV comes from a prefill server. The
  scheduler allocates its blocks and slot like any admission (so the consumer's pool bounds what can
  arrive), then `update_state_after_alloc` records the load, and the sequence waits until the runner
  reports it written (`update_connector_output`); a failed load makes it compute its prompt here.
- `request_finished(seq)`: a prefill server's finished prompt gets its handle
  (`seq.kv_transfer_params`) and a save; its blocks stay allocated until the runner has read them.
- `build_connector_meta()`: the saves and loads since the last step, for the runner
  (`KVConnectorMetadata`).
"""

from __future__ import annotations

import threading
import uuid

from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.kv_transfer.layout import KVLayout
from dcpjax.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput, LoadSpec, SaveSpec
from dcpjax.kv_transfer.params import KVTransferParams, prompt_digest
from dcpjax.sequence import Sequence
from dcpjax.sharding import layout


def transfer_params(seq: Sequence) -> KVTransferParams | None:
    """The request's parsed kv_transfer_params (None: an ordinary request). The request builder
    parses them once, so this is a KVTransferParams."""
    return (seq.params.extra_args or {}).get("kv_transfer_params")


class KVConnectorScheduler:
    """See the module docstring. `address`: what the producer's transport advertises (its handle's
    `remote_address`); `pads_wire`: its arrays travel padded to the gather's bucket of blocks (a device
    transport, which cannot trim without a compile per length), else trimmed to each rank's tokens."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, vocab_size: int, *, address: dict | None = None,
                 pads_wire: bool = False, release=None):
        self.config, self.layout, self.address, self.pads_wire = config, layout, address or {}, pads_wire
        self.vocab_size = vocab_size
        self.release = release or (lambda params: None)  # frees a handle's KV on its producer (the worker's)
        self.max_bytes = int(config.kv_buffer_size)
        self._lock = threading.Lock()  # the reservations: `reserved_bytes` may be read from any thread
        self._reserved: dict[str, int] = {}  # request id (admitted) or key (saved) -> bytes, until the transfer ends
        self._saves: list[SaveSpec] = []
        self._loads: list[LoadSpec] = []
        self._local: set[str] = set()  # decode requests whose KV is here (loaded) or computed here (failed)
        self._loading: set[str] = set()  # decode requests whose load is under way (its pull frees the KV)
        self._ended_while_loading: set[str] = set()
        self._offered: set[str] = set()  # keys of saves sent to the runner, until the sender lets them go

    # -- what a request needs --------------------------------------------------------------------
    def transfer_bytes(self, num_tokens: int) -> int:
        """What a prompt's KV takes in the buffer (and on the wire): padded on a device transport."""
        return self.layout.kv_bytes(num_tokens, self.pads_wire)

    def request_problem(self, params: KVTransferParams, num_prompt_tokens: int, max_tokens: int | None,
                        num_draws: int, prompt_ids) -> str | None:
        """What this server cannot do of a request's kv_transfer_params (None: fine)."""
        role = self.config.kv_role
        if params.do_remote_decode:
            if not self.config.is_producer:
                return (f"kv_transfer_params.do_remote_decode needs a prefill server (kv_role kv_producer); this one "
                        f"is {role}")
            if max_tokens != 1 or num_draws != 1:
                return "kv_transfer_params.do_remote_decode needs max_tokens 1 and n 1 (the decode server goes on)"
            if (need := self.transfer_bytes(num_prompt_tokens)) > self.max_bytes:
                return (f"this prompt's KV ({need:,} bytes) is larger than the prefill server's kv_buffer_size "
                        f"({self.max_bytes:,}): raise kv_buffer_size in --kv-transfer-config, or send a shorter prompt")
        if params.do_remote_prefill:
            if not self.config.is_consumer:
                return (f"kv_transfer_params.do_remote_prefill needs a decode server (kv_role kv_consumer); this one "
                        f"is {role}")
            if num_draws != 1:
                return "kv_transfer_params.do_remote_prefill needs n 1 (one sequence per transferred prompt)"
            return self._handle_problem(params, prompt_ids)
        return None

    def _handle_problem(self, params: KVTransferParams, prompt_ids) -> str | None:
        """A handle this server cannot load (another model, prompt or transport)."""
        fix = "send the prefill server's kv_transfer_params unchanged"
        if params.kv_connector != self.config.kv_connector:
            return (f"kv_transfer_params.kv_connector is {params.kv_connector!r}, this decode server's is "
                    f"{self.config.kv_connector!r}: give both servers the same kv_connector")
        try:
            sender = KVLayout.from_dict(params.kv_layout)
        except ValueError as err:
            return f"kv_transfer_params.{err}: {fix}"
        if problems := self.layout.compatibility_problems(sender):
            return f"the prefill server at {params.remote_host} runs another model: {'; '.join(problems)}"
        if params.first_token.id >= self.vocab_size:
            return (f"kv_transfer_params.first_token.id {params.first_token.id} is not a token of this model's "
                    f"{self.vocab_size}: {fix}")
        if params.prompt_sha256 != prompt_digest(prompt_ids) or params.num_tokens != len(prompt_ids):
            return (f"the prefill server's KV is of another prompt ({params.num_tokens} tokens, this request has "
                    f"{len(prompt_ids)}): send the decode server the prompt the prefill server ran")
        return None

    # -- producer --------------------------------------------------------------------------------
    def can_admit(self, seq: Sequence) -> bool:
        """Whether `seq` may start now: a do_remote_decode prompt reserves its KV's bytes in the buffer
        (False: not yet, the buffer holds transfers still to be pulled)."""
        params = transfer_params(seq)
        if params is None or not params.do_remote_decode or seq.request_id in self._reserved:
            return True
        need = self.transfer_bytes(seq.num_prompt_tokens)
        with self._lock:
            if sum(self._reserved.values()) + need > self.max_bytes:
                return False
            self._reserved[seq.request_id] = need
        return True

    def request_finished(self, seq: Sequence) -> bool:
        """A sequence leaves the engine (finished, aborted or failed). A finished do_remote_decode
        prompt gets its handle and a save: True when the scheduler must keep its blocks until the
        runner reports them read (`KVConnectorOutput.saved`). A decode request that ends before its KV
        was loaded or while it waited for it (aborted while queued) frees that KV on its producer now;
        one whose load is under way leaves it to the load (acknowledged, or released if it fails)."""
        params = transfer_params(seq)
        if params is not None and params.do_remote_prefill and seq.request_id not in self._local | self._loading:
            self.release(params)
        if seq.request_id in self._loading:
            self._ended_while_loading.add(seq.request_id)  # forgotten once its load reports
        self._local.discard(seq.request_id)
        if params is None or not params.do_remote_decode:
            return False
        with self._lock:
            need = self._reserved.pop(seq.request_id, None)
        if seq.finish_reason == "abort" or need is None or seq.slot is None:
            return False
        key = f"{seq.request_id}-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._reserved[key] = need
        num_tokens = seq.num_prompt_tokens
        used = layout.blocks_needed(num_tokens, self.layout.block_size, self.layout.dcp)
        blocks = tuple(tuple(group[:used]) for group in seq.blocks)  # per KV cache group
        self._saves.append(SaveSpec(seq.request_id, key, blocks, seq.slot, num_tokens, need))
        first = seq.output_ids[0]
        entries = [[tid, lp.logprob, lp.rank] for tid, lp in seq.logprobs[0].items()] if seq.logprobs else None
        seq.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False, "kv_connector": self.config.kv_connector,
            "remote_host": self.address.get("host"), "remote_port": self.address.get("port"),
            "remote_address": self.address, "remote_request_id": key, "num_tokens": num_tokens,
            "wire_tokens": self.layout.padded_tokens(num_tokens) if self.pads_wire else None,
            "kv_layout": self.layout.as_dict(),
            "prompt_sha256": prompt_digest(seq.prompt_ids), "transfer_bytes": need, "seed": seq.seed,
            "first_token": {"id": first, "logprobs": entries, "cumulative_logprob": seq.cumulative_logprob}}
        return True

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the buffer taken: prompts admitted for a remote decode, and transfers not yet pulled."""
        with self._lock:
            return sum(self._reserved.values())

    # -- consumer --------------------------------------------------------------------------------
    def num_remote_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` whose KV comes from a prefill server (its prompt), 0 if none or no longer."""
        params = transfer_params(seq)
        if params is None or not params.do_remote_prefill or seq.request_id in self._local:
            return 0
        return seq.num_prompt_tokens

    def update_state_after_alloc(self, seq: Sequence) -> None:
        """The scheduler gave `seq` its blocks and slot: its load goes to the runner next."""
        self._loading.add(seq.request_id)
        self._loads.append(LoadSpec(seq.request_id, transfer_params(seq), tuple(map(tuple, seq.blocks)), seq.slot))

    # -- the runner's messages -------------------------------------------------------------------
    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(tuple(self._saves), tuple(self._loads))
        self._offered.update(save.key for save in self._saves)
        self._saves, self._loads = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The runner's report: transfers ended free their bytes; a failed load's request computes here."""
        with self._lock:
            for key in output.finished_sending:
                self._reserved.pop(key, None)
                self._offered.discard(key)
        # loaded, or given up: a preempted sequence then computes its prompt here, never pulls again
        self._local.update(output.finished_recving)
        self._local.update(output.failed_recving)
        reported = {*output.finished_recving, *output.failed_recving}
        self._loading -= reported
        self._local -= self._ended_while_loading & reported
        self._ended_while_loading -= reported

    def reset(self) -> None:
        """After a failed step (the engine frees every block): saves and loads not yet sent are dropped,
        with their reservations; transfers the sender holds stay counted until it reports them."""
        with self._lock:
            self._reserved = {key: n for key, n in self._reserved.items() if key in self._offered}
        self._saves, self._loads = [], []
        self._local.clear()
        self._loading.clear()
        self._ended_while_loading.clear()
