"""Prefill/decode disaggregation in one process: a producer LLM at one layout prefills, a consumer
LLM at another pulls the KV over a real socket, re-shards it and decodes. Greedy tokens equal one
engine at the consumer's layout (the oracle: transformers-proven elsewhere), for prompts that cross
block and interleave boundaries; the bytes moved equal the prompt's analytic KV size.

(Across real processes through the router: tests/test_disaggregated_serving.py.)"""

import dataclasses
import json
import pathlib
import re
import socket
import time

import numpy as np
import pytest

import dcpjax
from dcpjax import SamplingParams
from dcpjax.engine.requests import RequestError
from dcpjax.kv_transfer import resharding
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.kv_transfer.layout import KVLayout
from dcpjax.kv_transfer.params import prompt_digest
from dcpjax.runner.kv_layout import kv_block_layout
from dcpjax.serve import __main__ as serve
from dcpjax.sharding.config import ParallelConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PROMPT_LENGTHS = (1, 15, 16, 17, 40, 70)  # one token, around a block of 16, several blocks and interleave runs


def _prompts(vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(3, min(vocab, 250), n).tolist()} for n in PROMPT_LENGTHS]


def _engines(model, producer: dict, consumer: dict, connector: str | None = None, **common):
    common = dict(max_model_len=160, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=32, max_num_seqs=8,
                  **common)
    p = dcpjax.LLM(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0, "kv_connector": connector},
                   **common, **producer)
    d = dcpjax.LLM(model, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": connector}, **common,
                   **consumer)
    alone = dcpjax.LLM(model, **common, **consumer)
    return p, d, alone


def disaggregated(p, d, prompts, max_tokens=12, logprobs=None):
    """Each prompt prefilled on `p` (max_tokens 1), decoded on `d` with the handle p returned."""
    handles = p.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=logprobs,
                                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs,
                             extra_args={"kv_transfer_params": h.kv_transfer_params}) for h in handles]
    return handles, d.generate(prompts, params)


def _check_equal(outputs, expected):
    """Greedy tokens identical; where both have logprobs, each within 1e-5 (the first token's within 5e-5:
    the producer computed it at its own layout)."""
    for got, want in zip(outputs, expected):
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids, got.prompt_token_ids[:4]
        for i, (token, mine, theirs) in enumerate(zip(a.token_ids, a.logprobs or [], b.logprobs or [])):
            # the first token is the producer's, computed at its own TP (float32 rounding of another split)
            assert abs(mine[token].logprob - theirs[token].logprob) <= (5e-5 if i == 0 else 1e-5), (i, mine, theirs)


PAIRS = [
    (dict(tensor_parallel_size=2), dict(tensor_parallel_size=8, decode_context_parallel_size=4,
                                        cp_kv_cache_interleave_size=2, block_size=8)),
    (dict(tensor_parallel_size=8, decode_context_parallel_size=4, cp_kv_cache_interleave_size=4),
     dict(tensor_parallel_size=8)),  # DCP 4 to DCP 1, each KV head stored 4 times on the consumer
    # fp8 KV moves as stored (values and per-token scales): the consumer holds what its own prefill would have
    (dict(tensor_parallel_size=4, decode_context_parallel_size=2, kv_cache_dtype="fp8"),
     dict(tensor_parallel_size=8, decode_context_parallel_size=4, block_size=32, kv_cache_dtype="fp8")),
]
# every pair through both connectors, each case on one of CI's Pythons: every pair and every connector
# runs on both (the connectors' own tests run on both too)
PAIR_PARAMS = [
    pytest.param(*PAIRS[0], "SocketConnector", marks=pytest.mark.e2e),
    pytest.param(*PAIRS[0], "JaxTransferConnector", marks=pytest.mark.oldest_jax),
    pytest.param(*PAIRS[1], "SocketConnector", marks=pytest.mark.e2e),
    pytest.param(*PAIRS[1], "JaxTransferConnector", marks=pytest.mark.oldest_jax),
    pytest.param(*PAIRS[2], "SocketConnector", marks=pytest.mark.oldest_jax),
    pytest.param(*PAIRS[2], "JaxTransferConnector", marks=pytest.mark.e2e),
]


