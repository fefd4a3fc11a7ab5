"""SocketConnector: the TCP transport (`wire`, `store`, `server`, `client`).

The producer holds host copies of each prompt's arrays (a device array offered is copied to the host
on the sender's own thread) and sends them as one message per pull; the consumer reads them into
numpy arrays. It needs nothing but sockets, so it works between any two hosts and backends.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import client
from ..server import OpHandler, TransferServer
from ..store import HeldTransfers
from ..wire import TransferError
from .base import ExpectedArrays, KVReceiver, KVSender, PullResult, check_connector, payload_nbytes

logger = logging.getLogger(__name__)


def _is_device_array(value) -> bool:
    return not isinstance(value, np.ndarray) and hasattr(value, "addressable_shards")


class HeldSender(KVSender):
    """A store of reservations and payloads behind a TransferServer (the TCP control and data channel);
    what a payload is held as is `_prepare`'s (host arrays here; device arrays in a subclass)."""

    name = "SocketConnector"

    def __init__(self, host: str, port: int, *, max_bytes: int, timeout_s: float,
                 on_sent: Callable[[str, int, float], None] | None = None,
                 on_released: Callable[[str], None] | None = None,
                 on_expired: Callable[[list[str]], None] | None = None,
                 fault: dict | None = None, sweep_interval_s: float = 1.0):
        self.host, self.timeout_s, self.fault = host, float(timeout_s), dict(fault or {})
        self.store = HeldTransfers(timeout_s, int(max_bytes))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"dcpjax-kv-{self.name}")
        self.server = TransferServer(self.store, host, port, fault=self.fault, on_sent=on_sent,
                                     on_expired=on_expired, on_released=on_released,
                                     sweep_interval_s=sweep_interval_s, extra_ops=self._extra_ops(),
                                     on_sweep=self._on_sweep).start()

    def _extra_ops(self) -> dict[str, OpHandler]:
        return {}

    def _on_sweep(self) -> None:
        pass

    @property
    def address(self) -> dict:
        return {"connector": self.name, "host": self.host, "port": self.server.port}

    # -- payloads ----------------------------------------------------------------------------------
    def _ready(self, arrays: Mapping[str, Any]) -> bool:
        """Whether arrays can be held as they are (no copy to make)."""
        return all(isinstance(a, np.ndarray) for a in arrays.values())

    def _start(self, arrays: Mapping[str, Any]) -> None:
        """On the caller's thread, before `_prepare` is queued: start what runs asynchronously."""
        for a in arrays.values():
            if _is_device_array(a):
                a.copy_to_host_async()  # enqueued: the copy runs while the caller goes on

    def _prepare(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """On the sender's thread: the payload as it is held (host arrays)."""
        return {name: np.asarray(a) for name, a in arrays.items()}

    def _checked(self, key: str, arrays: dict[str, Any], reserved: int | None) -> dict[str, Any]:
        if not isinstance(arrays, Mapping) or not all(isinstance(n, str) for n in arrays):
            raise TransferError(f"KV transfer {key!r}: the payload must map array names to arrays, got {type(arrays)}")
        nbytes = payload_nbytes(arrays)
        if reserved is not None and nbytes > reserved:
            raise TransferError(f"KV transfer {key!r}: its {nbytes} bytes pass the {reserved} reserved for it "
                                "(reserve what the payload holds: the producer's bound counts reservations)")
        return dict(arrays)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        try:
            return self._executor.submit(fn)
        except RuntimeError as err:  # the sender closed
            future = concurrent.futures.Future()
            future.set_exception(TransferError(f"the KV sender is closed: {err}"))
            return future

    def _chain(self, key: str, source: concurrent.futures.Future) -> concurrent.futures.Future:
        """A Future of the prepared payload once `source` (a Future of the arrays) is done, without a
        thread waiting for it meanwhile."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not out.set_running_or_notify_cancel():
                return  # withdrawn or expired meanwhile
            try:
                arrays = self._checked(key, source.result(), self.store.nbytes(key))
                self._start(arrays)
                out.set_result(self._prepare(arrays))
            except BaseException as err:  # noqa: BLE001 - the pull reports it
                out.set_exception(err)

        def queue(_) -> None:
            try:
                self._executor.submit(run)
            except RuntimeError as err:  # the sender closed
                if out.set_running_or_notify_cancel():
                    out.set_exception(TransferError(f"the KV sender is closed: {err}"))

        source.add_done_callback(queue)
        return out

    # -- KVSender ----------------------------------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> bool:
        return self.store.reserve(key, nbytes)

    def offer(self, key: str, arrays) -> None:
        reserved = self.store.nbytes(key)
        if reserved is None:
            raise TransferError(f"KV transfer {key!r} was not reserved (or was withdrawn): reserve its bytes first")
        if isinstance(arrays, concurrent.futures.Future):
            self.store.offer(key, self._chain(key, arrays))
            return
        arrays = self._checked(key, arrays, reserved)
        if self._ready(arrays):
            self.store.offer(key, arrays)
            return
        self._start(arrays)
        self.store.offer(key, self._submit(lambda: self._prepare(arrays)))

    def withdraw(self, key: str) -> int | None:
        return self.store.remove(key)

    @property
    def held_bytes(self) -> int:
        return self.store.held_bytes

    def keys(self) -> list[str]:
        return self.store.keys()

    def close(self) -> None:
        self.server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.clear()


class SocketSender(HeldSender):
    """The TCP transport's producer side: host copies, served by `server.TransferServer`."""

    name = "SocketConnector"
    device_arrays = False


class SocketReceiver(KVReceiver):
    """The TCP transport's consumer side: numpy arrays (`client.pull`)."""

    name = "SocketConnector"

    def __init__(self, *, timeout_s: float = 30.0, retries: int = 1, release_timeout_s: float = 5.0):
        self.timeout_s, self.retries, self.release_timeout_s = float(timeout_s), int(retries), float(release_timeout_s)

    def pull(self, address: Mapping, key: str, expected: ExpectedArrays) -> PullResult:
        check_connector(address, self.name)
        return client.pull(address["host"], int(address["port"]), key, timeout_s=self.timeout_s,
                           retries=self.retries, expected=expected)

