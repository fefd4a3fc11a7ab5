"""Framing for KV transfers: one JSON header, then raw array bytes, over a stream socket.

A message is an 8-byte big-endian length H, H bytes of UTF-8 JSON (the header), then the raw C-order
bytes of each array that `header["arrays"]` lists (`{"name", "dtype", "shape"}`), in that order.
Arrays travel as bytes, not as JSON or pickle: a prompt's KV is hundreds of MB, so it goes out from
the array's own memory and comes in straight into a preallocated array (no intermediate copies), and
nothing the peer sends is ever executed.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable

import ml_dtypes
import numpy as np

LENGTH = struct.Struct(">Q")


class TransferError(OSError):
    """A KV transfer failed (a broken or malformed message, a refused pull). An OSError, so the CLI
    and the servers report it as a user-facing error rather than a crash."""


class EndOfStream(TransferError):
    """The peer closed the connection between two messages: the clean end of a connection."""


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype a header names (ml_dtypes' float8_e4m3fn, bfloat16 ... included)."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        found = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
        if found is None:
            raise TransferError(f"unknown dtype {name!r} in a KV transfer message") from None
        dtype = np.dtype(found)
    if dtype.hasobject or dtype.fields is not None:
        raise TransferError(f"dtype {name!r} cannot travel as raw bytes")  # pointers, not data
    return dtype


def entries(arrays: dict) -> list[dict]:
    """`{"name", "dtype", "shape"}` of each array (numpy's or JAX's), in order: what a header lists."""
    return [{"name": name, "dtype": np.dtype(a.dtype).name, "shape": [int(d) for d in a.shape]}
            for name, a in arrays.items()]


def _encode_header(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def message_nbytes(header: dict, arrays: dict[str, np.ndarray] | None = None) -> int:
    """The bytes `send_message(sock, header, arrays)` writes. On a received message it gives the bytes
    that came in (the header's encoding is deterministic and its "arrays" is rebuilt the same way)."""
    arrays = arrays or {}
    encoded = _encode_header({**header, "arrays": entries(arrays)})
    return LENGTH.size + len(encoded) + sum(a.nbytes for a in arrays.values())


def _byte_view(a: np.ndarray) -> memoryview:
    """The array's raw bytes, without a copy when it is C-contiguous and native-endian already."""
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def send_message(sock: socket.socket, header: dict, arrays: dict[str, np.ndarray] | None = None, *,
                 limit_bytes: int | None = None) -> int:
    """Send one message; returns the bytes written. The header sent is a copy of `header` with
    "arrays" describing `arrays` (in their order); the caller's dict is left alone.

    limit_bytes (fault injection, for tests): write only the message's first limit_bytes bytes, then
    raise TransferError; the caller closes the socket, so the peer sees a transfer broken mid-way.
    """
    arrays = {name: np.asarray(a) for name, a in (arrays or {}).items()}
    encoded = _encode_header({**header, "arrays": entries(arrays)})
    parts = [LENGTH.pack(len(encoded)) + encoded] + [_byte_view(a) for a in arrays.values()]
    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    budget = total if limit_bytes is None else max(0, min(int(limit_bytes), total))
    written = 0
    for part in parts:
        size = len(part) if isinstance(part, bytes) else part.nbytes
        take = min(size, budget - written)
        if take > 0:
            sock.sendall(part if take == size else memoryview(part)[:take])
            written += take
        if written == budget and budget < total:
            raise TransferError(f"fault injection: sent {written} of {total} bytes of the message, then stopped")
    return written


def _read_into(sock: socket.socket, view: memoryview, what: str, before: int, total: int | None) -> None:
    """Fill `view` from the socket. before/total: the message's bytes read before this part and its
    size (None while the header is unknown), for an error that says how far the message got."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if before == 0 and got == 0:
                raise EndOfStream("connection closed before a message")
            of = f"{total}" if total is not None else f"at least {before + len(view)}"
            raise TransferError(f"connection closed after {before + got} of {of} bytes of a KV transfer "
                                f"message (in its {what}): the peer went away mid-message")
        got += n


def valid_entries(listed) -> bool:
    """Whether a header's "arrays" is a list of distinct names with non-negative integer shapes."""
    if not isinstance(listed, list) or not all(isinstance(e, dict) for e in listed):
        return False
    shapes_ok = all(isinstance(e.get("shape"), list) and all(type(d) is int and d >= 0 for d in e["shape"])
                    for e in listed)
    names = [e.get("name") for e in listed]
    return shapes_ok and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)


def _parse_header(raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TransferError(f"malformed KV transfer message header ({err}): not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise TransferError(f"malformed KV transfer message header: a JSON object expected, got {type(header)}")
    if not valid_entries(header.setdefault("arrays", [])):
        raise TransferError('malformed KV transfer message header: "arrays" must list distinct '
                            '{"name": str, "dtype": str, "shape": [int >= 0, ...]}')
    return header


def receive_message(sock: socket.socket, *, max_header_bytes: int = 1 << 20,
                    check_header: Callable[[dict], None] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Read one whole message: (header, arrays by name). Raises EndOfStream (a TransferError) when the
    peer closed before the message began, TransferError when it is broken or malformed.

    check_header(header): called once the header is in, before any array's memory is allocated or
    its bytes read; what it raises propagates (the rest of the message is left unread: the caller
    closes the connection).
    """
    prefix = bytearray(LENGTH.size)
    _read_into(sock, memoryview(prefix), "length prefix", 0, None)
    (length,) = LENGTH.unpack(prefix)
    if length > max_header_bytes:
        raise TransferError(f"KV transfer message header of {length} bytes is over the limit of "
                            f"{max_header_bytes}: not a dcpjax KV transfer peer?")
    raw = bytearray(length)
    _read_into(sock, memoryview(raw), "header", LENGTH.size, None)
    header = _parse_header(bytes(raw))
    if check_header is not None:
        check_header(header)
    arrays = {e["name"]: np.empty(e["shape"], resolve_dtype(e.get("dtype"))) for e in header["arrays"]}
    before = LENGTH.size + length
    total = before + sum(a.nbytes for a in arrays.values())
    for name, a in arrays.items():
        if a.nbytes:
            _read_into(sock, memoryview(a.reshape(-1).view(np.uint8)), f"array {name!r}", before, total)
            before += a.nbytes
    return header, arrays

