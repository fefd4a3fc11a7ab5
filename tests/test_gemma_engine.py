"""Tiny random Gemma 3 (tests/fixtures/gemma3-tiny: window 8 on four of six layers, soft-capped logits) in
the engine: its sliding layers free the blocks behind their windows (`models.kv_groups`: one full and two
sliding groups of two layers), a cache too small for its requests preempts some, and each recomputes its
prompt and the tokens it had generated into new blocks, every window and LSE merge the same: its outputs stay
transformers'.
Parity across layouts (packed prefill chunks of a 64-token budget, both kernels) is in test_hf_parity.py."""

import json
import pathlib

import jax.numpy as jnp

import dcpjax
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.runner.kv_layout import kv_block_layout

FOLDER = pathlib.Path(__file__).parent / "fixtures" / "gemma3-tiny"
CASES = json.loads((FOLDER / "expected.json").read_text())["cases"]


def _bytes_for_blocks(blocks: int, pc: dcpjax.ParallelConfig, block_size: int) -> int:
    """kv_cache_memory_bytes that hold `blocks` blocks (one KV cache group's layers each) of `block_size`
    tokens per rank on `pc` (float32)."""
    cfg = ModelConfig.from_pretrained(FOLDER)
    per_block = kv_block_layout(cfg, pc, block_size=block_size, dtype=jnp.float32).bytes_per_block_per_device(
        KVCacheGroups.of(cfg).size, pc.kv_head_groups)
    return blocks * per_block


def test_preemption_recomputes_through_the_windows_exactly():
    """TP 4 / DCP 4, blocks of 4 tokens per rank (virtual blocks of 16): 28 blocks of two layers (one the
    null block). The 200-token prompt and its 20 new tokens take 14 blocks in each of the three groups
    without freeing (42: it could not start); the sliding groups keep at most their window and a 64-token
    chunk (6 blocks each), so 26 do. The eight requests (each prompt twice) wait or are preempted and
    recomputed, the second copy of a prompt from its first's cached prefix, windows included; every output
    is transformers' greedy, and every block comes back."""
    pc = dcpjax.ParallelConfig(4, 4)
    llm = dcpjax.LLM(str(FOLDER), tensor_parallel_size=4, decode_context_parallel_size=4, block_size=4,
                     max_num_batched_tokens=64, max_model_len=240, kv_cache_memory_bytes=_bytes_for_blocks(28, pc, 4))
    assert llm.runner.kv_layout.num_blocks == 28 and llm.runner.kv_groups.num_groups == 3
    params = dcpjax.SamplingParams(temperature=0, max_tokens=20)
    outputs = llm.generate([{"prompt_token_ids": case["prompt"]} for case in CASES * 2], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert llm.engine.scheduler.allocator.stats.hits > 0  # the second copies found their first's prefix
    for case, output in zip(CASES * 2, outputs):
        assert output.outputs[0].token_ids == case["greedy"], f"prompt of {len(case['prompt'])} tokens"
    assert llm.engine.scheduler.num_dead_blocks_freed > 0
    pool = llm.engine.scheduler.allocator
    assert pool.num_free == pool.num_usable and not any(pool.ref_counts)
