"""The DCP planner (`python -m dcpjax.plan --model`): its verdicts are ParallelConfig's, its KV
bytes are what the runner allocates, its collective bytes are what a compiled step moves."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpjax
from dcpjax import plan, planner
from dcpjax.config import ParallelConfig
from dcpjax.models.config import TINY_MODELS
from dcpjax.sharding.traffic import hlo_collective_bytes

LLAMA = TINY_MODELS["tiny-llama"]
WORKLOAD = planner.Workload(input_len=256, output_len=32, concurrency=4)


def _row(cfg, pc, memory_gb=0.01, weight_bytes=0.0):
    device = dataclasses.replace(planner.DEVICES["cpu"], memory_gb=memory_gb)
    return planner.plan_size(cfg, pc, device=device, link=planner.LINKS["nvlink"], workload=WORKLOAD,
                             weight_bytes=weight_bytes, kv_dtype=jnp.float32, utilization=1.0, q_bytes=4)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8, 16]), dcp_index=st.integers(0, 4), kv_power=st.integers(0, 4),
       group_power=st.integers(0, 3), mla=st.booleans())
def test_verdicts_are_parallel_configs(tp, dcp_index, kv_power, group_power, mla):
    dcps = [d for d in range(1, tp + 1) if tp % d == 0]
    pc = ParallelConfig(tp, dcps[dcp_index % len(dcps)])
    kv_heads = 1 if mla else 2**kv_power
    cfg = TINY_MODELS["tiny-deepseek"] if mla else LLAMA
    cfg = dataclasses.replace(cfg, num_attention_heads=kv_heads * 2**group_power, num_key_value_heads=kv_heads)
    try:
        pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=mla)
        valid = True
    except ValueError:
        valid = False
    if valid and (cfg.num_attention_heads % tp or (not mla and tp % kv_heads and kv_heads % tp)):
        return  # a head count this TP cannot shard at all: not a DCP question
    assert _row(cfg, pc)["valid"] == valid


@pytest.mark.parametrize("model, tp, dcp", [("tiny-llama", 8, 2), ("tiny-llama", 4, 1), ("tiny-deepseek", 8, 8)])
def test_kv_capacity_is_what_the_runner_allocates(model, tp, dcp):
    budget = 3 << 20
    row = _row(TINY_MODELS[model], ParallelConfig(tp, dcp), memory_gb=budget / 1e9)
    llm = dcpjax.LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, kv_cache_memory_bytes=budget,
                     max_model_len=256)
    assert row["kv_cache_size_tokens"] == llm.kv_cache_size_tokens
    allocated = sum(cache.bytes_per_device() for cache in llm.runner.kv_caches)
    assert row["kv_bytes_per_token_per_device"] * llm.kv_cache_size_tokens == pytest.approx(allocated)


@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("model, dcp", [("tiny-llama", 2), ("tiny-llama", 4), ("tiny-deepseek", 8)])
def test_collective_bytes_are_the_compiled_steps(model, dcp, comm):
    """One layer's DCP attention, compiled: its HLO collectives move what the planner says."""
    cfg, batch = TINY_MODELS[model], 3
    pc = ParallelConfig(8, dcp, dcp_comm_backend=comm)
    dk, dv = (cfg.latent_dim, cfg.kv_lora_rank) if cfg.use_mla else (cfg.head_dim, cfg.head_dim)
    kv_heads = 1 if cfg.use_mla else cfg.num_key_value_heads
    rng = np.random.default_rng(0)
    k = rng.standard_normal((batch, 64, kv_heads, dk), np.float32)
    v = None if cfg.use_mla else rng.standard_normal((batch, 64, kv_heads, dv), np.float32)
    q = jnp.asarray(rng.standard_normal((batch, cfg.num_attention_heads, dk), np.float32))
    mesh = dcpjax.make_mesh(pc)
    cache = dcpjax.shard_kv_cache(k, v, mesh, pc, v_head_dim=dv if cfg.use_mla else None)
    step = jax.jit(functools.partial(dcpjax.dcp_decode_attention, mesh=mesh, pc=pc, attention_backend="reference"))
    hlo = step.lower(q, cache, jnp.full((batch,), 64, jnp.int32)).compile().as_text()
    moved = sum(b for _, b in hlo_collective_bytes(hlo, dcp))
    planned = planner.plan_size(dataclasses.replace(cfg, num_hidden_layers=1), pc, device=planner.DEVICES["h200"],
                                link=planner.LINKS["nvlink"], workload=planner.Workload(64, 1, batch),
                                weight_bytes=0.0, kv_dtype=jnp.float32, q_bytes=4)
    assert planned["batch"] == batch and moved > 0
    assert planned["collective_bytes_per_step"][comm] == pytest.approx(moved)


def test_plan_cli_recommends_and_explains(capsys):
    assert plan.main(["--model", "tiny-llama", "-tp", "8", "--device", "h200", "--input-len", "32768",
                      "--output-len", "512", "--concurrency", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sizes = {r["dcp"]: r for r in result["sizes"]}
    assert sorted(sizes) == [1, 2, 4, 8] and not sizes[8]["valid"] and sizes[8]["rules_broken"]
    assert sizes[4]["kv_cache_size_tokens"] == pytest.approx(4 * sizes[1]["kv_cache_size_tokens"], rel=1e-3)
    assert result["recommended_dcp"] in (2, 4) and len(result["reasons"]) == 3
    assert [r.split(":")[0] for r in result["reasons"]] == ["model", "workload", "interconnect"]
    # a slow link between hosts makes the collectives dominate
    plan.main(["--model", "tiny-llama", "-tp", "8", "--interconnect", "dcn", "--link-latency-us", "5000"])
    assert "Recommended: DCP 1" in capsys.readouterr().out


def test_mha_gets_dcp_1_and_bad_flags_get_errors(capsys):
    mha = dataclasses.replace(LLAMA, num_key_value_heads=LLAMA.num_attention_heads)
    rows = [_row(mha, ParallelConfig(8, d)) for d in (1, 2, 4, 8)]
    choice, reasons = planner.recommend(mha, rows, planner.LINKS["nvlink"], WORKLOAD)
    assert choice == 1 and reasons[0].startswith("model: MHA")
    for argv in (["--model", "tiny-llama", "--concurrency", "0"], ["--model", "nope"], []):
        with pytest.raises(SystemExit):
            plan.main(argv)
