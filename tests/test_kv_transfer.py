"""Prefill/decode disaggregation in one process: a producer LLM at one layout prefills, a consumer
LLM at another pulls the KV over a real socket, re-shards it and decodes. Greedy tokens equal one
engine at the consumer's layout (the oracle: transformers-proven elsewhere), for prompts that cross
block and interleave boundaries; the bytes moved equal the prompt's analytic KV size.

(Across real processes through the router: tests/test_disaggregated_serving.py.)"""

import pathlib
import re
import socket

import numpy as np
import pytest

import dcpjax
from dcpjax import SamplingParams
from dcpjax.engine.requests import RequestError
from dcpjax.kv_transfer import resharding
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.runner.kv_io import rank_lengths
from dcpjax.serve import __main__ as serve
from dcpjax.sharding import layout

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PROMPT_LENGTHS = (1, 15, 16, 17, 40, 70)  # one token, around a block of 16, several blocks and interleave runs


def _prompts(vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(3, min(vocab, 250), n).tolist()} for n in PROMPT_LENGTHS]


def _engines(model, producer: dict, consumer: dict, **common):
    common = dict(max_model_len=160, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=32, max_num_seqs=8,
                  **common)
    p = dcpjax.LLM(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0}, **common, **producer)
    d = dcpjax.LLM(model, kv_transfer_config={"kv_role": "kv_consumer"}, **common, **consumer)
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
    for got, want in zip(outputs, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, got.prompt_token_ids[:4]


@pytest.mark.parametrize("producer, consumer", [
    (dict(tensor_parallel_size=2), dict(tensor_parallel_size=8, decode_context_parallel_size=4,
                                        cp_kv_cache_interleave_size=2, block_size=8)),
    (dict(tensor_parallel_size=8, decode_context_parallel_size=4, cp_kv_cache_interleave_size=4),
     dict(tensor_parallel_size=8)),  # DCP 4 to DCP 1, each KV head stored 4 times on the consumer
    # fp8 KV moves as stored (values and per-token scales): the consumer holds what its own prefill would have
    (dict(tensor_parallel_size=4, decode_context_parallel_size=2, kv_cache_dtype="fp8"),
     dict(tensor_parallel_size=8, decode_context_parallel_size=4, block_size=32, kv_cache_dtype="fp8")),
])
def test_tokens_equal_one_engine_at_the_consumers_layout(producer, consumer):
    p, d, alone = _engines("tiny-llama", producer, consumer)
    prompts = _prompts(p.vocab_size)
    handles, outputs = disaggregated(p, d, prompts, logprobs=2)
    _check_equal(outputs, alone.generate(prompts, SamplingParams(temperature=0, max_tokens=12)))
    for h, prompt in zip(handles, prompts):  # bytes moved: the prompt's KV, analytic
        n = len(prompt["prompt_token_ids"])
        assert h.kv_transfer_params["transfer_bytes"] == resharding.kv_bytes(resharding.describe(p.runner), n)
    stats = d.engine.kv_connector.stats
    assert stats.outcomes == {"received": len(prompts)}
    assert p.engine.kv_connector.stats.outcomes == {"sent": len(prompts)}
    assert stats.bytes == sum(h.kv_transfer_params["transfer_bytes"] for h in handles)
    assert len(p.engine.kv_connector.store) == 0  # acknowledged, freed
    assert p.engine.kv_usage == 0 and d.engine.kv_usage == 0  # every block back in both pools
    first = outputs[1].outputs[0]  # the producer's first token arrives with its logprobs
    assert first.logprobs[0][first.token_ids[0]].rank >= 1 and len(first.logprobs) == len(first.token_ids)


@pytest.mark.parametrize("model, producer, consumer", [
    ("deepseek-v3", dict(tensor_parallel_size=2), dict(tensor_parallel_size=8, decode_context_parallel_size=8)),
    # the hybrid: its linear layers' state rows move with the full-attention layers' KV
    ("qwen3-next", dict(tensor_parallel_size=2), dict(tensor_parallel_size=8, decode_context_parallel_size=2,
                                                      cp_kv_cache_interleave_size=4)),
])
def test_mla_and_hybrid_models(model, producer, consumer):
    p, d, alone = _engines(str(FIXTURES / model), producer, consumer)
    for compile_one, size in p.kv_connector.compile_jobs() + d.kv_connector.compile_jobs()[:1]:
        compile_one(size)  # what precompile does: MLA's one pool, the state rows (tests/test_precompile.py)
    prompts = _prompts(p.vocab_size)
    handles, outputs = disaggregated(p, d, prompts)
    _check_equal(outputs, alone.generate(prompts, SamplingParams(temperature=0, max_tokens=12)))
    state = p.engine.kv_connector.state_bytes
    assert (state > 0) == (model == "qwen3-next")
    n = len(prompts[-1]["prompt_token_ids"])
    assert handles[-1].kv_transfer_params["transfer_bytes"] == resharding.kv_bytes(
        resharding.describe(p.runner), n, state)


def test_a_first_token_that_ends_the_request_pulls_nothing():
    p, d, _ = _engines("tiny-llama", dict(tensor_parallel_size=2), dict(tensor_parallel_size=4))
    prompts = _prompts(p.vocab_size)[:2]
    handles, outputs = disaggregated(p, d, prompts, max_tokens=1)
    assert all(len(o.outputs[0].token_ids) == 1 and o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [h.outputs[0].token_ids for h in handles]
    assert d.engine.kv_connector.stats.outcomes == {"released": 2} and len(p.engine.kv_connector.store) == 0
    assert p.engine.kv_connector.stats.outcomes == {"released": 2}  # the producer counts them too


def test_position_order_inverts_any_layout():
    """Per-rank local order (the wire) back to positions, for layouts with uneven ranks."""
    rng = np.random.default_rng(1)
    for dcp, interleave, n in ((1, 1, 5), (4, 2, 37), (8, 16, 100), (3, 4, 7)):
        sender = {"dcp": dcp, "interleave": interleave, "layers": ["kv"], "kv_dtype": "float32"}
        whole = rng.standard_normal((2, n, 3)).astype(np.float32)
        arrays = {}
        for r, length in enumerate(rank_lengths(n, dcp, interleave)):
            where = layout.global_position(np.arange(length), r, dcp, interleave)
            assert np.all(layout.owner_rank(where, dcp, interleave) == r)
            arrays[f"0.k.{r}"] = whole[:, where]
        assert sum(rank_lengths(n, dcp, interleave)) == n
        back = resharding.position_order(arrays, sender, n, np.float32)
        np.testing.assert_array_equal(back["0.k"], whole)


def test_fp8_converts_both_ways():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, 16)).astype(np.float32)
    quantized = resharding.convert({"k": x}, resharding.FP8)
    assert quantized["k"].dtype == resharding.FP8 and quantized["k_scale"].shape == (2, 9)
    back = resharding.convert(quantized, np.dtype(np.float32))["k"]
    np.testing.assert_allclose(back, x, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


# -- what a configuration or a request gets wrong: one line naming the fix -----------------------------
@pytest.mark.parametrize("value, message", [
    ('{"kv_role": "prefill"}', "kv_role must be one of ['kv_producer', 'kv_consumer', 'kv_both'], got 'prefill'"),
    ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "(NixlConnector is vLLM's); leave it out"),
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
             (p, 5, {"kv_transfer_params": {"do_remote_prefill": True}}, "do_remote_prefill needs a decode server"),
             (d, 5, {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"}},
              "lacks ['remote_port', 'remote_request_id', 'num_tokens', 'first_token']")]
    for llm, max_tokens, extra, message in cases:
        with pytest.raises(RequestError, match=re.escape(message)) as err:
            llm.generate("hello", SamplingParams(max_tokens=max_tokens, extra_args=extra))
        assert err.value.param == "kv_transfer_params"
    assert p.engine.kv_usage == 0 and len(p.engine.kv_connector.store) == 0
