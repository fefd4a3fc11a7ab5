"""Graceful shutdown on SIGTERM / SIGINT: stop admitting, drain, free, exit 0.

The first signal puts the server in draining mode: new requests get 503 with
`Retry-After` (a load balancer sends them elsewhere), requests already accepted run
on. When none is left, or `--shutdown-timeout` seconds have passed (the rest are
aborted: each gets its final chunk, finish_reason "abort", never silence), uvicorn
is told to exit; the engine thread stops and the followers of a multi-process
server are told to stop. A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dcpjax.serve.async_engine import EngineDeadError

logger = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 5


class Draining:
    """Whether the server still admits requests; shared by the middleware and the server."""

    def __init__(self) -> None:
        self.started: float | None = None

    @property
    def active(self) -> bool:
        return self.started is not None


def unavailable(message: str) -> JSONResponse:
    """503 with an OpenAI-style error body and Retry-After."""
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "unavailable"}}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def add_availability_guard(app: FastAPI, draining: Draining, engine) -> None:
    """While draining, or once the engine has failed (`engine.failure`), every request but
    /metrics gets 503 + Retry-After (/health too, so load balancers take this replica out);
    a request whose engine fails while it waits gets the same 503."""

    @app.middleware("http")
    async def refuse_when_unavailable(request: Request, call_next):
        if request.url.path != "/metrics":
            if engine.failure is not None:
                return unavailable(f"the engine failed: {engine.failure}")
            if draining.active:
                return unavailable("the server is shutting down; retry on another replica")
        return await call_next(request)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError):
        return unavailable(f"the engine failed: {error}")


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose first exit signal drains the engine before uvicorn stops.

    engine: the `AsyncEngine` (its `num_in_flight()` and `abort_everything()`).
    """

    def __init__(self, config: uvicorn.Config, engine, draining: Draining, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.draining, self.shutdown_timeout = engine, draining, shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining.active:  # a second signal: stop now
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self.draining.started = time.monotonic()
        logger.info("signal %d: draining %d request(s), at most %.0f s", sig, self.engine.num_in_flight(),
                    self.shutdown_timeout)
        threading.Thread(target=self._drain, name="dcpjax-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = self.draining.started + self.shutdown_timeout
        while self.engine.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.engine.num_in_flight()
        if left:
            logger.warning("shutdown timeout: aborting %d request(s)", left)
            self.engine.abort_everything()
            end = time.monotonic() + 5  # let their final chunks reach the clients
            while self.engine.num_in_flight() and time.monotonic() < end:
                time.sleep(0.05)
        self.should_exit = True  # uvicorn closes the sockets; main() then stops the engine
