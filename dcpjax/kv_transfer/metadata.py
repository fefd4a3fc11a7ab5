"""The connector's two step messages (vLLM v1's `KVConnectorMetadata` and `KVConnectorOutput`): plain,
immutable data of request ids, keys and block ids, like the scheduler's other messages to the runner.

    scheduler -> runner   `KVConnectorMetadata`: the prompts to save (a prefill server: gather their
                          blocks and offer them under a key) and to load (a decode server: pull a
                          handle's KV into the blocks the scheduler allocated)
    runner -> scheduler   `KVConnectorOutput`: saves staged (their blocks may be freed), transfers a
                          producer no longer holds (their bytes leave the buffer), loads finished or
                          failed (the sequence decodes, or computes its prompt itself)
"""

from __future__ import annotations

from typing import NamedTuple

from dcpjax.kv_transfer.params import KVTransferParams


class SaveSpec(NamedTuple):
    """A finished prompt whose KV a decode server will pull: positions [0, num_tokens) in `block_ids`,
    a hybrid model's state in `slot`, offered under `key` (`nbytes` as it travels)."""

    request_id: str
    key: str
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group (`models.kv_groups`)
    slot: int
    num_tokens: int
    nbytes: int


class LoadSpec(NamedTuple):
    """A decode request whose prompt's KV (the handle `params`) goes into `block_ids` and `slot`."""

    request_id: str
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group (`models.kv_groups`)
    slot: int


class KVConnectorMetadata(NamedTuple):
    saves: tuple[SaveSpec, ...] = ()
    loads: tuple[LoadSpec, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class KVConnectorOutput(NamedTuple):
    """saved: request ids whose blocks were read (free them); finished_sending: keys a producer no
    longer holds (pulled, released or expired); finished_recving / failed_recving: request ids whose
    load wrote their blocks, or failed (after its retries)."""

    saved: tuple[str, ...] = ()
    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()
