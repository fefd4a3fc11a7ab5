"""JaxTransferConnector: device to device with `jax.experimental.transfer`, a TCP control channel beside it.

The producer keeps each prompt's arrays where they are (each on ONE of its devices: the per-device
shards the gather produced; a host array is put on the sender's device) and serves them with a jax
transfer server; the consumer pulls each array onto one of its own devices (`device`,
SingleDeviceSharding) and re-shards them itself. jax's transfer API (the same in jax 0.10.2 and 0.12)
has no completion notice, no cancellation and no failure for an unknown id (a pull of an id nobody
offered waits; a dtype pulled as another is reinterpreted bytes), so a small control channel
(`server.TransferServer`'s connection, the socket transport's, with an op of its own) does what it
lacks. One pull attempt on one TCP connection:

    consumer -> {"op": "jax_pull", "key": K}
    producer -> {"key": K, "entries": [{"name", "dtype", "shape"}, ...]}   or {"error": ...}: refused
    consumer    checks the entries against what it expects (a mismatch: refused, nothing pulled)
    consumer -> {"op": "go", "key": K}
    producer    await_pull(uuid, arrays) under a fresh random 63-bit uuid (one per attempt: keys never
                map to uuids, so a retry never meets a half-consumed entry of an earlier attempt)
    producer -> {"key": K, "uuid": U}
    consumer    pulls U; waits for each array while watching the control connection (the producer
                gone: its end closes, the attempt fails at once) and the clock (no array for timeout_s:
                the attempt fails); a failed attempt poisons its jax connection (its pending buffers
                are freed) and is retried on fresh connections
    consumer -> {"op": "ack", "key": K}           the producer frees K and reports it (on_sent)

What jax keeps after that: an attempt's registration is dropped by jax once the consumer has asked for
all its arrays; one nobody asks for (a consumer that died between "go" and its pull) keeps the arrays
referenced until its `register_timeout_s` deadline passes and the sender's sweeper pokes jax's table
(jax checks deadlines only when an id is offered), so up to register_timeout_s + a sweep after the
key itself was freed. A consumer's pull of an id whose registration is gone fails at the producer's
next poke after the pull's own deadline (timeout_s), or when the connection fails; the control
channel's clock fails it first anyway. jax's connection to an address that does not answer retries
every 2 s for as long as the connection object lives: the receiver opens one only after the control
channel answered from the same host.
"""

from __future__ import annotations

import datetime
import logging
import math
import secrets
import select
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer

from .. import client, wire
from ..server import REQUEST_HEADER_BYTES, OpHandler
from ..wire import TransferError, resolve_dtype
from .base import ExpectedArrays, KVReceiver, PullResult, Refused, check_connector, expected_problem, payload_nbytes
from .socket import HeldSender, _is_device_array

logger = logging.getLogger(__name__)

OP = "jax_pull"


def _deadline(seconds: float) -> datetime.datetime:
    """jax's timeouts are absolute times."""
    return datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _start_server(device, host: str, port: int, transfer_size: int, parallel_copies: int):
    """A jax transfer server on host:port whose bulk data goes over sockets on host (with no transport
    address jax uses an in-process queue, which another process cannot reach)."""
    return jax_transfer.start_transfer_server(device.client, _join(host, port), [_join(host, 0)],
                                              max_num_parallel_copies=parallel_copies, transfer_size=transfer_size)


def _port_of(server) -> int:
    return int(server.address().rsplit(":", 1)[1])


