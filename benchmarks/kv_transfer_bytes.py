"""Bytes one prompt's KV moves in prefill/decode disaggregation, before and after the connector
became two halves (issue 46), for SmolLM2-135M's cache (30 layers, 3 KV heads, head_dim 64, float32
on CPU) and the pairs tests/test_disaggregated_serving.py runs.

Three legs: the producer's device -> host copy, the wire, the consumer's host -> device placement
(summed over its devices). Before (the code of commit 20e38e5): the producer copied every stored
head copy of its gathered pages to the host (head repeats, the block bucket); the consumer put the
prompt back in position order on its host and placed [kv_slots, bucket(n), d] per layer split over
"tp" only, so every DCP rank received every position. After: distinct heads only, gathered on the
devices; each consumer device receives its rank's positions of its own head slots.

The "after" counts are measured: a tiny-llama pair runs in this process and the bytes each leg
really moved (the gathered arrays, the wire arrays, the shards of the placed arrays) are checked
against the same formulas, so the SmolLM2 rows use formulas proven on real arrays.

    python benchmarks/kv_transfer_bytes.py
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def bucket(n: int, smallest: int = 16) -> int:
    return max(smallest, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Side:
    tp: int
    dcp: int = 1
    interleave: int = 1
    block_size: int = 16

    def slots(self, kv_heads: int) -> int:
        return max(kv_heads, self.tp // self.dcp)  # a head stored once per "tp" group when groups > heads

    def blocks(self, n: int) -> int:
        return -(-n // (self.block_size * self.dcp))

    def rank_max(self, n: int) -> int:
        rounds, rest = divmod(n, self.interleave * self.dcp)
        return rounds * self.interleave + min(rest, self.interleave)


def legs(n: int, p: Side, d: Side, layers=30, kv_heads=3, dims=(64, 64), itemsize=4) -> dict:
    """Bytes of each leg, before and after, for a prompt of n tokens."""
    width = sum(dims) * itemsize * layers  # one token of one head, every layer, K and V
    gathered_tokens = bucket(p.blocks(n), 1) * p.block_size * p.dcp
    return {
        "before": {"device->host": p.slots(kv_heads) * gathered_tokens * width,
                   "wire": kv_heads * n * width,
                   "host->device": d.slots(kv_heads) * bucket(n) * width * d.dcp},
        "after": {"device->host": kv_heads * gathered_tokens * width,
                  "wire": kv_heads * n * width,
                  "host->device": d.slots(kv_heads) * bucket(d.rank_max(n)) * width * d.dcp},
    }


PAIRS = {"TP 9 -> TP 9 / DCP 3": (Side(9), Side(9, 3)),  # the producer stores each KV head 3 times
         "TP 3 -> TP 9 / DCP 3": (Side(3), Side(9, 3)),
         "TP 9 / DCP 3 I16 -> TP 9": (Side(9, 3, 16), Side(9)),
         "MLA-like latent (576 wide), TP 8 -> TP 8 / DCP 8": (Side(8), Side(8, 8))}


def measured_check() -> None:
    """A tiny-llama pair in this process: each leg's real bytes equal `legs(...)["after"]`."""
    import dcpjax
    from dcpjax import SamplingParams
    from dcpjax.kv_transfer import device_io

    dcpjax.use_cpu_devices(8)
    n, p_side, d_side = 300, Side(2, block_size=16), Side(8, 4, 2, 16)
    common = dict(max_model_len=512, kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=128, enforce_eager=True)
    p = dcpjax.LLM("tiny-llama", tensor_parallel_size=2, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0},
                   **common)
    d = dcpjax.LLM("tiny-llama", tensor_parallel_size=8, decode_context_parallel_size=4, cp_kv_cache_interleave_size=2,
                   kv_transfer_config={"kv_role": "kv_consumer"}, **common)
    seen = {"device->host": 0, "host->device": 0}
    gather, place = device_io.KVMover.gather, device_io.KVMover.place

    def counting_gather(self, blocks, slot):
        arrays = gather(self, blocks, slot)
        seen["device->host"] += sum(a.nbytes for a in arrays.values())
        return arrays

    def counting_place(self, updates, states):
        placed = place(self, updates, states)
        seen["host->device"] += sum(s.data.nbytes for a in placed[0].values() for s in a.addressable_shards)
        return placed

    device_io.KVMover.gather, device_io.KVMover.place = counting_gather, counting_place
    try:
        ids = list(np.random.default_rng(0).integers(3, 250, n))
        handoff = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        handle = p.generate([{"prompt_token_ids": ids}], handoff)[0].kv_transfer_params
        d.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2,
                                                               extra_args={"kv_transfer_params": handle}))
    finally:
        device_io.KVMover.gather, device_io.KVMover.place = gather, place
    cfg = p.model_config
    want = legs(n, p_side, d_side, layers=cfg.num_kv_layers, kv_heads=cfg.num_key_value_heads,
                dims=(cfg.head_dim, cfg.head_dim))["after"]
    seen["wire"] = handle["transfer_bytes"]
    assert seen == want, (seen, want)
    print(f"measured on tiny-llama (TP 2 -> TP 8 / DCP 4 I2, {n} tokens): {seen} == the formulas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args()
    if not args.skip_measured:
        measured_check()
    print("| pair | tokens | leg | before (MB) | after (MB) | after / before |")
    print("|---|---:|---|---:|---:|---:|")
    for name, (p, d) in PAIRS.items():
        kv_heads = 1 if "MLA" in name else 3
        dims = (576,) if "MLA" in name else (64, 64)
        for n in args.tokens:
            counted = legs(n, p, d, kv_heads=kv_heads, dims=dims)
            for leg in ("device->host", "wire", "host->device"):
                before, after = counted["before"][leg], counted["after"][leg]
                print(f"| {name} | {n:,} | {leg} | {before / 1e6:,.1f} | {after / 1e6:,.1f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
