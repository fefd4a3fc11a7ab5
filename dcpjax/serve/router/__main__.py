"""`python -m dcpjax.serve.router`: the prefill/decode router (one OpenAI endpoint over both).

    python -m dcpjax.serve.router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each --prefill and --decode may be given several times: each role's servers are taken in turn.
It imports neither JAX nor the engine (only HTTP: FastAPI, uvicorn, httpx), so it starts at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from dcpjax.entrypoints import cli
from dcpjax.serve.process.listen import UVICORN_LOG_LEVELS, bind_port
from dcpjax.serve.router.app import build_app
from dcpjax.serve.router.proxy import backend_url

logger = logging.getLogger("dcpjax.serve.router")  # not __name__: that is "__main__" under python -m


class _Server(uvicorn.Server):
    """uvicorn's server that exits 0 once a SIGTERM/SIGINT shut it down, as serve does: plain
    uvicorn re-raises the signal afterwards, so the process would die by it (a supervisor reads
    that as a crash, and SIGINT would end in a KeyboardInterrupt). A second SIGINT stops at once."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def _url(text: str) -> str:
    """argparse's type for a backend URL: its ValueError message becomes the one-line error."""
    try:
        return backend_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """The router's flags (serve's names where they mean the same)."""
    p = cli.ArgumentParser(prog="python -m dcpjax.serve.router", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, type=_url, metavar="URL",
                   help="a prefill server (started with --kv-transfer-config '{\"kv_role\": \"kv_producer\"}'), "
                        "e.g. http://127.0.0.1:8100; repeat for several")
    p.add_argument("--decode", action="append", required=True, type=_url, metavar="URL",
                   help="a decode server (kv_role kv_consumer), e.g. http://127.0.0.1:8200; repeat for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the log line names it)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait on a backend: to connect, and for each read (between two streamed events)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1/* (the header goes on to the "
                                     "backends as sent)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let accepted requests (and their streams) finish before "
                        "closing them")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning",
                   help="uvicorn's own log level (default: %(default)s)")
    cli.add_debug_flag(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed and checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (0)."""
    args = parse_args(argv)
    cli.configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its INFO is a line per backend request: two per request
    with bind_port(args.host, args.port) as sock:  # first: a busy port is a one-line error before anything else
        app = build_app(args.prefill, args.decode, timeout=args.timeout, api_key=args.api_key)
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                        timeout_graceful_shutdown=args.shutdown_timeout))
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        logger.info("router on http://%s:%d (prefill: %s, decode: %s)", args.host, port, args.prefill, args.decode)
        server.run(sockets=[sock])
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
