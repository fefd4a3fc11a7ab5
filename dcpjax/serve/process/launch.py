"""Start `python -m dcpjax.serve` in subprocesses, wait for /health, stop it.

The one place that picks a free port, starts a server (with the other processes of a
multi-process server, if any), polls its /health and stops it: used by
`python -m dcpjax.bench compare`, `benchmarks/load.py` and the server tests.

    with start_server(["--num-cpu-devices", "8", "-tp", "8", "-dcp", "2"]) as server:
        requests.get(f"{server.base_url}/v1/models")

Each process writes its output to a temporary file (a pipe nobody reads could fill and
block it); if a process exits or /health does not answer in time, every process is
stopped and `RuntimeError` carries the tail of their output.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import IO, Self

from dcpjax.sharding.devices import env_without_forced_device_count

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """This process's environment without a forced CPU device count in XLA_FLAGS: the server
    sets up its devices itself (`--num-cpu-devices`). The other XLA flags pass through."""
    return env_without_forced_device_count()


class ServerProcess:
    """A running `python -m dcpjax.serve` at `base_url`; `procs[-1]` serves HTTP, the others follow it."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[IO[bytes]], base_url: str):
        self.procs, self.logs, self.base_url = procs, logs, base_url

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        """The last `chars` characters each process wrote (stdout and stderr)."""
        tails = []
        for i, log in enumerate(self.logs):
            if log.closed:
                continue
            log.flush()
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - chars))
            text = log.read().decode(errors="replace")
            tails.append(text if len(self.logs) == 1 else f"-- process {i} (pid {self.procs[i].pid}):\n{text}")
        return "\n".join(tails)

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until it answers 200; fail fast if a process exits or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1):
                    return
            except OSError:
                exited = [p for p in self.procs if p.poll() is not None]
                if exited:
                    self._fail(f"server process {exited[0].pid} exited with status {exited[0].returncode}",
                               usage=exited[0].returncode == 2)
                time.sleep(0.5)
        self._fail(f"server did not answer {self.base_url}/health in {timeout:.0f} s")

    def _fail(self, what: str, usage: bool = False) -> None:
        """Stop every process and raise: ServerUsageError if the server refused its command line
        (exit status 2: its one `error:` line is the message), else RuntimeError."""
        tail = self.log_tail()
        self.stop(timeout=5)
        if usage:
            lines = [line for line in tail.splitlines() if line.strip()]
            # the error line itself, not the "see --help" pointer argparse's error ends with
            last = [line for line in lines if "error: " in line][-1:] or lines[-1:] or [""]
            error = ServerUsageError(f"{what}: {last[0].strip()}; its output ends with:\n{tail}")
            error.summary = f"the server did not start: {last[0].strip()}"
            raise error
        raise RuntimeError(f"{what}; its output ends with:\n{tail}")

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate the HTTP process (it stops the others), wait, kill what is still running."""
        if self.procs[-1].poll() is None:
            self.procs[-1].terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("server process %d did not stop in %.0f s: killed", proc.pid, timeout)
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


class ServerUsageError(RuntimeError, ValueError):
    """The server refused its arguments (a user error: `dcpjax.entrypoints.cli` prints its `summary` line)."""

    summary: str = ""


def start_server(args: Sequence[str], *, followers: Sequence[Sequence[str]] = (), port: int | None = None,
                 timeout: float = 300.0, env: Mapping[str, str] | None = None) -> ServerProcess:
    """Start `python -m dcpjax.serve *args --port PORT` (PORT: a free one) and wait for /health.

    `followers`: the argument lists of the other processes of a multi-process server
    (`--process-id` > 0), started first. Raises RuntimeError with the servers' output tail
    if a process exits or /health does not answer within `timeout` seconds (ServerUsageError,
    also a ValueError, when a process refused its arguments). `env`: extra
    environment variables of every process.
    """
    port = free_port() if port is None else port
    commands = [list(a) for a in followers] + [[*args, "--port", str(port)]]
    procs, logs = [], []
    for command in commands:
        log = tempfile.TemporaryFile()  # noqa: SIM115 (outlives this function: ServerProcess.stop closes it)
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "dcpjax.serve", *command],
                                      env=server_env() | dict(env or {}), stdout=log, stderr=subprocess.STDOUT))
    server = ServerProcess(procs, logs, f"http://{HOST}:{port}")
    logger.info("started %s (pids %s); waiting for /health", server.base_url, [p.pid for p in procs])
    server.wait_healthy(timeout)
    return server