class JaxTransferSender(HeldSender):
    """The producer side (see the module docstring). Beyond KVSender's arguments: device, where host
    arrays are put (default: this process's first local device); transfer_port, the jax transfer
    server's port (0: one the system picks; `address["transfer_port"]` says which); transfer_size and
    parallel_copies, jax's chunking of a transfer (bytes per chunk, chunks in flight)."""

    name = "JaxTransferConnector"
    device_arrays = True
    register_timeout_s = 60.0  # how long an attempt's arrays wait in jax's table for the consumer's pull

    def __init__(self, host: str, port: int, *, max_bytes: int, timeout_s: float, on_sent=None, on_released=None,
                 on_expired=None, fault: dict | None = None, device=None, transfer_port: int = 0,
                 transfer_size: int = 64 << 20, parallel_copies: int = 8, sweep_interval_s: float = 1.0):
        self.device = device if device is not None else jax.local_devices()[0]
        try:
            self._transfer = _start_server(self.device, host, transfer_port, transfer_size, parallel_copies)
        except Exception as err:
            raise OSError(f"the KV transfer's jax transfer server cannot listen on {_join(host, transfer_port)} "
                          f"({err}): pass another transfer_port (0 picks a free one)") from err
        self.transfer_port = _port_of(self._transfer)
        self._poke_uuid = secrets.randbits(63)
        super().__init__(host, port, max_bytes=max_bytes, timeout_s=timeout_s, on_sent=on_sent,
                         on_released=on_released, on_expired=on_expired, fault=fault,
                         sweep_interval_s=sweep_interval_s)

    def _extra_ops(self) -> dict[str, OpHandler]:
        return {OP: self._serve_pull}

    @property
    def address(self) -> dict:
        return {**super().address, "transfer_port": self.transfer_port}

    # -- payloads: each array on one device --------------------------------------------------------
    def _ready(self, arrays: Mapping[str, Any]) -> bool:
        return all(_is_device_array(a) and len(a.sharding.device_set) == 1 for a in arrays.values())

    def _start(self, arrays: Mapping[str, Any]) -> None:
        pass

    def _prepare(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for name, a in arrays.items():
            if not _is_device_array(a):
                a = jax.device_put(np.asarray(a), self.device)
            elif len(a.sharding.device_set) > 1:
                a = a.addressable_shards[0].data  # fully replicated (checked): any copy is the array
            out[name] = a
        return out

    def _checked(self, key: str, arrays, reserved: int | None) -> dict[str, Any]:
        arrays = super()._checked(key, arrays, reserved)
        for name, a in arrays.items():
            if _is_device_array(a) and len(a.sharding.device_set) > 1 and not a.is_fully_replicated:
                raise TransferError(f"KV transfer {key!r}: {name!r} is sharded over {len(a.sharding.device_set)} "
                                    f"devices; {self.name} moves arrays each on one device (offer each shard under "
                                    "its own name: a pull in another layout would get the wrong bytes)")
        return arrays

    # -- the control channel's op ------------------------------------------------------------------
    def _serve_pull(self, sock: socket.socket, key: str, request: dict) -> bool:
        try:
            arrays = self.store.get(key, self.server.ready_wait_s)
        except (KeyError, TransferError) as err:
            self.server.refuse(sock, err)
            return True
        wire.send_message(sock, {"key": key, "entries": wire.entries(arrays)})
        go, _ = wire.receive_message(sock, max_header_bytes=REQUEST_HEADER_BYTES)
        if go.get("op") != "go" or go.get("key") != key:
            raise TransferError(f"KV transfer {key}: expected 'go', got {go!r}")
        started = time.perf_counter()
        offered = [a for a in arrays.values() if a.size]  # an empty array never completes a pull: not sent
        fault = self.server.take_fault()
        if fault is not None:
            kind, limit = fault
            logger.warning("KV transfer %s: the %s_after_bytes test hook (%d bytes)", key, kind, limit)
            if kind == "stall":
                offered = None  # nothing to pull: the consumer waits for arrays that never come
            else:
                whole, total = 0, 0
                for a in offered:
                    total += payload_nbytes({"a": a})
                    if total > limit:
                        break
                    whole += 1
                offered = offered[:whole]  # the arrays past the cut are not there: their pulls fail
        uuid = secrets.randbits(63)
        if offered:
            self._transfer.await_pull(uuid, offered, timeout=_deadline(self.register_timeout_s))
        wire.send_message(sock, {"key": key, "uuid": uuid})
        return self.server.await_ack(sock, key, started)

    def _on_sweep(self) -> None:
        """jax drops expired registrations (and fails pulls waiting past their deadline) only when an id
        is offered: offer an empty one, already expired, each sweep."""
        transfer = self._transfer
        if transfer is not None:
            transfer.await_pull(self._poke_uuid, [], timeout=_deadline(-1.0))

    def close(self) -> None:
        super().close()
        transfer, self._transfer = self._transfer, None
        if transfer is not None and hasattr(transfer, "_reset_rendevous_table"):
            transfer._reset_rendevous_table()  # what nobody pulled is no longer referenced


class JaxTransferReceiver(KVReceiver):
    """The consumer side (see the module docstring): `PullResult.arrays` are jax.Arrays on `device`
    (default: this process's first local device). host: where this receiver's jax transfer server and
    its bulk sockets listen; the producer connects back to them, so across hosts it must be an
    address of this host the producer reaches (the consumer's kv_ip)."""

    name = "JaxTransferConnector"
    poll_s = 0.002  # how often a pull looks at its arrays and its control connection

    def __init__(self, *, timeout_s: float = 30.0, retries: int = 1, device=None, host: str = "127.0.0.1",
                 transfer_size: int = 64 << 20, parallel_copies: int = 8, release_timeout_s: float = 5.0):
        self.timeout_s, self.retries, self.release_timeout_s = float(timeout_s), int(retries), float(release_timeout_s)
        self.device = device if device is not None else jax.local_devices()[0]
        self.host, self._chunking = host, (transfer_size, parallel_copies)
        self._lock = threading.Lock()
        self._server = None

    def _transfer_server(self):
        with self._lock:
            if self._server is None:
                self._server = _start_server(self.device, self.host, 0, *self._chunking)
            return self._server

    def pull(self, address: Mapping, key: str, expected: ExpectedArrays) -> PullResult:
        check_connector(address, self.name)
        host, port, transfer_port = address["host"], int(address["port"]), int(address["transfer_port"])
        started = time.perf_counter()
        attempts = max(0, self.retries) + 1
        last: OSError | None = None
        for attempt in range(1, attempts + 1):
            try:
                arrays = self._pull_once(host, port, transfer_port, key, expected)
            except Refused as err:
                err.attempts = attempt
                raise
            except OSError as err:  # TransferError included: a broken attempt
                last = err
                logger.info("KV transfer %s from %s:%d: attempt %d of %d failed: %s", key, host, port, attempt,
                            attempts, err)
                continue
            arrays = {name: arrays[name] for name in expected}
            return PullResult(arrays, payload_nbytes(arrays), time.perf_counter() - started, attempt)
        error = TransferError(f"KV transfer {key} from {host}:{port} failed after {attempts} attempt(s): {last}")
        error.attempts = attempts
        raise error from last

    def _pull_once(self, host: str, port: int, transfer_port: int, key: str,
                   expected: ExpectedArrays) -> dict[str, jax.Array]:
        where = f"KV transfer {key} from {host}:{port}"
        with client.connect(host, port, self.timeout_s) as sock:
            wire.send_message(sock, {"op": OP, "key": key})
            reply, _ = wire.receive_message(sock)
            if "error" in reply:
                raise Refused(f"{where} refused: {reply['error']}")
            listed = reply.get("entries")
            if reply.get("key") != key or not wire.valid_entries(listed):
                raise Refused(f"{where}: not a {self.name} producer's reply: {str(reply)[:200]}")
            if problem := expected_problem(listed, expected):
                raise Refused(f"{where} is not what this server expects: {problem}")
            wire.send_message(sock, {"op": "go", "key": key})
            reply, _ = wire.receive_message(sock)
            uuid = reply.get("uuid")
            if "error" in reply or reply.get("key") != key or type(uuid) is not int:
                raise TransferError(f"{where}: the producer did not offer it: {str(reply)[:200]}")
            arrays = self._pull_arrays(sock, where, _join(host, transfer_port), uuid, listed)
            try:
                wire.send_message(sock, {"op": "ack", "key": key})
            except OSError as err:  # the data is here; unacknowledged, the producer frees it at its timeout
                logger.warning("%s: the acknowledgement failed: %s", where, err)
        return arrays

    def _pull_arrays(self, sock: socket.socket, where: str, transfer_address: str, uuid: int,
                     listed: list[dict]) -> dict[str, jax.Array]:
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = {e["name"]: jax.ShapeDtypeStruct(tuple(e["shape"]), resolve_dtype(e["dtype"]), sharding=sharding)
                 for e in listed}
        # an empty array never completes a jax pull (and has no bytes): the producer leaves it out
        arrays = {name: jax.device_put(np.zeros(spec.shape, spec.dtype), self.device)
                  for name, spec in specs.items() if not math.prod(spec.shape)}
        moving = [name for name in specs if name not in arrays]
        if not moving:
            return arrays
        connection = self._transfer_server().connect(transfer_address)
        try:
            outs = connection.pull(uuid, [specs[name] for name in moving], timeout=_deadline(self.timeout_s))
            self._wait(outs, sock, where)
        except BaseException:
            try:
                connection._poison_connection()  # its pending buffers fail and are freed now
            except Exception:  # best effort: dropping the connection frees them too, later
                logger.debug("%s: poisoning the failed pull's connection failed", where, exc_info=True)
            raise
        return {**arrays, **dict(zip(moving, outs, strict=True))}

    def _wait(self, outs: list[jax.Array], sock: socket.socket, where: str) -> None:
        """Until every array is in; TransferError if one failed, the producer went away (its end of the
        control connection closed) or no array came for timeout_s."""
        pending, progress = list(outs), time.monotonic()
        while pending:
            still = [a for a in pending if not a.is_ready()]
            if len(still) < len(pending):
                progress = time.monotonic()
            pending = still
            if not pending:
                break
            if time.monotonic() - progress > self.timeout_s:
                raise TransferError(f"{where}: no array arrived for {self.timeout_s:g} s "
                                    f"({len(outs) - len(pending)} of {len(outs)} in)")
            readable, _, _ = select.select([sock], [], [], self.poll_s)
            if readable:
                data = sock.recv(1, socket.MSG_PEEK)
                raise TransferError(f"{where}: the producer " + ("closed the connection mid-pull (it went away)"
                                                                 if not data else "sent something mid-pull"))
        try:
            jax.block_until_ready(outs)
        except Exception as err:  # jax's runtime error: a transfer failed
            raise TransferError(f"{where}: {err}") from err

    def close(self) -> None:
        with self._lock:
            self._server = None
