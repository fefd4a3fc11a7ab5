"""The plan's prefill/decode section: the bytes a request moves (by hand, per attention kind), the
one-engine and P/D formulas, the verdict on a real deployment at both ends of the workload, and
the flags' errors. No model is compiled: the planner builds abstract shapes only."""

import itertools
import json

import jax.numpy as jnp
import pytest

from dcpjax.loader.model_source import load_model_config
from dcpjax.plan import command as plan
from dcpjax.plan import disaggregation
from dcpjax.plan.planner import Workload

DEEPSEEK = "configs/deepseek-v3-tp8-dcp8.json"


def _plan(capsys, *argv) -> dict:
    assert plan.main(["--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# per token: layers with KV x KV heads x (widths x element bytes, + 4 per width for fp8's scales)
@pytest.mark.parametrize("dtype, per_token", [
    (jnp.float32, 2 * 2 * (16 + 16) * 4), (jnp.bfloat16, 2 * 2 * (16 + 16) * 2),
    (jnp.float8_e4m3fn, 2 * 2 * ((16 + 16) * 1 + 2 * 4))])
def test_tiny_llama_moves_its_prompts_kv(dtype, per_token):
    """2 layers, 2 KV heads of 16, a K and a V pool: nothing else travels."""
    cfg = load_model_config("tiny-llama")
    assert disaggregation.bytes_per_request(cfg, dtype, 100) == 100 * per_token


def test_the_cli_moves_the_kv_cache_dtypes_bytes(capsys):
    result = _plan(capsys, "--model", "tiny-llama", "-tp", "4", "--input-len", "300", "--output-len", "20",
                   "--prefill-tp", "2", "--kv-cache-dtype", "float32", "--device", "cpu")
    one, pair = result["disaggregation"]["rows"]
    assert (one["bytes_per_request"], pair["bytes_per_request"]) == (0, 300 * 2 * 2 * 32 * 4)
    assert pair["transfer_seconds"] == pytest.approx(300 * 2 * 2 * 32 * 4 / 25e9)  # the default 25 GB/s link
    assert (pair["devices"], one["devices"]) == (2 + 4, 4)
    assert pair["kv_cache_size_tokens"] == one["kv_cache_size_tokens"] == next(
        r["kv_cache_size_tokens"] for r in result["sizes"] if r["dcp"] == result["recommended_dcp"])


def test_mla_moves_one_latent_head():
    """DeepSeek's fixture: 2 layers of one latent, kv_lora_rank 32 + qk_rope_head_dim 8, one pool."""
    cfg = load_model_config("tests/fixtures/deepseek-v3")
    assert disaggregation.bytes_per_request(cfg, jnp.bfloat16, 64) == 2 * 64 * 1 * (32 + 8) * 2
    assert disaggregation.bytes_per_request(cfg, jnp.float8_e4m3fn, 64) == 2 * 64 * 1 * ((32 + 8) + 4)


def test_a_hybrid_moves_its_full_attention_kv_and_its_state():
    """Qwen3-Next's fixture: 1 full-attention layer (2 KV heads of 16) and 3 linear layers' float32
    state: the convolution's 3 last inputs of q, k (8 heads of 16) and v (16 of 16), and 16 x 16 x 16."""
    cfg = load_model_config("tests/fixtures/qwen3-next")
    state = 3 * 4 * ((2 * 8 * 16 + 16 * 16) * 3 + 16 * 16 * 16)
    assert state == cfg.linear_state_bytes(1) == 67584
    assert disaggregation.bytes_per_request(cfg, jnp.bfloat16, 50) == 1 * 50 * 2 * (16 + 16) * 2 + state


def test_the_formulas():
    """One engine: batch requests in output x step + batch x prefill; the pair: the slowest rate."""
    row = {"tp": 4, "dcp": 2, "batch": 8, "step_seconds": {"ag_rs": 0.02, "a2a": 0.01}, "kv_cache_size_tokens": 1000}
    prefill_row = {"tp": 2, "dcp": 1, "kv_cache_size_tokens": 500}
    cfg, work = load_model_config("tiny-llama"), Workload(100, 50, 8)
    flops = disaggregation.prefill_flops(cfg, 100, 1e6)
    assert flops == 2 * 1e6 * 100 + 2 * 8 * (16 + 16) * 100 ** 2
    one, pair = disaggregation.compare(cfg, row, prefill_row, work=work, kv_dtype=jnp.bfloat16, tflops=1e-3,
                                       link_gbps=1e-3, parameters=1e6)
    prefill = lambda tp: flops / (tp * 1e9 * disaggregation.PREFILL_UTILIZATION)
    cycle = 50 * 0.01 + 8 * prefill(4)  # the faster backend's step
    assert one["tokens_per_second"] == pytest.approx(8 * 50 / cycle)
    assert one["prefill_share"] == pytest.approx(8 * prefill(4) / cycle)
    rates = {"decode": 8 / (50 * 0.01), "prefill instance": 1 / prefill(2), "KV link": 1e6 / (100 * 256)}
    assert pair["limited_by"] == min(rates, key=rates.get)
    assert pair["tokens_per_second"] == pytest.approx(min(rates.values()) * 50)
    assert pair["tokens_per_second_per_device"] == pytest.approx(pair["tokens_per_second"] / 6)


def _section(capsys, *argv) -> dict:
    result = _plan(capsys, "--model", DEEPSEEK, *argv)
    pd = result["disaggregation"]
    assert pd["reason"] in result["reasons"] and pd["reason"].startswith(f"disaggregation: {pd['recommended']}")
    return pd


def test_long_prompts_short_outputs_favour_pd_short_prompts_long_outputs_one_engine(capsys):
    """Charging prefill fully, the pair does one engine's work on more devices: it ties at best, when
    its prefill devices keep up exactly with its decode (then P/D: its decode is undisturbed). 8192 in +
    512 out comes close at TP 8 (prefill over half of one engine's time, about 10 prefill devices would
    keep up); at the FLOP/s where 8 do, P/D. 512 in + 8192 out never comes close: one engine, its 8
    prefill devices idle."""
    long = ("--input-len", "8192", "--output-len", "512", "--concurrency", "32", "--prefill-tp", "8")
    near = _section(capsys, *long)
    one, pair = near["rows"]
    assert near["recommended"] == "one engine" and pair["limited_by"] == "prefill instance"
    assert 8 < pair["prefill_devices_to_keep_up"] < 12 and 0.5 < one["prefill_share"] < 0.6
    assert pair["tokens_per_second_per_device"] < one["tokens_per_second_per_device"]
    tflops = near["prefill_tflops"] * pair["prefill_devices_to_keep_up"] / 8  # 8 prefill devices keep up
    pd = _section(capsys, *long, "--prefill-tflops", str(tflops))
    one, pair = pd["rows"]
    assert pd["recommended"] == "P/D" and pair["prefill_devices_to_keep_up"] == pytest.approx(8)
    assert pair["tokens_per_second_per_device"] == pytest.approx(one["tokens_per_second_per_device"])
    assert pair["seconds_per_output_token"] < one["seconds_per_output_token"] / 1.9  # prefill half its time
    assert one["prefill_share"] == pytest.approx(0.5)
    short = _section(capsys, "--input-len", "512", "--output-len", "8192", "--prefill-tp", "8", "--prefill-tflops",
                     str(tflops))
    one, pair = short["rows"]
    assert short["recommended"] == "one engine" and pair["prefill_instance_busy"] < 0.01
    assert one["tokens_per_second_per_device"] > 1.9 * pair["tokens_per_second_per_device"]
    assert plan.main(["--model", DEEPSEEK, *long, "--prefill-tflops", str(tflops)]) == 0
    out = capsys.readouterr().out
    assert "Prefill/decode disaggregation at DCP" in out and "| P/D pair (prefill TP 8, DCP 1 + decode TP 8" in out
    assert f"- {pd['reason']}" in out


def test_a_tpot_target_picks_the_only_set_up_that_meets_it(capsys):
    """DeepSeek-V3 at 8192 in + 512 out: one engine gives a token every ~32 ms (prefill over half its
    time), the pair every ~14 ms for ~12 % fewer tokens/s per device. A 25 ms target: P/D; 50 ms
    (both meet it) or 10 ms (neither): tokens/s per device decides, one engine."""
    long = ("--input-len", "8192", "--output-len", "512", "--concurrency", "32", "--prefill-tp", "8")
    one, pair = _section(capsys, *long)["rows"]
    ms = one["seconds_per_output_token"] * 1e3, pair["seconds_per_output_token"] * 1e3
    assert ms[1] < 25 < ms[0] < 50
    target = _section(capsys, *long, "--max-tpot-ms", "25")
    assert target["recommended"] == "P/D" and target["max_tpot_ms"] == 25
    assert "the only one within --max-tpot-ms 25" in target["reason"]
    for loose_or_tight in ("50", "10"):
        assert _section(capsys, *long, "--max-tpot-ms", loose_or_tight)["recommended"] == "one engine"


def test_the_pair_never_beats_one_engine_per_device():
    """The bound the verdict rests on, over prefill sizes and workloads (the link fast)."""
    cfg = load_model_config("tiny-llama")
    for step, prefill_tp, (in_len, out_len, batch) in itertools.product(
            (0.001, 0.02), (1, 2, 4, 8), ((100, 10, 4), (1000, 500, 32), (10, 1000, 1))):
        row = {"tp": 8, "dcp": 1, "batch": batch, "step_seconds": {"ag_rs": step}, "kv_cache_size_tokens": 1}
        one, pair = disaggregation.compare(cfg, row, {"tp": prefill_tp, "dcp": 1, "kv_cache_size_tokens": 1},
                                           work=Workload(in_len, out_len, batch), kv_dtype=jnp.bfloat16,
                                           tflops=1e-3, link_gbps=1e3, parameters=1e5)
        assert pair["tokens_per_second_per_device"] <= one["tokens_per_second_per_device"] * (1 + 1e-12)


def test_the_section_is_absent_without_prefill_tp(capsys):
    result = _plan(capsys, "--model", "tiny-llama")
    assert result["disaggregation"] is None
    assert not any(reason.startswith("disaggregation:") for reason in result["reasons"])
    assert plan.main(["--model", "tiny-llama"]) == 0
    assert "Prefill/decode" not in capsys.readouterr().out
