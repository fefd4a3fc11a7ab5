"""The planner's roofline against measured decode steps, on 8 fake CPU devices.

    python benchmarks/roofline_check.py                       # tiny-llama, TP 8, contexts 1k..16k
    python benchmarks/roofline_check.py --contexts 1024 32768 --batch 2

First it measures the CPU "device" the way the planner needs it: memcpy bandwidth (one
host's, shared by the 8 fake devices, so a device gets an eighth), and the latency and
bandwidth of a collective over the 8 devices. Then, for each context and DCP size, it
predicts the decode step with `dcpjax.plan.planner.plan_size` (same model, same KV bytes, same
batch) and measures it (`decode.py`'s timed steps), and prints measured / predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from decode import run
from jax.sharding import PartitionSpec as P

from dcpjax.models.config import TINY_MODELS
from dcpjax.plan import planner
from dcpjax.plan.deployment import weight_bytes_per_device
from dcpjax.sharding.config import ParallelConfig

KV_BYTES = 256 << 20  # what decode.run gives each device


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_cpu() -> tuple[planner.Device, planner.Link]:
    """The CPU preset, measured: per-device memcpy bandwidth and one collective's latency and bandwidth."""
    src = np.ones(64 << 20, np.float32)  # 256 MiB
    dst = np.empty_like(src)
    copy = _best(lambda: np.copyto(dst, src))
    devices = len(jax.devices())
    mesh = jax.make_mesh((devices,), ("x",))

    gather_all = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh=mesh,
                                       in_specs=P("x"), out_specs=P(), check_vma=False))
    gather = lambda x: gather_all(x).block_until_ready()
    sharded = jax.sharding.NamedSharding(mesh, P("x"))
    small = jax.device_put(jnp.ones(devices, jnp.float32), sharded)
    large = jax.device_put(jnp.ones(devices * (4 << 20), jnp.float32), sharded)
    latency = _best(functools.partial(gather, small), 20)
    moved = large.nbytes * (devices - 1) / devices  # what each device receives
    bandwidth = moved / max(_best(functools.partial(gather, large)) - latency, 1e-9)
    device = dataclasses.replace(planner.DEVICES["cpu"], hbm_tbps=2 * src.nbytes / copy / devices / 1e12,
                                 source="measured: numpy memcpy of 256 MiB, shared by the fake devices")
    link = planner.Link("cpu", bandwidth / 1e9, latency * 1e6, "measured: all_gather over the fake devices")
    return device, link


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    device, link = measure_cpu()
    print(f"{args.model}, TP {args.tp}, batch {args.batch}, {time.strftime('%Y-%m-%d')}; measured CPU preset: "
          f"{device.hbm_tbps * 1e3:.1f} GB/s per fake device, collective {link.latency_us:.0f} us + "
          f"{link.gbps:.2f} GB/s\n")
    print("| context | DCP | predicted step ms (HBM part) | measured step ms | measured / predicted |")
    print("|---:|---:|---:|---:|---:|")
    cfg = TINY_MODELS[args.model]
    for context in args.contexts:
        for dcp in args.dcp:
            pc = ParallelConfig(args.tp, dcp)
            weights = weight_bytes_per_device(cfg, pc, jnp.float32)
            row = planner.plan_size(cfg, pc, device=dataclasses.replace(device, memory_gb=(KV_BYTES + weights) / 1e9),
                                    link=link, workload=planner.Workload(context, args.steps, args.batch),
                                    weight_bytes=weights, kv_dtype=jnp.float32, utilization=1.0, q_bytes=4,
                                    weight_dtype="float32")
            predicted = row["step_seconds"]["ag_rs"]
            measured = run(args.model, args.tp, dcp, context, args.batch, args.steps)["step_ms"] / 1e3
            print(f"| {context:,} | {dcp} | {predicted * 1e3:.3f} ({row['hbm_seconds'] * 1e3:.3f}) | "
                  f"{measured * 1e3:.2f} | {measured / predicted:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
