"""The DCP planner (`python -m dcpjax.plan --model`): its verdicts are ParallelConfig's, its KV
bytes are what the runner allocates, its collective bytes are what a compiled step moves."""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpjax
from dcpjax.entrypoints import cli
from dcpjax.kernels import KVPools, LinearState
from dcpjax.models.config import TINY_MODELS, ModelConfig
from dcpjax.plan import command as plan
from dcpjax.plan import planner
from dcpjax.plan.deployment import Deployment, memory_plan
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.traffic import hlo_collective_bytes

LLAMA = TINY_MODELS["tiny-llama"]
WORKLOAD = planner.Workload(input_len=256, output_len=32, concurrency=4)


def _row(cfg, pc, memory_gb=0.01, weight_bytes=0.0, workload=WORKLOAD):
    device = dataclasses.replace(planner.DEVICES["cpu"], memory_gb=memory_gb)
    return planner.plan_size(cfg, pc, device=device, link=planner.LINKS["nvlink"], workload=workload,
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


@pytest.mark.parametrize("dcp", [1, 4])
def test_a_hybrids_kv_and_state_are_what_the_runner_allocates(dcp):
    """Qwen3-Next: KV for its one full-attention layer only, and a fixed state per slot (WORKLOAD's
    concurrency as max_num_seqs) taken from the same budget before the blocks."""
    folder = pathlib.Path(__file__).parent / "fixtures" / "qwen3-next"
    cfg, pc, budget = ModelConfig.from_pretrained(folder), ParallelConfig(8, dcp), 3 << 20
    row = _row(cfg, pc, memory_gb=budget / 1e9)
    llm = dcpjax.LLM(str(folder), tensor_parallel_size=8, decode_context_parallel_size=dcp,
                     kv_cache_memory_bytes=budget, max_model_len=256, max_num_seqs=WORKLOAD.concurrency)
    assert row["kv_cache_size_tokens"] == llm.kv_cache_size_tokens
    caches = llm.runner.kv_caches
    kv = sum(c.bytes_per_device() for c in caches if isinstance(c, KVPools))
    state = sum(c.bytes_per_device() for c in caches if isinstance(c, LinearState))
    assert row["kv_bytes_per_token_per_device"] * llm.kv_cache_size_tokens == pytest.approx(kv)
    assert row["state_bytes_per_sequence_per_device"] * WORKLOAD.concurrency == state > 0
    assert row["state_bytes_per_step"] == 2 * row["batch"] * row["state_bytes_per_sequence_per_device"]
    # memory that holds the states but not one KV block more: the verdict names the state too
    crowded = _row(cfg, pc, memory_gb=state * 1.001 / 1e9)
    assert crowded["rejected_by"] == "weights" and "4 sequences' linear-attention state" in crowded["rules_broken"][0]
    # a deployment file's max_num_seqs slots of state: the same words, and the fix names max_num_seqs
    deployment = Deployment("hybrid", cfg, pc, device_memory_bytes=state * 4, memory_utilization=1.0,
                                 weight_dtype="float32", max_num_seqs=1000)
    with pytest.raises(ValueError, match="1000 sequences' linear-attention state .* or lower max_num_seqs"):
        memory_plan(deployment)


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
    assert plan.main(["--model", "tiny-llama", "-tp", "8", "--device", "h200", "--input-len", "32256",
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
    for argv in (["--model", "tiny-llama", "--concurrency", "0"], []):
        with pytest.raises(SystemExit):
            plan.main(argv)
    capsys.readouterr()
    assert cli.run(plan.main, ["--model", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --model: model 'nope' is neither")


def _plan(capsys, *argv) -> dict:
    assert plan.main(["--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _fits(capsys, *argv) -> bool:
    return _plan(capsys, *argv)["recommended_dcp"] is not None


TINY = ("--model", "tiny-llama", "--device", "cpu")


@pytest.mark.parametrize("tp", ["4", "8"])
@pytest.mark.parametrize("memory_kb, input_len", [(10, 64), (40, 64), (50, 64), (80, 64), (150, 4096), (1000, 64)])
def test_the_recommendation_is_never_a_rejected_size(tp, memory_kb, input_len, capsys):
    result = _plan(capsys, *TINY, "-tp", tp, "--memory-gb", str(memory_kb * 1e3 / 1e9), "--input-len", str(input_len))
    valid = [r["dcp"] for r in result["sizes"] if r["valid"]]
    assert (result["recommended_dcp"] in valid) if valid else result["recommended_dcp"] is None
    assert (result["recommended_comm_backend"] is None) == (result["recommended_dcp"] is None)
    assert not (valid and result["what_would_fit"])  # alternatives only when nothing fits
    # every other size has its own line: a rejected one its own first reason
    others = {r["dcp"]: r["reason"] for r in result["not_recommended"]}
    assert sorted(others) == [r["dcp"] for r in result["sizes"] if r["dcp"] != result["recommended_dcp"]]
    assert all(r["rules_broken"][0] in others[r["dcp"]] for r in result["sizes"] if not r["valid"]), others
    if not valid:  # and the reason that nothing fits names each
        assert all(r["rules_broken"][0] in result["reasons"][0] for r in result["sizes"]), result["reasons"]


# SmolLM2-135M's heads (9 query, 3 KV) on tiny-llama: at TP 9, DCP 9 breaks a layout rule
SMOL = dataclasses.replace(LLAMA, num_attention_heads=9, num_key_value_heads=3)
DCP9_RULE = "'decode_context_parallel_size <= tensor_parallel_size // num_kv_heads' failed: 9 > 9 // 3 = 3"


def test_each_rejected_size_is_named_with_its_own_reason():
    """The issue's cases: DCP 1 holds a third of DCP 3's tokens, DCP 9 breaks a rule; the summary gave
    every rejected size the first one's reason and numbers ("DCP 1, 9: ... 19,136 tokens")."""
    def rows(workload):
        return [_row(SMOL, ParallelConfig(9, d), memory_gb=1e-4, workload=workload) for d in (1, 3, 9)]

    def short(per_seq, tokens):
        return (f"one sequence of {per_seq:,} tokens (input + output) needs more than the {tokens:,} tokens the KV "
                "cache holds")

    t1, t3 = (r["kv_cache_size_tokens"] for r in rows(planner.Workload(16, 16, 1))[:2])
    assert 0 < t1 < t3
    between = planner.Workload(t1, 16, 4)  # more than DCP 1 holds, less than DCP 3
    assert planner.recommend(SMOL, rows(between), planner.LINKS["nvlink"], between) == (3, [
        "model: only DCP 3 of DCP 1, 3, 9 fits"])
    others = planner.not_recommended(rows(between), 3)  # each other size: its own first reason
    assert [(o["dcp"], o["step_ms"], o["reason"].split("; ")[0]) for o in others] == [
        (1, None, f"rejected: {short(t1 + 16, t1)}"), (9, None, f"rejected: {DCP9_RULE}")]
    beyond = planner.Workload(t3, 16, 4)  # more than either holds
    assert planner.recommend(SMOL, rows(beyond), planner.LINKS["nvlink"], beyond) == (None, [
        (f"nothing fits at TP 9: DCP 1: {short(t3 + 16, t1)}; DCP 3: {short(t3 + 16, t3)}; "
         f"DCP 9 breaks the model's rules ({DCP9_RULE})")])


def test_a_size_a_rule_rejects_has_its_own_line(capsys):
    """Qwen3-Next's deployment: DCP 8 breaks a rule; it was in the table only, now it has its line."""
    result = _plan(capsys, "--model", "configs/qwen3-next-80b-a3b-tp8-dcp4.json")
    assert result["recommended_dcp"] == 4
    eight = next(o for o in result["not_recommended"] if o["dcp"] == 8)
    assert eight == {"dcp": 8, "step_ms": None, "tokens_per_second": None, "reason": (
        "rejected: 'decode_context_parallel_size <= tensor_parallel_size // num_kv_heads' failed: 8 > 8 // 2 = 4")}
    assert f"\n- DCP 8: {eight['reason']}" in planner.plan_table(result)


def _rows(tp, dcps, kind):
    return [{"tp": tp, "dcp": d, "valid": kind is None, "rejected_by": kind, "rules_broken": [] if kind is None
             else [f"{kind} at TP {tp}"]} for d in dcps]


def test_what_would_fit_plans_few_tps():
    """tiny-llama's heads allow TP 1, 2, 4, 8; here 4 and 8 (and fp8 weights) fit, TP 2 runs out of memory.
    At TP 3 (the rules): the smaller TPs down to the first out of memory (TP 1, smaller still, is not
    planned), then the smallest larger one that fits. At TP 2 (memory): a smaller TP cannot help."""
    planned = []

    def rows_at(tp, weight_dtype):
        planned.append((tp, weight_dtype))
        return _rows(tp, [1], None if tp >= 4 or weight_dtype == planner.FP8 else "weights")

    found = planner.what_would_fit(LLAMA, _rows(3, [1, 3], "rules"), weight_dtype="bfloat16", workload=WORKLOAD,
                                   rows_at=rows_at)
    assert planned == [(2, "bfloat16"), (4, "bfloat16")] and [a["value"] for a in found] == [4]
    planned.clear()
    found = planner.what_would_fit(LLAMA, _rows(2, [1, 2], "weights"), weight_dtype="bfloat16", workload=WORKLOAD,
                                   rows_at=rows_at)
    assert planned == [(4, "bfloat16"), (2, planner.FP8)]
    assert [(a["change"], a["value"]) for a in found] == [("tensor_parallel_size", 4), ("weight_dtype", planner.FP8)]


def test_nothing_fits_says_what_would_and_each_change_is_planned(capsys):
    """Weights of tiny-llama at TP 4 leave no room in 70 kB; at TP 8, or in fp8, they do."""
    args = (*TINY, "-tp", "4", "--memory-gb", "7e-5", "--input-len", "64", "--output-len", "16")
    result = _plan(capsys, *args)
    assert result["recommended_dcp"] is None and [r["rejected_by"] for r in result["sizes"]] == [
        "weights", "weights", "rules"]
    changes = {alt["change"]: alt for alt in result["what_would_fit"]}
    assert changes["tensor_parallel_size"]["value"] == 8 and changes["weight_dtype"]["value"] == "float8_e4m3fn"
    assert "context" not in changes  # no size has room for one block: no length helps
    for alt in result["what_would_fit"]:
        flag = {"tensor_parallel_size": "-tp", "weight_dtype": "--weight-dtype"}[alt["change"]]
        again = _plan(capsys, *args, flag, str(alt["value"]))
        assert [r["dcp"] for r in again["sizes"] if r["valid"]] == alt["dcp"] and again["recommended_dcp"] in alt["dcp"]
    assert plan.main([*args]) == 0
    out = capsys.readouterr().out
    assert "Recommended: nothing fits" in out and "- devices: TP 8 (8 devices) fits, at DCP 1, 2, 4" in out
    assert "Recommended: DCP" not in out


def test_a_shorter_context_is_the_longest_that_fits(capsys):
    args = (*TINY, "--memory-gb", "1e-4", "--output-len", "16", "--concurrency", "4")
    result = _plan(capsys, *args, "--input-len", "32000")  # within tiny-llama's 32768 positions
    assert result["recommended_dcp"] is None
    [alt] = [alt for alt in result["what_would_fit"] if alt["change"] == "context"]
    longest = alt["value"]
    assert longest == max(r["kv_cache_size_tokens"] for r in result["sizes"] if "kv_cache_size_tokens" in r)
    assert _fits(capsys, *args, "--input-len", str(longest - 16), "--concurrency", "1")
    assert not _fits(capsys, *args, "--input-len", str(longest - 16 + 1), "--concurrency", "1")
    assert f"all 4 at once at up to {longest // 4:,} tokens each" in alt["text"]
    at_four = _plan(capsys, *args, "--input-len", str(longest // 4 - 16))
    assert max(r.get("batch", 0) for r in at_four["sizes"]) == 4


def test_a_tp_that_breaks_the_rules_gets_every_tp_that_fits(capsys):
    """Every smaller TP the heads allow (1, 2), not only the nearest, and the smallest larger one."""
    result = _plan(capsys, *TINY, "-tp", "3")
    assert result["recommended_dcp"] is None and {r["rejected_by"] for r in result["sizes"]} == {"rules"}
    assert [(a["change"], a["value"]) for a in result["what_would_fit"]] == [("tensor_parallel_size", 1),
                                                                              ("tensor_parallel_size", 2),
                                                                              ("tensor_parallel_size", 4)]
    assert result["reasons"] == [("nothing fits at TP 3: DCP 1, 3 break the model's rules "
                                  "('num_attention_heads % tensor_parallel_size == 0' failed: 8 % 3 = 2)")]


def test_qwen3_235b_at_tp_6_fits_nowhere_and_tp_4_or_8_would(capsys):
    """The issue's case: 64 query heads do not split over 6 devices."""
    result = _plan(capsys, "--model", "configs/qwen3-235b-a22b-tp8-dcp2.json", "-tp", "6")
    assert result["recommended_dcp"] is None and result["recommended_comm_backend"] is None
    assert [(a["value"], a["dcp"]) for a in result["what_would_fit"]] == [(4, [1]), (8, [1, 2])]


@pytest.mark.parametrize("link", ["nvlink", "ici", "dcn"])
def test_the_recommendation_is_the_tables_fastest(link, capsys):
    """On ici DCP 4 is fastest with a2a but slower than DCP 1 with ag_rs: the best backend counts."""
    result = _plan(capsys, "--model", "tiny-llama", "--interconnect", link, "--input-len", "32256",
                   "--concurrency", "64")
    valid = [r for r in result["sizes"] if r["valid"]]
    best = max(max(r["tokens_per_second"].values()) for r in valid)
    chosen = next(r for r in valid if r["dcp"] == result["recommended_dcp"])
    comm = result["recommended_comm_backend"]
    assert chosen["tokens_per_second"][comm] == best