@pytest.mark.parametrize("producer, consumer, connector", PAIR_PARAMS)
def test_tokens_equal_one_engine_at_the_consumers_layout(producer, consumer, connector):
    p, d, alone = _engines("tiny-llama", producer, consumer, connector)
    prompts = _prompts(p.vocab_size)
    handles, outputs = disaggregated(p, d, prompts, logprobs=2)
    _check_equal(outputs, alone.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=2)))
    padded = connector == "JaxTransferConnector"  # a device transport moves the gather's bucket of blocks
    for h, prompt in zip(handles, prompts):  # bytes moved: the prompt's KV, analytic (each KV head once)
        n = len(prompt["prompt_token_ids"])
        tokens = n if not padded else p.engine.kv_connector.scheduler.layout.padded_tokens(n) * p.parallel_config.dcp
        assert h.kv_transfer_params["transfer_bytes"] == analytic_bytes(p, tokens)
    stats = d.engine.kv_connector.stats
    assert stats.outcomes == {"received": len(prompts)}
    assert p.engine.kv_connector.stats.outcomes == {"sent": len(prompts)}
    assert stats.bytes == sum(h.kv_transfer_params["transfer_bytes"] for h in handles)
    assert p.engine.kv_connector.held_transfers == 0  # acknowledged, freed
    assert p.engine.kv_usage == 0 and d.engine.kv_usage == 0  # every block back in both pools
    first = outputs[1].outputs[0]  # the producer's first token arrives with its logprobs
    assert first.logprobs[0][first.token_ids[0]].rank >= 1 and len(first.logprobs) == len(first.token_ids)


def analytic_bytes(llm, num_tokens: int) -> int:
    """A prompt's KV from the model's dimensions alone: KV layers x tokens x distinct KV heads x widths x
    element bytes (+ an fp8 cache's float32 scale per token, head and pool), plus the linear state."""
    cfg, kv = llm.model_config, llm.runner.kv_layout
    heads = 1 if cfg.use_mla else cfg.num_key_value_heads
    per_head = sum(kv.pool_dims) * np.dtype(kv.dtype).itemsize + (4 * len(kv.pool_dims) if kv.quantized else 0)
    return cfg.num_kv_layers * num_tokens * heads * per_head + cfg.linear_state_bytes(1)


@pytest.mark.parametrize("model, producer, consumer", [
    ("deepseek-v3", dict(tensor_parallel_size=2), dict(tensor_parallel_size=8, decode_context_parallel_size=8)),
    # the hybrid: its linear layers' state rows move with the full-attention layers' KV (oldest jax only: its
    # pair through the router runs on the newest, test_disaggregated_serving.py)
    pytest.param("qwen3-next", dict(tensor_parallel_size=2),
                 dict(tensor_parallel_size=8, decode_context_parallel_size=2, cp_kv_cache_interleave_size=4),
                 marks=pytest.mark.oldest_jax),
    # sliding windows of 8 (`models.kv_groups`): each side frees the blocks behind them, by its own virtual
    # block (16 and 32 positions): the producer sends the null block where its windows moved on, the consumer
    # drops what lands behind its own
    # (newest jax only; the sparse model below on the oldest: half a minute each)
    pytest.param("gemma3-tiny", dict(tensor_parallel_size=2),
                 dict(tensor_parallel_size=4, decode_context_parallel_size=2, cp_kv_cache_interleave_size=4),
                 marks=pytest.mark.e2e),
    # sparse attention: the indexer keys travel beside the latent (`KVPools.index_k`) and select the same top-k
    pytest.param("deepseek-v32", dict(tensor_parallel_size=2),
                 dict(tensor_parallel_size=8, decode_context_parallel_size=4, cp_kv_cache_interleave_size=2),
                 marks=pytest.mark.oldest_jax),
])
def test_mla_and_hybrid_models(model, producer, consumer):
    p, d, alone = _engines(str(FIXTURES / model), producer, consumer)
    for compile_one, size in p.kv_connector.compile_jobs() + d.kv_connector.compile_jobs()[:1]:
        compile_one(size)  # what precompile does: MLA's one pool, the state rows (tests/test_precompile.py)
    prompts = _prompts(p.vocab_size)
    handles, outputs = disaggregated(p, d, prompts)
    _check_equal(outputs, alone.generate(prompts, SamplingParams(temperature=0, max_tokens=12)))
    assert (p.model_config.linear_state_bytes(1) > 0) == (model == "qwen3-next")
    n = len(prompts[-1]["prompt_token_ids"])
    assert handles[-1].kv_transfer_params["transfer_bytes"] == analytic_bytes(p, n)
    assert d.engine.kv_connector.stats.outcomes == {"received": len(prompts)}
    if model == "gemma3-tiny":
        assert p.engine.scheduler.num_dead_blocks_freed > 0 and d.engine.scheduler.num_dead_blocks_freed > 0


