"""Tiny random Gemma 3 (tests/fixtures/gemma3-tiny: window 8 on four of six layers, soft-capped logits) in
the engine: a cache too small for its requests preempts some, and each recomputes its prompt and the tokens
it had generated into new blocks, every window and LSE merge the same: its outputs stay transformers'.
Parity across layouts (packed prefill chunks of a 64-token budget, both kernels) is in test_hf_parity.py."""

import json
import pathlib

import jax.numpy as jnp

import dcpjax
from dcpjax.models.config import ModelConfig
from dcpjax.runner.kv_layout import kv_block_layout

FOLDER = pathlib.Path(__file__).parent / "fixtures" / "gemma3-tiny"
CASES = json.loads((FOLDER / "expected.json").read_text())["cases"]


def _bytes_for_blocks(blocks: int, pc: dcpjax.ParallelConfig, block_size: int) -> int:
    """kv_cache_memory_bytes that hold `blocks` blocks of `block_size` tokens per rank on `pc` (float32)."""
    cfg = ModelConfig.from_pretrained(FOLDER)
    per_block = kv_block_layout(cfg, pc, block_size=block_size, dtype=jnp.float32).bytes_per_block_per_device(
        cfg.num_kv_layers, pc.kv_head_groups)
    return blocks * per_block


def test_preemption_recomputes_through_the_windows_exactly():
    """TP 4 / DCP 4, blocks of 4 tokens per rank (virtual blocks of 16): 24 blocks hold the 200-token prompt
    and its 20 new tokens (14 blocks) and little else, so the eight requests (each prompt twice) wait or are
    preempted and recomputed, the second copy of a prompt from its first's cached prefix; every output is
    transformers' greedy, and every block comes back."""
    pc = dcpjax.ParallelConfig(4, 4)
    llm = dcpjax.LLM(str(FOLDER), tensor_parallel_size=4, decode_context_parallel_size=4, block_size=4,
                     max_num_batched_tokens=64, max_model_len=240, kv_cache_memory_bytes=_bytes_for_blocks(24, pc, 4))
    assert llm.runner.kv_layout.num_blocks == 24
    params = dcpjax.SamplingParams(temperature=0, max_tokens=20)
    outputs = llm.generate([{"prompt_token_ids": case["prompt"]} for case in CASES * 2], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert llm.engine.scheduler.allocator.stats.hits > 0  # the second copies found their first's prefix
    for case, output in zip(CASES * 2, outputs):
        assert output.outputs[0].token_ids == case["greedy"], f"prompt of {len(case['prompt'])} tokens"
    pool = llm.engine.scheduler.allocator
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)
