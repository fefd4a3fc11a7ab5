"""`python -m dcpjax.serve`: an OpenAI-compatible server (vLLM's flag names).

    python -m dcpjax.serve --num-cpu-devices 8 --tensor-parallel-size 8 \\
        --decode-context-parallel-size 2 --port 8000
"""

from __future__ import annotations

import argparse
import logging
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dcpjax.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="HF folder or built-in name (tiny-llama, tiny-qwen3, ...)")
    p.add_argument("--served-model-name", help="the name clients use (default: --model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    p.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", choices=["auto", "pallas", "reference"], default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1/*")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    p.add_argument("--num-cpu-devices", type=int, default=0,
                   help="fake this many CPU devices in this process (0: real devices)")
    p.add_argument("--coordinator-address", help="host:port of process 0, to run one model over several processes")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0, help="0 serves HTTP; the others follow its engine")
    return p.parse_args(argv)


def init_distributed(args) -> None:
    """jax.distributed over --num-processes processes (CPU collectives over gloo)."""
    import jax

    if args.num_processes > 1:
        if not args.coordinator_address:
            raise SystemExit("--num-processes > 1 needs --coordinator-address host:port")
        if args.num_cpu_devices:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.num_cpu_devices:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.num_cpu_devices)
    init_distributed(args)
    import uvicorn

    import dcpjax
    from dcpjax.serve.api import build_app
    from dcpjax.serve.async_engine import AsyncEngine
    from dcpjax.serve.metrics import Metrics

    llm = dcpjax.LLM(
        args.model, tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size, dcp_comm_backend=args.dcp_comm_backend,
        dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend, seed=args.seed,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    channel = None
    if args.num_processes > 1:
        from dcpjax.serve.multihost import CommandChannel, follow

        channel = CommandChannel()
        if args.process_id != 0:  # no HTTP here: run the same engine in lockstep with process 0
            logging.getLogger("dcpjax").info("process %d following process 0", args.process_id)
            follow(llm.engine, channel)
            return 0
    name = args.served_model_name or args.model
    metrics = Metrics(name)
    engine = AsyncEngine(llm.engine, metrics, channel)
    app = build_app(llm, engine, metrics, served_model_name=name, api_key=args.api_key,
                    max_body_bytes=args.max_request_bytes)
    logging.getLogger("dcpjax").info("serving %r on http://%s:%d (max_model_len %d)", name, args.host, args.port,
                                     llm.max_model_len)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