def test_a_first_token_that_ends_the_request_pulls_nothing():
    p, d, _ = _engines("tiny-llama", dict(tensor_parallel_size=2), dict(tensor_parallel_size=4))
    prompts = _prompts(p.vocab_size)[:2]
    handles, outputs = disaggregated(p, d, prompts, max_tokens=1)
    assert all(len(o.outputs[0].token_ids) == 1 and o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [h.outputs[0].token_ids for h in handles]
    assert d.engine.kv_connector.stats.outcomes == {"released": 2}
    _wait_for(lambda: p.engine.kv_connector.held_transfers == 0)  # the release reaches the producer
    p.engine.step()  # a step reads the sender's report
    assert p.engine.kv_connector.stats.outcomes == {"released": 2}  # the producer counts them too
    assert p.engine.kv_connector.scheduler.reserved_bytes == 0


def test_aborted_decode_requests_hold_nothing():
    """A decode request aborted while queued tells the producer to free the KV at once; one aborted
    while its KV is on the way frees its blocks once the load reports (the pull frees the KV)."""
    p, d, _ = _engines("tiny-llama", dict(tensor_parallel_size=2), dict(tensor_parallel_size=4))
    prompts = _prompts(p.vocab_size)[3:]  # 17, 40 and 70 tokens
    handoff = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    handles = [h.kv_transfer_params for h in p.generate(prompts, handoff)]
    seqs = [d.make_sequences(prompt, SamplingParams(temperature=0, max_tokens=6, extra_args={
        "kv_transfer_params": h}), 0, request_id=f"r{i}")[0] for i, (prompt, h) in enumerate(zip(prompts, handles))]
    for seq in seqs:
        d.engine.add(seq)
    d.engine.abort("r0")  # still queued: nothing was pulled
    d.engine.step()  # r1 and r2 admitted: their loads start
    d.engine.abort("r1")  # its load under way: its blocks stay until it reports
    while d.engine.has_work():
        d.engine.step()
    assert seqs[2].finished and seqs[2].finish_reason == "length" and d.engine.kv_usage == 0
    _wait_for(lambda: p.engine.kv_connector.held_transfers == 0)  # r0 released; r1 pulled or released
    p.engine.step()
    assert p.engine.kv_connector.scheduler.reserved_bytes == 0
    assert d.engine.kv_connector.stats.outcomes == {"released": 1, "received": 2}


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the layout: where a position lives, from the plain formula ------------------------------------
LAYOUTS = [(1, 1), (2, 1), (4, 2), (8, 16), (3, 4), (2, 8)]  # (DCP, interleave)


def _kv_layout(dcp: int, interleave: int, repeats: int = 1, dtype: str = "float32") -> KVLayout:
    return KVLayout(architecture="LlamaForCausalLM", layers=("kv", "kv"), kv_heads=2, pool_dims=(3, 3),
                    kv_dtype=dtype, tp=8, dcp=dcp, interleave=interleave, block_size=16, head_repeats=repeats)


@pytest.mark.parametrize("dcp, interleave", LAYOUTS)
def test_owner_and_local_follow_the_formula(dcp, interleave):
    lay = _kv_layout(dcp, interleave)
    n = 101
    seen = set()
    for p in range(n):
        owner, local = (p // interleave) % dcp, (p // (interleave * dcp)) * interleave + p % interleave
        assert lay.owner(p) == owner and lay.local(p) == local
        assert lay.positions(owner, n)[local] == p  # the inverse: local order back to the position
        seen.add((owner, local))
    assert len(seen) == n and sum(lay.rank_lengths(n)) == n
    for r in range(dcp):  # each rank's local order is dense: 0 .. n_r - 1, positions increasing
        assert sorted(local for owner, local in seen if owner == r) == list(range(lay.rank_lengths(n)[r]))


@pytest.mark.parametrize("sender", LAYOUTS)
@pytest.mark.parametrize("receiver", [(1, 1), (4, 2), (3, 4), (8, 1)])
def test_each_receiver_rank_gets_its_own_positions_in_its_local_order(sender, receiver):
    """The producer's per-rank arrays (value = position, from the formula) re-sharded for the consumer:
    rank d's token j must be the position the formula stores there, on every stored head slot."""
    n = 77
    src, dst = _kv_layout(*sender), _kv_layout(*receiver, repeats=2)
    arrays = {}
    for r in range(src.dcp):
        mine = [p for p in range(n) if (p // src.interleave) % src.dcp == r]  # in local order: increasing
        value = np.broadcast_to(np.asarray(mine, np.float32)[None, None, :, None], (2, 2, len(mine), 3))
        arrays[f"k.{r}"], arrays[f"v.{r}"] = value.copy(), -value
    updates, _, lengths = resharding.for_receiver(arrays, src, dst, n)
    assert updates["k"].shape[:3] == (dst.dcp, 2, 4) and lengths == dst.rank_lengths(n)
    for d in range(dst.dcp):
        want = [p for p in range(n) if (p // dst.interleave) % dst.dcp == d]
        assert lengths[d] == len(want)
        for slot in range(4):
            np.testing.assert_array_equal(updates["k"][d, 1, slot, : len(want), 0], want)
            np.testing.assert_array_equal(updates["v"][d, 0, slot, : len(want), 2], -np.asarray(want))


def test_a_handle_layout_round_trips_and_names_what_differs():
    lay = _kv_layout(4, 2, dtype="float8_e4m3fn")
    assert KVLayout.from_dict(json.loads(json.dumps(lay.as_dict()))) == lay
    assert lay.pool_fields == ("k", "v", "k_scale", "v_scale")
    other = dataclasses.replace(lay, pool_dims=(3, 4), tp=2, dcp=1)
    assert other.compatibility_problems(lay) == ["pool_dims: the prefill server's (3, 3), this server's (3, 4)"]
    with pytest.raises(ValueError, match=r"kv_layout lacks \['block_size'\]"):
        KVLayout.from_dict({k: v for k, v in lay.as_dict().items() if k != "block_size"})


# -- the consumer's pages: what its own prefill writes --------------------------------------------
@pytest.mark.parametrize("sent, kept", [("auto", "auto"), pytest.param("fp8", "fp8", marks=pytest.mark.oldest_jax),
                                        pytest.param("auto", "fp8", marks=pytest.mark.e2e)])  # fp8: one Python each
def test_loaded_pages_equal_the_consumers_own_prefill(sent, kept):
    """A prompt loaded from a TP 8 producer into a TP 8 / DCP 4 (interleave 2) consumer: page for page,
    the consumer's pools hold what its own prefill of that prompt writes (the first layer exactly: its
    K and V depend on the embeddings alone; deeper layers to float32 rounding, the attention above them
    being merged over other ranks), and no other block is touched. Float KV into an fp8 cache is
    quantized on the consumer's devices by the cache's own `quantize_fp8` (the first layer's pages equal
    the consumer's own; deeper ones hold what the producer's float attention computed)."""
    kv_cache_dtype = None if kept == "auto" else kept
    p, d, alone = _engines("tiny-llama", dict(tensor_parallel_size=8, kv_cache_dtype=sent),
                           dict(tensor_parallel_size=8, decode_context_parallel_size=4,
                                cp_kv_cache_interleave_size=2, block_size=8, kv_cache_dtype=kept))
    prompt = _prompts(p.vocab_size)[-1]  # 70 tokens: several blocks on every rank
    handles = p.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                  extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    d.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                        extra_args={"kv_transfer_params": handles[0].kv_transfer_params}))
    alone.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # the same blocks: a fresh pool
    for layer, (got, want) in enumerate(zip(d.runner.kv_caches, alone.runner.kv_caches)):
        for field in ("k", "v", "k_scale", "v_scale"):
            a, b = getattr(got, field), getattr(want, field)
            if b is None:
                continue
            a, b = np.asarray(a.astype(np.float32)), np.asarray(b.astype(np.float32))
            assert np.any(b != 0) and np.array_equal(a == 0, b == 0), (layer, field)  # the same pages written
            if layer == 0:
                np.testing.assert_array_equal(a, b, err_msg=field)
            elif sent != kept:  # deeper layers: the producer attended over float KV, the consumer over fp8
                continue
            elif field in ("k", "v") and kv_cache_dtype:  # fp8: the values as the kernels read them, scaled
                a = a * np.asarray(getattr(got, f"{field}_scale"))[..., None]
                b = b * np.asarray(getattr(want, f"{field}_scale"))[..., None]
                np.testing.assert_allclose(a, b, rtol=0, atol=0.07 * np.abs(b).max(), err_msg=field)
            elif field in ("k", "v"):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=field)


# -- bounded memory on both sides -------------------------------------------------------------------
@pytest.mark.oldest_jax  # half a minute: oldest jax only (the bound is the scheduler's, not jax's)
def test_sixteen_prompts_against_a_buffer_of_three_stay_within_it():
    """16 prompts at once to a producer whose kv_buffer_size holds 3 of them, their decodes on a
    consumer whose pool is nearly full: at no step does the producer hold (or reserve) more than the
    bound, every request is answered as one engine would, and nothing is held afterwards."""
    common = dict(max_model_len=160, max_num_batched_tokens=64, max_num_seqs=16)
    n, bound_prompts = 40, 3
    p = dcpjax.LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20, **common,
                   kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})
    per_prompt = p.engine.kv_connector.scheduler.layout.kv_bytes(n)
    p.engine.kv_connector.scheduler.max_bytes = bound = bound_prompts * per_prompt
    # a consumer pool of 3 sequences' blocks: the others wait for blocks, not in host memory
    d = dcpjax.LLM("tiny-llama", tensor_parallel_size=4, decode_context_parallel_size=2,
                   kv_cache_memory_bytes=_bytes_for_blocks(p.model_config, 3 * 2 + 1), block_size=16, **common,
                   kv_transfer_config={"kv_role": "kv_consumer"})
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, n).tolist() for _ in range(16)]
    handoff = SamplingParams(temperature=0, max_tokens=1,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    pending = [p.make_sequences({"prompt_token_ids": ids}, handoff, i, request_id=f"p{i}")[0]
               for i, ids in enumerate(prompts)]
    for seq in pending:
        p.engine.add(seq)
    decoding, peak = [], 0
    while p.engine.has_work() or d.engine.has_work():
        if p.engine.has_work():
            for seq in p.engine.step().finished:
                params = SamplingParams(temperature=0, max_tokens=30,  # 40 + 30 tokens grow past 2 blocks
                                        extra_args={"kv_transfer_params": seq.kv_transfer_params})
                decoding.append(d.make_sequences({"prompt_token_ids": seq.prompt_ids}, params, 0,
                                                 request_id=f"d{seq.request_id}")[0])
                d.engine.add(decoding[-1])
        if d.engine.has_work():
            d.engine.step()
        held = p.engine.kv_connector.sender.held_bytes
        peak = max(peak, held, p.engine.kv_connector.scheduler.reserved_bytes)
        assert held <= bound and p.engine.kv_connector.scheduler.reserved_bytes <= bound
    assert len(decoding) == 16 and all(s.finished for s in decoding)
    assert peak == bound  # the buffer was the limit: three prompts at once
    alone = dcpjax.LLM("tiny-llama", tensor_parallel_size=4, decode_context_parallel_size=2, **common)
    want = alone.generate([{"prompt_token_ids": ids} for ids in prompts],
                          SamplingParams(temperature=0, max_tokens=30))
    assert [s.output_ids for s in decoding] == [w.outputs[0].token_ids for w in want]
    outcomes = d.engine.kv_connector.stats.outcomes  # a first token that is EOS pulls nothing: released
    assert set(outcomes) <= {"received", "released"} and sum(outcomes.values()) == 16 and outcomes["received"] > 8
    # preempted after their load, sequences computed their prompts here: no second pull of an acknowledged key
    # (it would be refused and counted "failed")
    assert d.engine.num_preemptions > 0
    _wait_for(lambda: p.engine.kv_connector.held_transfers == 0)
    p.engine.step()
    assert p.engine.kv_connector.scheduler.reserved_bytes == 0 and p.engine.kv_usage == 0 and d.engine.kv_usage == 0


def _bytes_for_blocks(cfg, blocks: int) -> int:
    """kv_cache_memory_bytes holding `blocks` blocks of `cfg` at TP 4 / DCP 2 (block size 16, float32)."""
    pc = ParallelConfig(4, 2)
    per_block = kv_block_layout(cfg, pc, block_size=16, dtype=np.float32).bytes_per_block_per_device(
        cfg.num_kv_layers, pc.kv_head_groups)
    return blocks * per_block + per_block // 2


# -- what a configuration or a request gets wrong: one line naming the fix -----------------------------
@pytest.mark.parametrize("value, message", [
    ('{"kv_role": "prefill"}', "kv_role must be one of ['kv_producer', 'kv_consumer', 'kv_both'], got 'prefill'"),
    ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "(NixlConnector is vLLM's) — leave it out"),
    ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port must be a port in [0, 65535], got 70000"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"timeout": 3}}', "unknown keys ['timeout']; known:"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"retries": -1}}', "retries must be a number >= 0"),
    ('{"kv_rol": "kv_producer"}', "unknown fields ['kv_rol']; known:"),
])
def test_a_bad_kv_transfer_config_names_the_field(value, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        KVTransferConfig.from_value(value)
    # the server's flag: the same message, one line, exit 2, before anything is loaded
    with pytest.raises(SystemExit) as exit_:
        serve.main(["tiny-llama", "--port", "0", "--kv-transfer-config", value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_kv_transfer_config_that_is_no_json_object(capsys):
    for value, message in (('{"kv_role": kv_producer}', "is not JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=message):
            dcpjax.LLM("tiny-llama", kv_transfer_config=value)
        with pytest.raises(SystemExit):
            serve.main(["tiny-llama", "--port", "0", "--kv-transfer-config", value])
        assert f"--kv-transfer-config: expected a JSON object, got {value!r}" in capsys.readouterr().err


def test_kv_transfer_on_several_processes_is_refused(capsys):
    argv = ["tiny-llama", "--port", "0", "--num-processes", "2", "--coordinator-address", "127.0.0.1:1",
            "--kv-transfer-config", '{"kv_role": "kv_producer"}']
    with pytest.raises(SystemExit) as exit_:
        serve.main(argv)
    assert exit_.value.code == 2 and "drop --num-processes" in capsys.readouterr().err


def test_a_wildcard_kv_ip_advertises_this_host():
    assert KVTransferConfig("kv_producer", kv_ip="0.0.0.0").advertised_host == socket.gethostname()
    assert KVTransferConfig("kv_producer", kv_ip="10.0.0.7").advertised_host == "10.0.0.7"


def test_requests_a_role_cannot_serve_are_refused_offline():
    """Checked with the request (engine.requests), before any work: the server answers these 400."""
    p = dcpjax.LLM("tiny-llama", kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0}, max_model_len=64)
    d = dcpjax.LLM("tiny-llama", kv_transfer_config='{"kv_role": "kv_consumer"}', max_model_len=64)
    plain = dcpjax.LLM("tiny-llama", max_model_len=64)
    handoff = {"kv_transfer_params": {"do_remote_decode": True}}
    cases = [(plain, 1, handoff, "needs an engine with a kv_transfer_config"),
             (d, 1, handoff, "do_remote_decode needs a prefill server (kv_role kv_producer); this one is kv_consumer"),
             (p, 5, handoff, "do_remote_decode needs max_tokens 1 and n 1"),
             (p, 5, {"kv_transfer_params": _handle(p)}, "do_remote_prefill needs a decode server"),
             (d, 5, {"kv_transfer_params": {**_handle(d), "kv_connector": "JaxTransferConnector"}},
              "kv_connector is 'JaxTransferConnector', this decode server's is 'SocketConnector'"),
             (d, 5, {"kv_transfer_params": {**_handle(d), "num_tokens": 4}}, ("the prefill server's KV is of another "
                                                                              "prompt (4 tokens, this request has 6)")),
             (d, 5, {"kv_transfer_params": {**_handle(d), "kv_layout": {**_handle(d)["kv_layout"], "kv_heads": 3}}},
              "runs another model: kv_heads: the prefill server's 3, this server's 2"),
             (d, 5, {"kv_transfer_params": {**_handle(d), "first_token": {"id": "7"}}},
              "kv_transfer_params.first_token.id: Input should be a valid integer"),
             (d, 5, {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"}},
              ("kv_transfer_params lacks ['kv_connector', 'remote_port', 'remote_address', 'remote_request_id', "
               "'num_tokens', 'kv_layout', 'prompt_sha256', 'first_token']"))]
    for llm, max_tokens, extra, message in cases:
        with pytest.raises(RequestError, match=re.escape(message)) as err:
            llm.generate("hello", SamplingParams(max_tokens=max_tokens, extra_args=extra))
        assert err.value.param == "kv_transfer_params"
    assert p.engine.kv_usage == 0 and p.engine.kv_connector.held_transfers == 0


def _handle(llm) -> dict:
    """A well-formed handle for the prompt "hello" (6 byte tokens here), as a producer of llm's model returns."""
    ids = llm.make_sequences("hello", SamplingParams())[0].prompt_ids
    return {"do_remote_prefill": True, "kv_connector": "SocketConnector", "remote_host": "127.0.0.1",
            "remote_port": 1, "remote_address": {"host": "127.0.0.1", "port": 1}, "remote_request_id": "k",
            "num_tokens": len(ids), "kv_layout": llm.engine.kv_connector.scheduler.layout.as_dict(),
            "prompt_sha256": prompt_digest(ids), "first_token": {"id": 7}}
