"""The producer's held transfers: a finished prompt's KV on the host until a decode server pulls it.

Held in host memory (not in the KV cache: the blocks go back to the pool at once) and bounded twice:
by bytes (`can_hold`, asked before a prefill is accepted) and by time (`expire`, since a decode server
that never pulls, because it died or its client gave up, must not pin memory for ever).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from .wire import TransferError

Payload = tuple[dict, dict[str, np.ndarray]]


@dataclasses.dataclass
class _Held:
    payload: Payload | concurrent.futures.Future
    nbytes: int
    since: float


class HeldTransfers:
    """Payloads by transfer key, each held from `put` until removed or `timeout_s` later. Thread-safe:
    the engine puts, the transfer server's connection threads get and remove, its sweeper expires."""

    def __init__(self, timeout_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.max_bytes, self._clock = float(timeout_s), int(max_bytes), clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}

    def put(self, key: str, payload: Payload | concurrent.futures.Future, nbytes: int) -> None:
        """Hold `payload`: a (header, arrays) tuple, or a Future of one (the device-to-host copy still
        running, so the engine thread need not wait for it)."""
        with self._lock:
            if key in self._held:
                raise TransferError(f"KV transfer {key!r} is held already")
            self._held[key] = _Held(payload, int(nbytes), self._clock())

    def can_hold(self, nbytes: int) -> bool:
        """Whether `nbytes` more stay within max_bytes (asked before the KV is computed)."""
        with self._lock:
            return self._held_bytes() + nbytes <= self.max_bytes

    def _held_bytes(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def _expired(self, held: _Held, now: float) -> bool:
        return now - held.since >= self.timeout_s

    def get(self, key: str, wait_s: float) -> Payload:
        """The payload, left held (it goes only once the consumer acknowledges it). Waits up to wait_s
        for a Future. KeyError: unknown or expired; TransferError: the Future failed or is late."""
        with self._lock:
            held = self._held.get(key)
            if held is None or self._expired(held, self._clock()):
                raise KeyError(f"KV transfer {key!r} is unknown or expired (this prefill server holds KV "
                               f"{self.timeout_s:g} s at most, until one pull is acknowledged)")
        if not isinstance(held.payload, concurrent.futures.Future):
            return held.payload
        try:
            payload = held.payload.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            raise TransferError(f"KV transfer {key!r} was not ready on the host within {wait_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise KeyError(f"KV transfer {key!r} was released while it was prepared") from None
        except Exception as err:  # whatever the copy raised, the pull reports it
            raise TransferError(f"KV transfer {key!r} could not be copied to the host: {err}") from err
        with self._lock:
            if self._held.get(key) is held:
                held.payload = payload  # resolved once: later pulls need not go through the Future
        return payload

    def remove(self, key: str) -> int | None:
        """Stop holding `key`; the bytes it held (as `put` declared them), None if it was not held."""
        with self._lock:
            held = self._held.pop(key, None)
        if held is not None and isinstance(held.payload, concurrent.futures.Future):
            held.payload.cancel()  # not started yet: skip the copy nobody will pull
        return None if held is None else held.nbytes

    def expire(self) -> list[str]:
        """Remove the keys held timeout_s or longer; returns them."""
        with self._lock:
            now = self._clock()
            keys = [key for key, held in self._held.items() if self._expired(held, now)]
            gone = [self._held.pop(key) for key in keys]
        for held in gone:
            if isinstance(held.payload, concurrent.futures.Future):
                held.payload.cancel()
        return keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    @property
    def held_bytes(self) -> int:
        """Bytes held now (as `put` declared them)."""
        with self._lock:
            return self._held_bytes()

    def keys(self) -> list[str]:
        """The held keys, oldest first (a snapshot)."""
        with self._lock:
            return list(self._held)
