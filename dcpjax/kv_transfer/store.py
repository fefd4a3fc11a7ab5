"""The producer's held transfers: a finished prompt's KV until a decode server pulls it.

Bounded twice. By bytes: a prefill `reserve`s its KV's bytes before it is admitted, and reserved
plus held bytes never pass max_bytes (a reservation that would is refused: the caller keeps the
prefill waiting, or answers a retryable 503). By time: `offer` turns the reservation into a held
payload and starts its clock; `expire` frees what nobody pulled within timeout_s (a decode server
that died, or whose client gave up, must not pin memory for ever). A reservation never expires:
its prefill is still running, and its owner withdraws it (`remove`) if that prefill is dropped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from .wire import TransferError

Payload = dict[str, Any]  # array name -> array (host or device, as the transport serves it)


@dataclasses.dataclass
class _Held:
    nbytes: int
    payload: Payload | concurrent.futures.Future | None = None  # None: reserved, not offered yet
    since: float | None = None  # when it was offered (its expiry clock); None while reserved


class HeldTransfers:
    """Reservations and payloads by transfer key. Thread-safe: the engine reserves and offers, the
    transfer server's connection threads get and remove, its sweeper expires."""

    def __init__(self, timeout_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.max_bytes, self._clock = float(timeout_s), int(max_bytes), clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._bytes = 0  # reserved + held, kept with _held under the lock

    # -- the producer's side -----------------------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> bool:
        """Room for nbytes more within max_bytes: True and reserved under key, or False (nothing
        changes). TransferError if key is reserved or held already."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"KV transfer {key!r}: cannot reserve {nbytes} bytes")
        with self._lock:
            if key in self._held:
                raise TransferError(f"KV transfer {key!r} is reserved or held already")
            if self._bytes + nbytes > self.max_bytes:
                return False
            self._held[key] = _Held(nbytes)
            self._bytes += nbytes
            return True

    def offer(self, key: str, payload: Payload | concurrent.futures.Future) -> None:
        """The reserved key's payload (a dict of arrays, or a Future of one: a copy still running, so
        the engine thread need not wait for it): held from now until removed or timeout_s later."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                raise TransferError(f"KV transfer {key!r} was not reserved (or was withdrawn): reserve its bytes "
                                    "before offering it")
            if held.since is not None:
                raise TransferError(f"KV transfer {key!r} is held already")
            held.payload, held.since = payload, self._clock()

    def put(self, key: str, payload: Payload | concurrent.futures.Future, nbytes: int) -> None:
        """reserve + offer in one; TransferError when nbytes do not fit."""
        if not self.reserve(key, nbytes):
            raise TransferError(f"KV transfer {key!r}: {nbytes} bytes more would pass the {self.max_bytes} "
                                f"bytes this producer holds at most ({self.held_bytes} held)")
        self.offer(key, payload)

    def can_hold(self, nbytes: int) -> bool:
        """Whether `nbytes` more stay within max_bytes now (a hint: `reserve` is the check)."""
        with self._lock:
            return self._bytes + int(nbytes) <= self.max_bytes

    # -- the transfer server's side ----------------------------------------------------------------
    def _expired(self, held: _Held, now: float) -> bool:
        return held.since is not None and now - held.since >= self.timeout_s

    def get(self, key: str, wait_s: float) -> Payload:
        """The payload, left held (it goes only once the consumer acknowledges it). Waits up to wait_s
        for a Future. KeyError: unknown, expired or not offered yet; TransferError: the Future failed
        or is late."""
        with self._lock:
            held = self._held.get(key)
            if held is None or held.since is None or self._expired(held, self._clock()):
                raise KeyError(f"KV transfer {key!r} is unknown or expired (this prefill server holds KV "
                               f"{self.timeout_s:g} s at most, until one pull is acknowledged)")
            payload = held.payload
        if not isinstance(payload, concurrent.futures.Future):
            return payload
        try:
            resolved = payload.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            raise TransferError(f"KV transfer {key!r} was not ready within {wait_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise KeyError(f"KV transfer {key!r} was released while it was prepared") from None
        except Exception as err:  # whatever the copy raised, the pull reports it
            raise TransferError(f"KV transfer {key!r} could not be prepared: {err}") from err
        with self._lock:
            if self._held.get(key) is held:
                held.payload = resolved  # resolved once: later pulls need not go through the Future
        return resolved

    def remove(self, key: str) -> int | None:
        """Stop holding (or reserving) `key`; the bytes it counted, None if it was not there."""
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self._bytes -= held.nbytes
        if held is not None and isinstance(held.payload, concurrent.futures.Future):
            held.payload.cancel()  # not started yet: skip the copy nobody will pull
        return None if held is None else held.nbytes

    def expire(self) -> list[str]:
        """Remove the payloads offered timeout_s or longer ago (never a reservation); returns their keys."""
        with self._lock:
            now = self._clock()
            keys = [key for key, held in self._held.items() if self._expired(held, now)]
            gone = [self._held.pop(key) for key in keys]
            self._bytes -= sum(held.nbytes for held in gone)
        for held in gone:
            if isinstance(held.payload, concurrent.futures.Future):
                held.payload.cancel()
        return keys

    def clear(self) -> list[str]:
        """Remove everything (the producer closes); returns the keys."""
        with self._lock:
            keys = list(self._held)
        for key in keys:
            self.remove(key)
        return keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    @property
    def held_bytes(self) -> int:
        """Bytes reserved or held now (as `reserve` declared them)."""
        with self._lock:
            return self._bytes

    def keys(self) -> list[str]:
        """The reserved and held keys, oldest first (a snapshot)."""
        with self._lock:
            return list(self._held)

    def nbytes(self, key: str) -> int | None:
        """The bytes key was reserved with (None: not there)."""
        with self._lock:
            held = self._held.get(key)
            return None if held is None else held.nbytes
