"""The consumer's side of the TCP transport: pull a held KV payload from a prefill server's
TransferServer, or release it.

A pull that breaks mid-way (the network, a producer's hiccup) is retried on a fresh connection: the
producer keeps the payload until it is acknowledged. A refusal (the key is unknown or expired) is
not: the data is not there, and asking again would only wait for nothing. Neither is a payload that
is not what the consumer expects (names, shapes, dtypes): it is checked from the message's header,
before any of its bytes are read.
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np

from . import wire
from .transport.base import ExpectedArrays, PullResult, Refused, expected_problem, payload_nbytes
from .wire import TransferError

logger = logging.getLogger(__name__)

__all__ = ["PullResult", "pull", "release"]


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to a transfer server; timeout_s bounds the connect and each later read or write."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request goes out without waiting
    return sock


def _pull_once(host: str, port: int, key: str, timeout_s: float,
               expected: ExpectedArrays | None) -> dict[str, np.ndarray]:
    def check(header: dict) -> None:
        if "error" in header:
            raise Refused(f"KV transfer {key} from {host}:{port} refused: {header['error']}")
        if header.get("key") != key:
            raise Refused(f"KV transfer {key} from {host}:{port}: the reply is for {header.get('key')!r}")
        if expected is not None and (problem := expected_problem(header["arrays"], expected)):
            raise Refused(f"KV transfer {key} from {host}:{port} is not what this server expects: {problem}")

    with connect(host, port, timeout_s) as sock:
        wire.send_message(sock, {"op": "pull", "key": key})
        _, arrays = wire.receive_message(sock, check_header=check)
        try:
            wire.send_message(sock, {"op": "ack", "key": key})
        except OSError as err:  # the data is here; unacknowledged, the producer frees it at its timeout
            logger.warning("KV transfer %s: the acknowledgement to %s:%d failed: %s", key, host, port, err)
    return arrays


def pull(host: str, port: int, key: str, *, timeout_s: float = 30.0, retries: int = 1,
         expected: ExpectedArrays | None = None) -> PullResult:
    """Pull `key`'s payload from host:port and acknowledge it (which frees it there).

    timeout_s bounds connecting and each read or write, not the whole transfer (that grows with the
    payload): a producer that stops sending for timeout_s fails the attempt. retries: further
    attempts, each on a fresh connection, after a failure to connect or a broken transfer.
    expected: name -> ShapeDtypeStruct or (shape, dtype); the payload must be exactly that (in any
    order; `arrays` comes back in expected's order). Raises TransferError (with `.attempts`) when
    refused, not as expected, or out of attempts.
    """
    started = time.perf_counter()
    attempts = max(0, int(retries)) + 1
    last: OSError | None = None
    for attempt in range(1, attempts + 1):
        try:
            arrays = _pull_once(host, port, key, timeout_s, expected)
        except Refused as err:
            err.attempts = attempt
            raise
        except OSError as err:  # TransferError and socket timeouts included: a broken or malformed message
            last = err
            logger.info("KV transfer %s from %s:%d: attempt %d of %d failed: %s", key, host, port, attempt,
                        attempts, err)
            continue
        if expected is not None:
            arrays = {name: arrays[name] for name in expected}
        return PullResult(arrays, payload_nbytes(arrays), time.perf_counter() - started, attempt)
    error = TransferError(f"KV transfer {key} from {host}:{port} failed after {attempts} attempt(s): {last}")
    error.attempts = attempts
    raise error from last


def release(host: str, port: int, key: str, *, timeout_s: float = 5.0) -> bool:
    """Ask the producer to free `key` unpulled (the consumer will not need it). Best effort: whether it
    was removed; False on any error (the producer's timeout frees it then)."""
    try:
        with connect(host, port, timeout_s) as sock:
            wire.send_message(sock, {"op": "release", "key": key})
            reply, _ = wire.receive_message(sock)
    except OSError as err:
        logger.info("KV transfer %s: release on %s:%d failed: %s", key, host, port, err)
        return False
    return bool(reply.get("removed"))
