"""What the connector calls, whatever moves the bytes: a producer's `KVSender`, a consumer's `KVReceiver`.

A sender holds each prompt's KV (named arrays) under a key until one consumer pulls it, it is
released, or it expires; a receiver pulls a key from the address in the handle the consumer got.
The transport moves only named arrays: the layout, the prompt's digest and the first token travel
in the handle.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from ..wire import TransferError, resolve_dtype

logger = logging.getLogger(__name__)

# name -> jax.ShapeDtypeStruct (or anything with .shape and .dtype), or a (shape, dtype) pair
ExpectedArrays = Mapping[str, Any]
Arrays = Mapping[str, Any]  # name -> np.ndarray or jax.Array


class Refused(TransferError):
    """The pull cannot succeed by trying again (the key is unknown or expired, or its payload is not
    what the consumer expects): final, no retry."""


@dataclasses.dataclass
class PullResult:
    """A pulled payload. arrays: by name, in the order `expected` listed them (np.ndarray from the
    socket transport, jax.Array on the receiver's device from the device-to-device one); nbytes: the
    arrays' bytes; seconds: the whole pull, retries included; attempts: connections it took (1: no
    retry)."""

    arrays: dict[str, Any]
    nbytes: int
    seconds: float
    attempts: int


def expected_spec(value) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one `expected` entry: a ShapeDtypeStruct (or an array) or a (shape, dtype) pair."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        shape, dtype = value.shape, value.dtype
    else:
        shape, dtype = value
    return tuple(int(d) for d in shape), np.dtype(dtype)


def expected_problem(listed: list[dict], expected: ExpectedArrays) -> str | None:
    """What differs between the arrays a producer lists (`wire.entries`) and what the consumer expects
    (None: the same names, shapes and dtypes; the order may differ)."""
    have = {e["name"]: e for e in listed}
    if missing := [n for n in expected if n not in have]:
        return f"it lacks {missing[:4]}{'...' if len(missing) > 4 else ''}"
    if extra := [n for n in have if n not in expected]:
        return f"it has arrays this server does not expect: {extra[:4]}{'...' if len(extra) > 4 else ''}"
    for name, value in expected.items():
        shape, dtype = expected_spec(value)
        try:
            got = (tuple(have[name]["shape"]), resolve_dtype(have[name]["dtype"]))
        except TransferError as err:
            return f"{name!r}: {err}"
        if got != (shape, dtype):
            return f"{name!r} is {got[1].name}{list(got[0])}, this server expects {dtype.name}{list(shape)}"
    return None


def payload_nbytes(arrays: Arrays) -> int:
    """Bytes of a payload's arrays (numpy's or JAX's)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays.values())


def check_connector(address: Mapping, name: str) -> None:
    """A handle's address from a producer of another transport cannot be pulled here: say so."""
    theirs = address.get("connector", name) if isinstance(address, Mapping) else None
    if theirs != name:
        raise Refused(f"the handle's KV is served by a {theirs} producer; this server's kv_connector is {name}: "
                      "give both servers the same kv_connector")


class KVSender(abc.ABC):
    """Producer side: holds each prompt's KV arrays under a key until one consumer pulls them (or
    they are released, or expire timeout_s after `offer`).

    host / port: where its control server listens (port 0: one the system picks; `address` says
    which). max_bytes: reserved plus held bytes never pass it. timeout_s: how long an offered payload
    waits for its pull. on_sent(key, nbytes, seconds): a pull acknowledged; on_released(key): freed
    unpulled at a consumer's word; on_expired(keys): freed unpulled at its timeout (all three from
    the sender's threads). fault: a test hook (`{"fail_after_bytes": N, "fail_count": k}`: the first k
    pulls break after N bytes; `{"stall_after_bytes": N}`: every pull stops after N bytes and hangs).
    """

    name: ClassVar[str]  # the kv_connector value
    device_arrays: ClassVar[bool] = False  # whether `offer` wants device arrays (else host copies)

    @abc.abstractmethod
    def __init__(self, host: str, port: int, *, max_bytes: int, timeout_s: float,
                 on_sent: Callable[[str, int, float], None] | None = None,
                 on_released: Callable[[str], None] | None = None,
                 on_expired: Callable[[list[str]], None] | None = None,
                 fault: dict | None = None): ...

    @property
    @abc.abstractmethod
    def address(self) -> dict:
        """JSON-able; what a consumer's `KVReceiver.pull` needs: {"connector", "host", "port", ...}. A
        producer bound to a wildcard (0.0.0.0) advertises another "host": replace that key alone."""

    @abc.abstractmethod
    def reserve(self, key: str, nbytes: int) -> bool:
        """Room for nbytes more within max_bytes (reserved AND held count): True and reserved, or
        False (the caller keeps the prefill waiting, or answers a retryable 503). Called before the
        prefill is admitted; a reservation never expires (withdraw it if the prefill is dropped)."""

    @abc.abstractmethod
    def offer(self, key: str, arrays: Mapping[str, Any] | concurrent.futures.Future) -> None:
        """The reserved key's payload (each value a device array, a host array, or a Future of the
        whole dict): held until pulled and acknowledged, released or expired (its clock starts now).
        Never blocks the caller on device->host copies or the network. TransferError: key not
        reserved, or the payload's bytes pass its reservation (then withdraw it)."""

    @abc.abstractmethod
    def withdraw(self, key: str) -> int | None:
        """Drop a reservation or a held payload: its bytes, or None when it was not there."""

    @property
    @abc.abstractmethod
    def held_bytes(self) -> int:
        """Bytes reserved or held now."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """The reserved and held keys, oldest first."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving; everything held is freed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVReceiver(abc.ABC):
    """Consumer side: pulls a key's arrays from a producer's address. Thread-safe: pulls may run in
    several threads at once.

    timeout_s: the longest a pull waits without progress (connecting, a reply, the next bytes or
    array); retries: further attempts after a pull broke mid-way, each on a fresh connection.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def __init__(self, *, timeout_s: float, retries: int): ...

    @abc.abstractmethod
    def pull(self, address: Mapping, key: str, expected: ExpectedArrays) -> PullResult:
        """The payload, checked against `expected` (names, shapes, dtypes; a mismatch is a
        TransferError, never silently wrong data), acknowledged (which frees it on the producer).
        Retries a broken pull `retries` times on a fresh connection; a refusal (unknown or expired
        key, a mismatch) is final. Raises TransferError (with .attempts); never waits past timeout_s
        without progress (a producer that dies mid-pull fails it)."""

    release_timeout_s: float = 5.0

    def release(self, address: Mapping, key: str) -> bool:
        """Best effort: ask the producer to free key unpulled; whether it did. Both transports take the
        request on the producer's TCP server (`kv_port`), the one that serves their pulls' control."""
        from .. import client  # here: the TCP client itself checks pulls with this module's `expected_problem`

        try:
            check_connector(address, self.name)
        except TransferError as err:
            logger.info("KV transfer %s: not released: %s", key, err)
            return False
        return client.release(address["host"], int(address["port"]), key, timeout_s=self.release_timeout_s)

    def close(self) -> None:
        """Free what the receiver holds between pulls (nothing, unless a transport says otherwise)."""
