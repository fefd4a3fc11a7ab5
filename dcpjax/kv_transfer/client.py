"""The consumer's side: pull a held KV payload from a prefill server's TransferServer, or release it.

A pull that breaks mid-way (the network, a producer's hiccup) is retried on a fresh connection: the
producer keeps the payload until it is acknowledged. A refusal (the key is unknown or expired) is
not: the data is not there, and asking again would only wait for nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time

import numpy as np

from . import wire
from .wire import TransferError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PullResult:
    """A pulled payload. nbytes: the message's bytes on the wire; seconds: the whole pull, retries
    included; attempts: connections it took (1: no retry)."""

    header: dict
    arrays: dict[str, np.ndarray]
    nbytes: int
    seconds: float
    attempts: int


class _Refused(TransferError):
    """The producer answered with an error: final, no retry."""


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request goes out without waiting
    return sock


def _pull_once(host: str, port: int, key: str, timeout_s: float) -> tuple[dict, dict[str, np.ndarray]]:
    with _connect(host, port, timeout_s) as sock:
        wire.send_message(sock, {"op": "pull", "key": key})
        header, arrays = wire.receive_message(sock)
        if "error" in header:
            raise _Refused(f"KV transfer {key} from {host}:{port} refused: {header['error']}")
        if header.get("key") != key:
            raise _Refused(f"KV transfer {key} from {host}:{port}: the reply is for {header.get('key')!r}")
        try:
            wire.send_message(sock, {"op": "ack", "key": key})
        except OSError as err:  # the data is here; unacknowledged, the producer frees it at its timeout
            logger.warning("KV transfer %s: the acknowledgement to %s:%d failed: %s", key, host, port, err)
    return header, arrays


def pull(host: str, port: int, key: str, *, timeout_s: float = 30.0, retries: int = 1) -> PullResult:
    """Pull `key`'s payload from host:port and acknowledge it (which frees it there).

    timeout_s bounds connecting and each read or write, not the whole transfer (that grows with the
    payload). retries: further attempts, each on a fresh connection, after a failure to connect or a
    broken transfer. Raises TransferError (with `.attempts`) when refused or out of attempts.
    """
    started = time.perf_counter()
    attempts = max(0, int(retries)) + 1
    last: OSError | None = None
    for attempt in range(1, attempts + 1):
        try:
            header, arrays = _pull_once(host, port, key, timeout_s)
        except _Refused as err:
            err.attempts = attempt
            raise
        except OSError as err:  # TransferError included: a broken or malformed message
            last = err
            logger.info("KV transfer %s from %s:%d: attempt %d of %d failed: %s", key, host, port, attempt,
                        attempts, err)
            continue
        return PullResult(header, arrays, wire.message_nbytes(header, arrays), time.perf_counter() - started,
                          attempt)
    error = TransferError(f"KV transfer {key} from {host}:{port} failed after {attempts} attempt(s): {last}")
    error.attempts = attempts
    raise error from last


def release(host: str, port: int, key: str, *, timeout_s: float = 5.0) -> bool:
    """Ask the producer to free `key` unpulled (the consumer will not need it). Best effort: whether it
    was removed; False on any error (the producer's timeout frees it then)."""
    try:
        with _connect(host, port, timeout_s) as sock:
            wire.send_message(sock, {"op": "release", "key": key})
            reply, _ = wire.receive_message(sock)
    except OSError as err:
        logger.info("KV transfer %s: release on %s:%d failed: %s", key, host, port, err)
        return False
    return bool(reply.get("removed"))
