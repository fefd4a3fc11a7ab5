"""What every HTTP command shares before it serves (serve and the router): the port, bound first,
and uvicorn's log levels. Standard library only: the router imports it without JAX."""

from __future__ import annotations

import socket

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: a client meanwhile is refused, not left
    waiting) before the model loads, so a busy port is a one-line error in a second rather than
    after minutes of loading; uvicorn serves on it. OSError (exit 2) names the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot serve on {host}:{port}: {err.strerror} — pass another --port (or "
                                 "--host), or stop the process that holds it") from None
    return sock
