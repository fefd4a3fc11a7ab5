"""The hybrid model (Qwen3-Next, tiny random, tests/fixtures/qwen3-next) in the engine: its state per
slot survives preemption, aborts and chunked prefill exactly; DCP splits only the full-attention
layers' KV; what it cannot do yet is refused by name. Parity with transformers across layouts is
in test_hf_parity.py."""

import dataclasses
import json
import logging
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import dcpjax
from dcpjax.kernels import KVPools, LinearState
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import layout_problems
from dcpjax.runner.compile_watch import compile_watch
from dcpjax.runner.kv_layout import kv_block_layout

FOLDER = pathlib.Path(__file__).parent / "fixtures" / "qwen3-next"
CASES = json.loads((FOLDER / "expected.json").read_text())["cases"]
GREEDY = dcpjax.SamplingParams(temperature=0, max_tokens=20)


def make(**kw):
    kw = dict(tensor_parallel_size=4, decode_context_parallel_size=2, block_size=4, max_num_batched_tokens=64,
              kv_cache_memory_bytes=8 << 20) | kw
    return dcpjax.LLM(str(FOLDER), **kw)


def prompts():
    return [{"prompt_token_ids": case["prompt"]} for case in CASES]


@pytest.mark.e2e  # half a minute: newest jax only (preemption's recompute is the engine's, not jax's)
def test_preemption_recomputes_the_state_exactly():
    """A cache of 48 blocks of 4 x DCP 2 tokens holds the 300-token prompt and little else: the others
    wait or are preempted and recomputed from their start, and every output is transformers'."""
    llm = make(kv_cache_memory_bytes=_bytes_for_blocks(48), max_model_len=330)
    assert llm.runner.kv_layout.num_blocks == 48
    outputs = llm.generate(prompts() * 2, GREEDY)
    assert llm.engine.num_preemptions > 0
    for case, output in zip(CASES * 2, outputs):
        assert output.outputs[0].token_ids == case["greedy"], f"prompt of {len(case['prompt'])} tokens"
    assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_blocks


def _bytes_for_blocks(blocks: int) -> int:
    """kv_cache_memory_bytes that hold `blocks` blocks (of 4 tokens, TP 4 / DCP 2) and 64 slots' state."""
    cfg, pc = ModelConfig.from_pretrained(FOLDER), dcpjax.ParallelConfig(4, 2)
    per_block = kv_block_layout(cfg, pc, block_size=4, dtype=jnp.float32).bytes_per_block_per_device(
        cfg.num_kv_layers, pc.kv_head_groups)
    return blocks * per_block + 64 * cfg.linear_state_bytes(4)


@pytest.mark.e2e  # slow; the oldest jax proves the slot state by preemption and n sequences
def test_an_abort_mid_sequence_leaves_its_slot_clean_for_the_next():
    llm = make(max_num_seqs=2)
    engine = llm.engine
    drop = llm.make_sequence(prompts()[3], GREEDY, 0)
    keep = llm.make_sequence(prompts()[4], GREEDY, 1)
    engine.add(drop)
    engine.add(keep)
    for _ in range(4):  # both mid-prefill or mid-decode
        engine.step()
    slot = drop.slot
    assert engine.abort(drop.request_id)
    late = llm.make_sequence(prompts()[2], GREEDY, 2)  # takes the aborted sequence's slot
    engine.add(late)
    while engine.has_work():
        engine.step()
    assert late.slot is None and keep.output_ids == CASES[4]["greedy"] and late.output_ids == CASES[2]["greedy"]
    assert slot in (0, 1)


def test_dcp_splits_the_full_attention_kv_and_the_state_is_fixed():
    """KV bytes per device at DCP 4 are a quarter of DCP 1's (the one full-attention layer's only);
    the linear layers' state is the same at every DCP size: max_num_seqs slots x its bytes."""
    cfg = ModelConfig.from_pretrained(FOLDER)
    sizes = {}
    for dcp in (1, 4):
        llm = make(tensor_parallel_size=8, decode_context_parallel_size=dcp, kv_cache_memory_bytes=4 << 20,
                   max_num_seqs=16)
        caches = llm.runner.kv_caches
        assert [isinstance(c, LinearState) for c in caches] == [True, True, True, False]
        pools = [c for c in caches if isinstance(c, KVPools)]
        per_block = sum(p.bytes_per_device() for p in pools) // llm.runner.kv_layout.num_blocks
        state = sum(c.bytes_per_device() for c in caches if isinstance(c, LinearState))
        sizes[dcp] = (per_block / (llm.runner.kv_layout.block_size * dcp), state, llm.kv_cache_size_tokens)
    assert sizes[4][0] == sizes[1][0] / 4  # KV bytes per token per device
    assert sizes[1][1] == sizes[4][1] == 16 * cfg.linear_state_bytes(8)  # 16 slots, heads over 8 devices
    assert sizes[4][2] > 3.9 * sizes[1][2]  # the same budget holds about 4x the tokens


