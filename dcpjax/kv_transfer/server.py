"""The producer's transfer server: decode servers connect over TCP and pull held KV by key.

Pulls, not pushes: the decode server asks when it has admitted the request, so the prefill server
needs to know nothing about its consumers. A payload stays held until its consumer acknowledges it
(a pull that breaks mid-way can be retried) or until the store's timeout (a consumer that never
comes back). Protocol, one request message (header only) at a time on a connection:

- `{"op": "pull", "key": K}`: the payload as one message (`{"key": K}` and its arrays), then the
  consumer sends `{"op": "ack", "key": K}` and K is freed. Unknown or expired K: `{"error": "..."}`.
- `{"op": "release", "key": K}`: free K unpulled; the reply is `{"ok": true, "removed": bool}`.
- further ops a transport adds (`extra_ops`: the device-to-device transport's control messages).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Self

from . import wire
from .store import HeldTransfers

OpHandler = Callable[[socket.socket, str, dict], bool]

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 300.0  # a connection quiet this long (between requests, or mid-transfer) is dropped
REQUEST_HEADER_BYTES = 64 << 10  # requests are tiny: a peer sending more is not a consumer


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.serve_connection(self.request)


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = True  # an open connection never keeps the process alive
    allow_reuse_address = True  # a restarted server can take its port back from TIME_WAIT at once

    def __init__(self, address: tuple[str, int], serve_connection: Callable[[socket.socket], None]):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.serve_connection = serve_connection
        super().__init__(address, _Handler)


class TransferServer:
    """Serves a HeldTransfers' payloads on host:port (port 0: any free port; `.port` says which).

    fault (a test hook, never for production): `{"fail_after_bytes": N, "fail_count": k}` makes the
    first k pulls (counted across connections) send only the first N bytes of the payload message
    and close the connection, as a transfer that breaks mid-way would; `{"stall_after_bytes": N}`
    makes every pull send N bytes and then nothing more (the connection stays open until the server
    closes or the consumer gives up), as a producer that hangs or dies mid-pull would.
    on_sent(key, nbytes, seconds): after a pull is acknowledged (nbytes: what the store held it as).
    on_expired(keys): after the sweeper (every sweep_interval_s) freed payloads nobody pulled in time.
    on_released(key): a payload freed unpulled at a consumer's request.
    extra_ops: more request ops, op -> handler(sock, key, request) -> whether to keep the connection.
    on_sweep(): called by the sweeper after each sweep (a transport's own housekeeping).
    """

    ready_wait_s = 60.0  # how long a pull waits for a payload still being copied to the host

    def __init__(self, store: HeldTransfers, host: str = "127.0.0.1", port: int = 0, *, fault: dict | None = None,
                 on_sent: Callable[[str, int, float], None] | None = None,
                 on_expired: Callable[[list[str]], None] | None = None,
                 on_released: Callable[[str], None] | None = None, sweep_interval_s: float = 1.0,
                 extra_ops: dict[str, OpHandler] | None = None, on_sweep: Callable[[], None] | None = None):
        self.store, self.host = store, host
        self.on_sent, self.on_expired, self.on_released = on_sent, on_expired, on_released
        self.sweep_interval_s = float(sweep_interval_s)
        self.extra_ops, self.on_sweep = dict(extra_ops or {}), on_sweep
        fault = fault or {}
        self._fail_after, self._fails_left = int(fault.get("fail_after_bytes", 0)), int(fault.get("fail_count", 0))
        stall = fault.get("stall_after_bytes")
        self._stall_after = None if stall is None else int(stall)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        try:
            self._listener = _Listener((host, port), self._serve)  # binds now: a busy port fails at startup
        except OSError as err:
            raise OSError(err.errno, f"the KV transfer server cannot listen on {host}:{port} ({err.strerror or err}): "
                                     "pass another kv_port in --kv-transfer-config (0 picks a free one)") from err
        self.port = self._listener.server_address[1]

    def start(self) -> Self:
        """Serve and sweep in daemon threads."""
        if self._threads:
            return self
        self._threads = [threading.Thread(target=self._listener.serve_forever, kwargs={"poll_interval": 0.2},
                                          name=f"dcpjax-kv-server-{self.port}", daemon=True),
                         threading.Thread(target=self._sweep, name=f"dcpjax-kv-sweeper-{self.port}", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop serving and sweeping; open connections are cut (their payloads stay in the store)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._threads:
            self._listener.shutdown()  # waits for serve_forever: only when it runs
        self._listener.server_close()
        with self._lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed by its peer already
        for thread in self._threads:
            thread.join(timeout=5.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stopped(self) -> threading.Event:
        """Set once the server closes (a stalled fault waits on it)."""
        return self._stop

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_interval_s):
            keys = self.store.expire()
            if keys and self.on_expired is not None:
                try:
                    self.on_expired(keys)
                except Exception:  # a callback's bug must not stop the sweeping
                    logger.exception("KV transfer server: on_expired failed")
            if self.on_sweep is not None:
                try:
                    self.on_sweep()
                except Exception:
                    logger.exception("KV transfer server: on_sweep failed")

    def _serve(self, sock: socket.socket) -> None:
        """One connection: requests until the consumer closes it (or breaks it)."""
        sock.settimeout(IDLE_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small header writes go out at once
        with self._lock:
            self._connections.add(sock)
        try:
            while self._handle_request(sock):
                pass
        except wire.EndOfStream:
            pass  # the consumer is done
        except OSError as err:  # TransferError included: a broken or malformed message
            logger.info("KV transfer connection closed: %s", err)
        finally:
            with self._lock:
                self._connections.discard(sock)

    def _handle_request(self, sock: socket.socket) -> bool:
        """Answer one request; False when the connection is to be closed."""
        request, _ = wire.receive_message(sock, max_header_bytes=REQUEST_HEADER_BYTES)
        op, key = request.get("op"), request.get("key")
        ops = {"pull": self._pull, "release": self._release, **self.extra_ops}
        if op in ops and not isinstance(key, str):
            wire.send_message(sock, {"error": f"{op} needs a string key, got {key!r}"})
        elif op in ops:
            return ops[op](sock, key, request)
        else:
            wire.send_message(sock, {"error": f"unknown op {op!r}: a KV transfer server takes {sorted(ops)}"})
        return True

    def _release(self, sock: socket.socket, key: str, request: dict) -> bool:
        removed = self.store.remove(key) is not None
        if removed and self.on_released is not None:
            try:
                self.on_released(key)
            except Exception:
                logger.exception("KV transfer server: on_released failed")
        wire.send_message(sock, {"ok": True, "removed": removed})
        return True

    def take_fault(self) -> tuple[str, int] | None:
        """The fault test hook's verdict for the pull starting now: ("fail", N) cut after N bytes,
        ("stall", N) stop after N bytes and hang, or None."""
        with self._lock:
            if self._fails_left > 0:
                self._fails_left -= 1
                return "fail", self._fail_after
        return None if self._stall_after is None else ("stall", self._stall_after)

    def refuse(self, sock: socket.socket, err: Exception) -> None:
        """Answer a request with its error (the consumer does not retry it)."""
        wire.send_message(sock, {"error": str(err.args[0]) if err.args else str(err)})

    def await_ack(self, sock: socket.socket, key: str, started: float) -> bool:
        """After the payload went out: wait for the consumer's ack, free key, report it (on_sent). A
        break before the ack raises (the connection ends) and leaves the payload held for a retry."""
        reply, _ = wire.receive_message(sock, max_header_bytes=REQUEST_HEADER_BYTES)
        if reply.get("op") != "ack" or reply.get("key") != key:
            raise wire.TransferError(f"KV transfer {key}: expected its ack, got {reply!r}")
        nbytes = self.store.remove(key)
        if nbytes is not None and self.on_sent is not None:  # None: released or expired meanwhile
            try:
                self.on_sent(key, nbytes, time.perf_counter() - started)
            except Exception:  # the transfer is done; a callback's bug is only logged
                logger.exception("KV transfer server: on_sent failed")
        return True

    def _pull(self, sock: socket.socket, key: str, request: dict) -> bool:
        """Send key's payload, wait for the acknowledgement, free it."""
        try:
            arrays = self.store.get(key, self.ready_wait_s)
        except (KeyError, wire.TransferError) as err:
            self.refuse(sock, err)
            return True
        started = time.perf_counter()
        fault = self.take_fault()
        try:
            wire.send_message(sock, {"key": key}, arrays, limit_bytes=None if fault is None else fault[1])
        except wire.TransferError as err:
            if fault is None:
                raise
            logger.warning("KV transfer %s: %s (the %s_after_bytes test hook)", key, err, fault[0])
            if fault[0] == "stall":
                self._stop.wait()  # hold the connection, send nothing more, until the server closes
            return False
        return self.await_ack(sock, key, started)
