"""`python -m dcpjax.serve [MODEL]`: an OpenAI-compatible server (vLLM's flag names).

    python -m dcpjax.serve tiny-llama --num-cpu-devices 8 --tensor-parallel-size 8 \\
        --decode-context-parallel-size 2 --port 8000

MODEL (as in `vllm serve MODEL`) is the same as --model. Each finished request logs one line
on the "dcpjax.serve" logger (`request_log`); --disable-log-requests turns that off.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli
from dcpjax.llm import LLM
from dcpjax.serve.process.faults import DEFAULT_FAILURE_TIMEOUT
from dcpjax.serve.process.listen import UVICORN_LOG_LEVELS, bind_port
from dcpjax.serve.tools.parsers import PARSERS

logger = logging.getLogger("dcpjax.serve")  # not __name__: that is "__main__" under python -m


def build_parser() -> argparse.ArgumentParser:
    """The parser: the engine flags (`EngineArgs`), then the HTTP and multi-process ones."""
    p = cli.ArgumentParser(prog="python -m dcpjax.serve", description=__doc__.split("\n\n")[0])
    cli.add_model_positional(p)
    EngineArgs.add_cli_args(p)
    p.add_argument("--served-model-name", help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1/*")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    p.add_argument("--chat-template", metavar="FILE",
                   help="the chat template to use instead of the model's: a jinja file, an inline template, or the "
                        "name of one of the model's named templates")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of chat output when tool_choice is auto (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), help="the model's tool-call format")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let accepted requests finish before aborting them")
    p.add_argument("--failure-timeout", type=float, default=DEFAULT_FAILURE_TIMEOUT,
                   help="several processes: seconds without progress after which a process counts as dead "
                        "(process 0 answers 503 and exits 1; followers exit 1)")
    p.add_argument("--coordinator-address", help="host:port of process 0, to run one model over several processes")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0, help="0 serves HTTP; the others follow its engine")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning",
                   help="uvicorn's own log level; 'info' adds its access log (default: %(default)s, quieter than "
                        "vLLM's info: dcpjax logs its own line per request)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log a line per finished request (method, path, status, request id, tokens, "
                        "finish reason, latency)")
    cli.add_debug_flag(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed."""
    parser = build_parser()
    args = cli.parse_with_model(parser, argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(sorted(PARSERS))})")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id must be in [0, --num-processes) and --num-processes >= 1, got "
                     f"--process-id {args.process_id} --num-processes {args.num_processes}")
    if args.num_processes > 1 and not args.coordinator_address:
        parser.error("--num-processes > 1 needs --coordinator-address host:port (process 0's)")
    if args.num_processes > 1 and args.kv_transfer_config is not None:
        parser.error("--kv-transfer-config runs on one process per server (each transfer reads or writes every "
                     "device's pages from that process): drop --num-processes")
    return args


def init_distributed(args: argparse.Namespace) -> None:
    """jax.distributed over --num-processes processes (CPU collectives over gloo)."""
    import jax

    if args.num_processes > 1:
        if not args.coordinator_address:  # parse_args refuses this; a caller's own Namespace may not
            raise ValueError("--num-processes > 1 needs --coordinator-address host:port (process 0's)")
        if args.num_cpu_devices:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # From jax 0.12 the processes' collectives meet only when their executables are
        # byte-identical, stack-frame metadata included; process 0 steps on its engine thread, the
        # others on their main thread, so with frames every process waits in its first all-reduce
        # for ever (tests/test_multihost.py). No frames; and metadata in the compilation cache's key,
        # so an executable cached with frames (an earlier run) is not loaded by one process only.
        jax.config.update("jax_traceback_in_locations_limit", 0)
        jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
        jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)


def serve_http(args: argparse.Namespace, llm, channel, sock: socket.socket) -> int:
    """Process 0: the HTTP server over the engine on `sock` (`bind_port`), until SIGTERM/SIGINT (0)
    or an engine failure (1)."""
    import uvicorn

    from dcpjax.runner.compile_watch import compile_watch
    from dcpjax.serve.api import build_app
    from dcpjax.serve.async_engine import AsyncEngine
    from dcpjax.serve.metrics import Metrics
    from dcpjax.serve.process.shutdown import Draining, GracefulServer, add_availability_guard
    from dcpjax.serve.tools.calls import ToolConfig

    name = args.served_model_name or args.model
    metrics = Metrics(name)
    engine = AsyncEngine(llm.engine, metrics, channel, failure_timeout=args.failure_timeout)
    app = build_app(llm, engine, metrics, served_model_name=name, api_key=args.api_key,
                    max_body_bytes=args.max_request_bytes, chat_template=args.chat_template,
                    tools=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser),
                    log_requests=not args.disable_log_requests)
    draining = Draining()
    add_availability_guard(app, draining, engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    server = GracefulServer(config, engine, draining, args.shutdown_timeout)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    logger.info("serving %r on http://%s:%d (max_model_len %d)", name, args.host, port, llm.max_model_len)
    watch = compile_watch()
    logger.info("ready after %d XLA compiles and %d loads from the compilation cache %s (%.1f s building them)",
                watch.compiled, watch.loaded, llm.compilation_cache_dir or "(off)", watch.seconds)
    llm.mark_ready()  # a step shape first seen from now on is logged and counted
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    logger.info("stopped")
    return 0 if engine.failure is None else 1


def main(argv: list[str] | None = None) -> int:
    """Start the server (or, with --process-id > 0, follow process 0's engine)."""
    args = parse_args(argv)
    cli.configure_logging()
    if args.num_cpu_devices:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.num_cpu_devices)
    if args.process_id != 0:  # no HTTP here: run the same engine in lockstep with process 0
        return follow_process_0(args)
    with bind_port(args.host, args.port) as sock:  # closed however the load or the server ends
        init_distributed(args)
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
        channel = None
        if args.num_processes > 1:
            from dcpjax.serve.process.multihost import CommandChannel

            channel = CommandChannel()
        return serve_http(args, llm, channel, sock)


def follow_process_0(args: argparse.Namespace) -> int:
    """A process > 0 of a multi-process model: the same engine, in lockstep with process 0's."""
    from dcpjax.serve.process.multihost import CommandChannel, follow

    init_distributed(args)
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    logger.info("process %d following process 0", args.process_id)
    return follow(llm.engine, CommandChannel(), args.process_id, args.failure_timeout)


if __name__ == "__main__":
    sys.exit(cli.run(main))