def test_prefix_caching_is_off_and_speculation_refused(caplog):
    with caplog.at_level(logging.INFO, logger="dcpjax.llm"):
        llm = make()
    assert not llm.scheduler_config.enable_prefix_caching
    assert "prefix caching: off for Qwen3NextForCausalLM" in caplog.text
    twice = llm.generate([prompts()[3]] * 2, GREEDY)  # no block of the first is reused by the second
    assert [o.num_cached_tokens for o in twice] == [0, 0]
    assert all(o.outputs[0].token_ids == CASES[3]["greedy"] for o in twice)
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3NextForCausalLM"):
        make(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # nor may a hybrid be the draft model: its state would run on past rejected drafts
    with pytest.raises(ValueError, match="is a hybrid .Qwen3NextForCausalLM.: a draft model must keep only a KV"):
        dcpjax.LLM(str(FOLDER.parent / "qwen3"), tensor_parallel_size=4, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=8 << 20,
                   speculative_config={"method": "draft_model", "model": str(FOLDER), "num_speculative_tokens": 2})


def test_a_config_without_full_attention_is_refused(tmp_path):
    config = json.loads((FOLDER / "config.json").read_text())
    config["layer_types"] = ["linear_attention"] * config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types has no 'full_attention' layer"):
        ModelConfig.from_pretrained(tmp_path)


def test_linear_heads_must_split_over_tp():
    """Linear-attention heads split over all TP devices: 4 key heads cannot split over TP 8, a
    problem that names the parameter and the split counts that work (the planner reports the same)."""
    cfg = dataclasses.replace(ModelConfig.from_pretrained(FOLDER), linear_num_key_heads=4, linear_num_value_heads=8)
    problems = layout_problems(cfg, dcpjax.ParallelConfig(8, 2))
    assert any("layers.0.attention.q_proj dimension 1 ('linear_heads', size 4) cannot be split over 8 devices" in p
               for p in problems), problems
    assert layout_problems(cfg, dcpjax.ParallelConfig(4, 2)) == []


@pytest.mark.oldest_jax  # slow; the newest jax proves the slot state by preemption and an abort
def test_sampled_and_n_sequences_each_keep_their_own_state():
    """n = 3 sampled completions of one prompt, seeded: each reproduces alone (its own slot's state)."""
    llm = make()
    params = dcpjax.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, n=3, seed=7)
    together = [c.token_ids for c in llm.generate(prompts()[2], params)[0].outputs]
    assert len({tuple(t) for t in together}) > 1
    again = [c.token_ids for c in llm.generate([prompts()[2], prompts()[4]], params)[0].outputs]
    assert again == together
    assert np.all([len(t) == 12 for t in together])


@pytest.mark.oldest_jax  # 20 s: oldest jax only (tests/test_precompile.py runs on both)
def test_a_precompiled_hybrid_compiles_nothing_while_generating():
    """The start-up precompile covers the hybrid's calls too (packed prefill in whole chunks)."""
    llm = make(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, enforce_eager=False)
    assert llm.shape_grid.tokens == (16, 32) and llm.runner.precompiled
    compiled = compile_watch().compiled
    short = [case for case in CASES if len(case["prompt"]) <= 33]
    outputs = llm.generate([{"prompt_token_ids": c["prompt"]} for c in short], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy"] for c in short]
    llm.generate([{"prompt_token_ids": short[-1]["prompt"]}], dcpjax.SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert compile_watch().compiled == compiled and llm.runner.steps_compiled_after_ready == 0


def test_centred_norm_weights_keep_their_precision_in_bfloat16():
    """(1 + w) is formed in float32 and the result cast once, as transformers does: in bfloat16 a
    small w (|w| < 0.004) would round 1 + w to exactly 1."""
    from flax import nnx

    from dcpjax.models.layers import RMSNorm

    norm = RMSNorm(8, 1e-6, jnp.bfloat16, axis=None, offset=1.0)
    w = np.linspace(-3e-3, 3e-3, 8).astype(np.float32)
    norm.weight = nnx.Param(jnp.asarray(w, jnp.bfloat16))
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    w16 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    want = x16 / np.sqrt(np.mean(x16 * x16, axis=-1, keepdims=True) + 1e-6) * (1 + w16)
    got = np.asarray(norm(jnp.asarray(x, jnp.bfloat16)), np.float64)
    np.testing.assert_allclose(got, want, rtol=2 ** -8)  # one bfloat16 rounding
    assert not np.allclose(got, want / (1 + w16), rtol=1e-4)  # the weight is not lost
