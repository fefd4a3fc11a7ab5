"""The start-up precompile: after it, no request mix makes XLA compile anything."""

import pytest

from dcpjax import LLM, SamplingParams
from dcpjax.runner import precompile
from dcpjax.runner.compile_watch import compile_watch

# a small grid: rows {1, 2}, packed calls of 8 tokens, one width (3 blocks of 8 x DCP 2)
SMALL = dict(tensor_parallel_size=4, decode_context_parallel_size=2, max_model_len=48, max_num_seqs=2,
             max_num_batched_tokens=8, block_size=8, kv_cache_memory_bytes=1 << 20)


def test_after_precompile_no_request_mix_compiles_anything():
    llm = LLM("tiny-llama", enforce_eager=False, **SMALL)
    runner = llm.runner
    assert llm.precompile_seconds is not None and runner.ready
    grid = llm.shape_grid
    assert grid.rows == (1, 2) and grid.tokens == (8,) and grid.widths == (3,)
    seen = set(runner.seen)
    assert seen == set(grid.call_shapes()) | set(grid.sampler_shapes())
    compiled = compile_watch().compiled
    prompts = ["a", "hello", "a longer prompt of 30 tokens..", "hello there"]
    mixes = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, logprobs=2, n=2, seed=1),
             SamplingParams(temperature=0.7, top_k=300, presence_penalty=0.5, max_tokens=6, prompt_logprobs=1),
             SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=3, logit_bias={65: 2.0}, ignore_eos=True),
             SamplingParams(temperature=1.0, min_p=0.1, max_tokens=17, frequency_penalty=0.3, ignore_eos=True)]
    for params in mixes:  # the second time round, the prompts hit the prefix cache
        llm.generate(prompts, params)
    llm.generate(prompts[::-1], mixes[1])
    assert runner.seen == seen  # every shape dispatched was precompiled
    assert runner.steps_compiled_after_ready == 0
    assert compile_watch().compiled == compiled  # nothing at all compiled while generating


def test_cpu_defaults_to_eager():
    llm = LLM("tiny-llama", **SMALL)  # enforce_eager=None: eager on CPU
    assert llm.precompile_seconds is None and not llm.runner.ready and not llm.runner.seen


def test_a_precompile_past_the_memory_map_limit_is_refused(monkeypatch):
    monkeypatch.setattr(precompile, "max_map_count", lambda: 1000)
    with pytest.raises(ValueError, match=r"max_map_count=1,000: lower max_num_seqs.*enforce_eager=True"):
        LLM("tiny-llama", enforce_eager=False, **SMALL)


def test_a_kv_transfers_gathers_and_scatters_are_precompiled():
    """Prefill/decode disaggregation: the producer's gathers and the consumer's scatters of every
    bucket are compiled with the steps, so a transfer compiles nothing while requests wait."""
    p = LLM("tiny-llama", enforce_eager=False, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0}, **SMALL)
    d = LLM("tiny-llama", enforce_eager=False, kv_transfer_config={"kv_role": "kv_consumer"},
            **{**SMALL, "decode_context_parallel_size": 1, "block_size": 16})
    # tokens per rank: 48 tokens at DCP 1 on the consumer
    assert p.kv_connector.mover.gather_buckets(48) == [1, 2, 4] and d.kv_connector.mover.scatter_buckets(48) == [16,
                                                                                                               32, 64]
    compiled = compile_watch().compiled
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 17, 40)]  # 1, 2 and 3 blocks of 8 x DCP 2
    handoff = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    handles = p.generate(prompts, handoff)
    outputs = d.generate(prompts, [SamplingParams(temperature=0, max_tokens=4, extra_args={
        "kv_transfer_params": h.kv_transfer_params}) for h in handles])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert d.kv_connector.stats.take()[0] == {"received": 3}
    assert compile_watch().compiled == compiled
