"""How many bytes of KV cache each device gets when the user does not say (vLLM's
gpu_memory_utilization on accelerators; on CPU, a modest fixed budget), and the KV cache an engine
builds from them.

CPU: the fake devices all live in this process's host memory, so a share of the host (as a GPU's
share of its own memory) would make a 135M model's server take gigabytes. The default is what a
user expects of a CPU run: at most `CPU_KV_BUDGET_BYTES` for the process's devices together (more
only when one max_model_len sequence needs it), no more than max_num_seqs sequences of
max_model_len can fill, and never more than a quarter of the host's available memory."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.runner.kv_layout import KVCacheLayout, kv_block_layout, kv_cache_layout
from dcpjax.sharding.config import ParallelConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 64 << 20  # per device, where the host's available memory cannot be read
CPU_KV_SHARE = 0.25  # of the host's available memory, for all of this process's devices together: the most
CPU_KV_BUDGET_BYTES = 1 << 30  # for all of this process's devices together, unless one sequence needs more


def host_available_bytes() -> int | None:
    """The host memory the kernel could give this process now (Linux' MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def _free_bytes(device: jax.Device, utilization: float, devices_sharing_host: int) -> int:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no device memory; all of the process's devices share the host's
        available = host_available_bytes()
        return CPU_DEFAULT_KV_BYTES if available is None else int(available * CPU_KV_SHARE / devices_sharing_host)
    return int(stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0))


def kv_bytes_per_device(requested: int | None, utilization: float, mesh, most_useful: int | None = None,
                        one_sequence: int = 0) -> int:
    """KV bytes per device: as requested, or what the fullest of this process's mesh devices has
    free (on CPU: `CPU_KV_BUDGET_BYTES` over the process's devices, or `one_sequence`'s bytes if
    more, no more than `most_useful`, what max_num_seqs sequences of max_model_len can fill, and at
    most a share of the host's available memory); over several processes, the smallest any process
    has (every process must build the same cache, and a process can read only its own devices'
    memory statistics)."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {requested}")
        return int(requested)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    # CPU processes are assumed to share one host (how multi-process CPU runs here): each takes its part
    free = min(_free_bytes(d, utilization, len(mine) * jax.process_count()) for d in mine)
    if mine[0].platform == "cpu":
        budget = max(CPU_KV_BUDGET_BYTES // len(mine), one_sequence)
        free = min(free, budget if most_useful is None else min(budget, most_useful))
        logger.info("KV cache on CPU by default: %.1f MiB per device, %.2f GiB for this process's %d devices (up to "
                    "%.0f GiB in all, or one max_model_len sequence; no more than max_num_seqs sequences fill; at most "
                    "a quarter of available memory): --kv-cache-memory-bytes sets it", free / 2**20,
                    free * len(mine) / 2**30, len(mine), CPU_KV_BUDGET_BYTES / 2**30)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # int32 KiB (< 2 TiB), rounded up: a budget of exactly one sequence must not lose a block
        kib = multihost_utils.process_allgather(np.asarray(-(-max(free, 0) // 1024), np.int32))
        free = int(np.min(kib)) * 1024
    return free


def size_kv_cache(cfg: ModelConfig, pc: ParallelConfig, mesh, *, max_model_len: int, block_size: int,
                  max_num_seqs: int, dtype, requested: int | None, utilization: float,
                  draft_bytes_per_block: int = 0,
                  max_num_batched_tokens: int | None = None) -> tuple[KVCacheLayout, int, int]:
    """The KV cache layout for the bytes per device `requested` (default: a share of device memory,
    at most what max_num_seqs sequences of max_model_len fill), those bytes and the tokens it holds
    (`kv_cache_tokens`). A hybrid model's
    linear-attention state (one per slot) comes out of them first; a draft model's KV
    (`draft_bytes_per_block`) shares the blocks. Logs the size; ValueError if max_model_len does
    not fit. With sliding-window layers (`models.kv_groups`) a block id holds one group's layers, a
    sequence's sliding groups hold their window and the step's chunk (`max_num_batched_tokens`, default
    max_model_len) and the tokens logged are those of the longest sequence the blocks hold."""
    groups = KVCacheGroups.of(cfg)
    per_block = kv_block_layout(cfg, pc, block_size=block_size, dtype=dtype).bytes_per_block_per_device(
        groups.size, pc.kv_head_groups) + draft_bytes_per_block
    vbs, chunk = block_size * pc.dcp, max_num_batched_tokens or max_model_len
    blocks_per_seq = groups.blocks_for(max_model_len, vbs, chunk) + groups.reserved_blocks  # + the null block
    state_bytes = max_num_seqs * cfg.linear_state_bytes(pc.tp)
    budget = kv_bytes_per_device(requested, utilization, mesh, max_num_seqs * blocks_per_seq * per_block + state_bytes,
                                 one_sequence=blocks_per_seq * per_block + state_bytes)
    if state_bytes:
        logger.info("linear-attention state: %.1f MiB per device (%d slots x %d bytes)", state_bytes / 2**20,
                    max_num_seqs, state_bytes // max_num_seqs)
        if state_bytes >= budget:
            raise ValueError(f"the linear-attention state of max_num_seqs={max_num_seqs} sequences takes {state_bytes} "
                             f"bytes per device, all of the {budget} for the cache: lower max_num_seqs or raise "
                             "kv_cache_memory_bytes")
    kv = kv_cache_layout(cfg, pc, block_size=block_size, dtype=dtype, bytes_per_device=budget - state_bytes,
                         extra_bytes_per_block=draft_bytes_per_block)
    tokens = kv_cache_tokens(cfg, kv.num_blocks, block_size, pc.dcp, chunk)
    per_device = kv.num_blocks * kv.bytes_per_block_per_device(groups.size, pc.kv_head_groups)
    logger.info("TP %d, DCP %d over %d %s device(s): mesh %s, its axes (TP // DCP, DCP)", pc.tp, pc.dcp, pc.tp,
                mesh.devices.flat[0].platform, dict(mesh.shape))
    if groups.sliding:
        logger.info("KV cache size: %d tokens of one sequence (%d blocks of %d x DCP %d, each %d layers of one of %d "
                    "groups; sliding groups (window %s) keep only the blocks their window reaches; %.1f MiB per "
                    "device)", tokens, kv.num_blocks, block_size, pc.dcp, groups.size, groups.num_groups,
                    "/".join(map(str, groups.sliding_windows)), per_device / 2**20)
    else:
        logger.info("KV cache size: %d tokens (%d blocks of %d x DCP %d; %.1f MiB per device)", tokens, kv.num_blocks,
                    block_size, pc.dcp, per_device / 2**20)
    if blocks_per_seq > kv.num_blocks:
        raise ValueError(f"max_model_len={max_model_len} needs {blocks_per_seq} KV blocks but the cache holds "
                         f"{kv.num_blocks} ({tokens} tokens) — raise kv_cache_memory_bytes (--kv-cache-memory-bytes) "
                         "or lower max_model_len (--max-model-len)")
    return kv, budget, tokens


def kv_cache_tokens(cfg: ModelConfig, num_blocks: int, block_size: int, dcp: int, chunk: int) -> int:
    """The cache's size in tokens: every block's positions (num_blocks x block_size x DCP), or with
    sliding-window groups the longest one sequence whose full groups' blocks and sliding groups'
    windows fit."""
    groups = KVCacheGroups.of(cfg)
    if not groups.sliding:
        return num_blocks * block_size * dcp
    return groups.longest_sequence(num_blocks - groups.reserved_blocks, block_size * dcp, chunk, 1 << 40)
