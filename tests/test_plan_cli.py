"""`python -m dcpjax.plan` as a user meets it: a deployment file's settings, the defaults in --help,
the link that follows the device, the table's legend, clean rule sentences, one-line errors."""

import argparse
import json
import pathlib
import re

import numpy as np
import pytest

from dcpjax.engine.preflight import max_model_len_problem
from dcpjax.entrypoints import cli
from dcpjax.models.config import ModelConfig
from dcpjax.plan import command as plan
from dcpjax.plan import experts, planner
from dcpjax.plan.deployment import weight_bytes_per_device
from dcpjax.sharding.config import ParallelConfig

# a small Llama in Hugging Face config.json fields (8 query heads, 2 KV heads)
HF_LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0)
# SmolLM2-135M's heads (9 query, 3 KV: no TP 8) and positions (8192: not 8192 in + 512 out)
HF_SMOL = HF_LLAMA | dict(num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
DEPLOYMENT = dict(name="small", model=HF_LLAMA, parallel={"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
                  device_memory_bytes=2e6, memory_utilization=0.5, weight_dtype="float32", kv_cache_dtype="float16",
                  block_size=32)


def _write(tmp_path, data, name="deployment.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _plan(capsys, *argv) -> dict:
    assert plan.main(["--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_deployment_file_sets_the_defaults_and_flags_win(tmp_path, capsys):
    path, cfg = _write(tmp_path, DEPLOYMENT), ModelConfig.from_hf(HF_LLAMA)
    result = _plan(capsys, "--model", path)
    assert (result["tp"], result["weight_dtype"], result["kv_cache_dtype"]) == (4, "float32", "float16")
    assert (result["block_size"], result["memory_utilization"], result["device"]["memory_gb"]) == (32, 0.5, 2e-3)
    assert result["from_file"] == sorted(["tensor_parallel_size", "weight_dtype", "kv_cache_dtype", "block_size",
                                          "memory_gb", "memory_utilization"])
    for row in (r for r in result["sizes"] if r["valid"]):
        assert row["weight_bytes_per_device"] == weight_bytes_per_device(cfg, ParallelConfig(4, row["dcp"]),
                                                                              "float32")
    flags = _plan(capsys, "--model", path, "-tp", "8", "--weight-dtype", "bfloat16", "--block-size", "16",
                  "--memory-gb", "0.004", "--memory-utilization", "0.9", "--kv-cache-dtype", "bfloat16")
    assert (flags["tp"], flags["weight_dtype"], flags["block_size"], flags["from_file"]) == (8, "bfloat16", 16, [])
    assert flags["device"]["memory_gb"] == 0.004 and [r["dcp"] for r in flags["sizes"]] == [1, 2, 4, 8]
    valid = next(r for r in flags["sizes"] if r["valid"])
    assert valid["weight_bytes_per_device"] == weight_bytes_per_device(cfg, ParallelConfig(8, valid["dcp"]),
                                                                            "bfloat16")
    # an explicit device is its preset's memory, not the file's
    b200 = _plan(capsys, "--model", path, "--device", "b200")["device"]
    assert b200["memory_gb"] == planner.DEVICES["b200"].memory_gb


@pytest.mark.oldest_jax  # 20 s: oldest jax only (the other shipped files' plans run on both)
def test_the_shipped_deepseek_file_plans_fp8_weights_at_its_tp(capsys):
    """The issue's case: its float8_e4m3fn weights leave room for KV at TP 8; bfloat16 ones do not."""
    result = _plan(capsys, "--model", "configs/deepseek-v3-tp8-dcp8.json", "--input-len", "1024")
    assert (result["tp"], result["weight_dtype"]) == (8, "float8_e4m3fn") and result["recommended_dcp"] is not None
    assert all(r["valid"] for r in result["sizes"])


@pytest.mark.e2e  # half a minute: newest jax only (the planner's arithmetic is numpy, not jax)
def test_sparse_attention_at_128k_reads_the_top_k_not_the_context(capsys):
    """DeepSeek-V3.2 at 128k: its cache holds an indexer key per token beside the latent, a step reads
    every key but only 2,048 latents per layer (a quarter of dense MLA's read), and DCP adds one all_gather
    of the top-k candidates per layer."""
    from dcpjax.sharding.traffic import dcp_collective_bytes, top_k_merge_bytes

    args = ("--input-len", "131072", "--output-len", "1024")
    sparse = _plan(capsys, "--model", "configs/deepseek-v3.2-tp8-dcp8.json", *args)
    deployment = pathlib.Path(__file__).parents[1] / "configs" / "deepseek-v3.2-tp8-dcp8.json"
    cfg = ModelConfig.from_hf(json.loads(deployment.read_text())["model"])
    by_dcp = {r["dcp"]: r for r in sparse["sizes"]}
    for dcp, row in by_dcp.items():
        latent, key = (cfg.latent_dim, cfg.index_head_dim)
        assert row["kv_bytes_per_token_per_device"] == 61 * (latent + key) * 2 / dcp  # bfloat16, every layer
        context, batch = 131072 + 512, row["batch"]
        share = key / (latent + key)
        assert row["kv_read_bytes_per_step"] == pytest.approx(
            row["dense_kv_read_bytes_per_step"] * (share * context + (1 - share) * 2048) / ((1 - share) * context))
        assert row["kv_read_bytes_per_step"] < row["dense_kv_read_bytes_per_step"] / 3
        for comm, moved in row["collective_bytes_per_step"].items():
            per_layer = dcp_collective_bytes(tp=8, dcp=dcp, q_heads=128, dk=latent, dv=cfg.kv_lora_rank, batch=batch,
                                             q_bytes=2, comm=comm) + top_k_merge_bytes(dcp=dcp, batch=batch, top_k=2048)
            assert moved == pytest.approx(61 * per_layer)
    assert sparse["recommended_dcp"] == 8
    assert "MLA over the top 2,048 positions" in sparse["reasons"][0] and "where dense MLA would read" in \
        sparse["reasons"][0]


def test_help_shows_every_default(capsys):
    parser = plan.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
            continue
        assert "(default: " in (action.help or ""), action.option_strings
        if action.default is not None:
            assert f"(default: {action.default})" in text, action.option_strings


@pytest.mark.parametrize("device, link", [("h200", "nvlink"), ("b200", "nvlink"), ("tpu-v5e", "ici"),
                                          ("tpu-v6e", "ici"), ("cpu", "cpu")])
def test_the_interconnect_follows_the_device(device, link, capsys):
    assert _plan(capsys, "--model", "tiny-llama", "--device", device)["link"] == dataclass_dict(planner.LINKS[link])
    explicit = _plan(capsys, "--model", "tiny-llama", "--device", device, "--interconnect", "pcie")
    assert explicit["link"]["name"] == "pcie"
    assert planner.LINKS[link].source and planner.DEVICES[device].link == link


def dataclass_dict(link: planner.Link) -> dict:
    return {"name": link.name, "gbps": link.gbps, "latency_us": link.latency_us, "source": link.source}


def test_the_legend_explains_every_column(capsys):
    assert plan.main(["--model", "tiny-llama", "-tp", "8"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| DCP |"))
    columns = [cell.strip().removesuffix(" (ag_rs, a2a)") for cell in header.strip("|").split("|")]
    assert len(columns) == 9
    for column in columns:
        assert f"\n  {column}: " in out, column


def test_a_rising_kv_read_is_explained(capsys):
    """DCP 1 holds one sequence, DCP 2 three: each device reads half per sequence, for 3x the sequences."""
    base = ("--model", "tiny-llama", "--device", "cpu", "--memory-gb", "1e-4", "--output-len", "16")
    tokens = {r["dcp"]: r["kv_cache_size_tokens"] for r in _plan(capsys, *base)["sizes"] if "kv_cache_size_tokens" in r}
    per_seq = int(tokens[1] / 1.6)  # fits once in DCP 1's cache, three times in DCP 2's (twice the tokens)
    args = (*base, "--input-len", str(per_seq - 16), "--concurrency", "64")
    rows = {r["dcp"]: r for r in _plan(capsys, *args)["sizes"]}
    assert (rows[1]["batch"], rows[2]["batch"]) == (1, 3)
    assert rows[2]["kv_read_bytes_per_step"] > rows[1]["kv_read_bytes_per_step"]
    context = per_seq - 16 + 16 / 2
    for r in (rows[1], rows[2]):  # the legend's formula
        assert r["kv_read_bytes_per_step"] == pytest.approx(r["batch"] * context * r["kv_bytes_per_token_per_device"])
    assert plan.main(list(args)) == 0
    assert ("KV read / step / device rises from DCP 1 to DCP 2: DCP 2 decodes 3 sequences a step where DCP 1 holds "
            "only 1, so each device reads 1/2 as much per sequence for 3.00x the sequences") in capsys.readouterr().out


def test_rule_sentences_are_joined_without_doubled_punctuation(capsys):
    """tiny-llama at TP 6 breaks two rules at DCP 2 and three at DCP 3 ("... = 2.; ..." before)."""
    assert plan.main(["--model", "tiny-llama", "-tp", "6"]) == 0
    out = capsys.readouterr().out
    assert "failed: 8 % 6 = 2; '" in out
    assert not re.search(r"[.;:,]\s*[.;:,]", out.replace("...", "")), re.search(r".{40}[.;:,]\s*[.;:,].{20}", out)
    for row in _plan(capsys, "--model", "tiny-llama", "-tp", "6")["sizes"]:
        assert row["rules_broken"] and not any(s.endswith(".") for s in row["rules_broken"])


# a deployment file's content, what the error says, and whether --model FILE says the same
MALFORMED = [
    ("{}", "no fields 'name', 'model', 'parallel', 'device_memory_bytes'", False),
    ("[1, 2]", "a deployment file is a JSON object, not list", True),
    ("not json", "is not a JSON file", True),
    (json.dumps(DEPLOYMENT | {"model": {"architectures": ["LlamaForCausalLM"]}}),
     "'model' has no 'num_attention_heads'", True),
    (json.dumps(DEPLOYMENT | {"parallel": {"tp": 8}}), "'parallel' has unknown fields ['tp']", True),
    (json.dumps(DEPLOYMENT | {"parallel": {"tensor_parallel_size": 8, "decode_context_parallel_size": 3}}),
     "'parallel': Rule 'tensor_parallel_size % decode_context_parallel_size == 0' failed", True),
    (json.dumps(DEPLOYMENT | {"block_size": 0}), "'block_size' must be an integer >= 1, got 0", True),
    (json.dumps(DEPLOYMENT | {"weight_dtype": "int4"}), "'weight_dtype' must be one of", True),
    (json.dumps({k: v for k, v in DEPLOYMENT.items() if k != "device_memory_bytes"}), "no field 'device_memory_bytes'",
     False),
]


def _error(capsys, argv) -> str:
    assert cli.run(plan.main, argv) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("error: ") and "Traceback" not in captured.err
    return line


@pytest.mark.parametrize("content, message, via_model", MALFORMED)
def test_a_malformed_deployment_file_is_one_line_naming_the_file_and_field(content, message, via_model, tmp_path,
                                                                           capsys):
    path = _write(tmp_path, content)
    line = _error(capsys, [path])
    assert line.startswith(f"error: {path}") and message in line, line
    if via_model:
        line = _error(capsys, ["--model", path])
        assert line.startswith(f"error: --model: {path}") and message in line, line


def test_missing_files_and_models_are_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    assert _error(capsys, [missing]) == f"error: no such file or folder: {missing} — check the path"
    assert _error(capsys, ["--model", missing]).startswith(f"error: --model: model '{missing}': no such file or folder")
    empty = _write(tmp_path, "{}")
    assert _error(capsys, ["--model", empty]).startswith(f"error: --model: {empty}: no field 'model'; a deployment")


def test_a_workload_past_the_models_positions_is_one_line(tmp_path, capsys):
    """The issue's case: SmolLM2 at 1,000,000 tokens a sequence, which the engine refuses, was planned."""
    path = _write(tmp_path, HF_SMOL, "config.json")
    line = _error(capsys, ["--model", path, "-tp", "9", "--input-len", "1000000"])
    assert "1000000 in + 512 out = 1,000,512 tokens" in line and "max_model_len must be in [2, 8192]" in line, line
    assert line.endswith("lower --input-len or --output-len so they add up to at most 8,192"), line
    assert _plan(capsys, "--model", path, "-tp", "9", "--input-len", "7680")["recommended_dcp"] is not None
    assert "7681 in + 512 out = 8,193 tokens" in _error(capsys, ["--model", path, "-tp", "9", "--input-len", "7681"])


@pytest.mark.parametrize("config, input_len", [(HF_SMOL, 7680), (HF_SMOL | {"sliding_window": 4096}, 3584),
                                               (HF_LLAMA | {"max_position_embeddings": 32768}, 8192)])
def test_the_default_input_fits_the_model(config, input_len, tmp_path, capsys):
    """8192 in + 512 out is past SmolLM2's 8192 positions (or a sliding window dcpjax does not
    implement): the default input is the longest the engine's own rule accepts, and the plan says so."""
    path, cfg = _write(tmp_path, config, "config.json"), ModelConfig.from_hf(config)
    result = _plan(capsys, "--model", path, "-tp", "1")
    assert result["workload"]["input_len"] == input_len and max_model_len_problem(input_len + 512, cfg) is None
    lowered = result["adjusted_defaults"].get("input_len")
    assert (lowered is None) == (input_len == 8192)
    if lowered:
        assert max_model_len_problem(input_len + 512 + 1, cfg) is not None
        assert plan.main(["--model", path, "-tp", "1"]) == 0
        assert f"32 x ({input_len} in + 512 out; {lowered})" in capsys.readouterr().out


def test_the_default_tp_is_one_the_heads_allow(tmp_path, capsys):
    """The issue's case: SmolLM2 at the default TP 8 rejected every row; TP 9 is the nearest its heads allow."""
    path = _write(tmp_path, HF_SMOL, "config.json")
    note = "the default 8 does not divide the 9 query heads; they allow TP 1, 3, 9"
    result = _plan(capsys, "--model", path)
    assert (result["tp"], result["adjusted_defaults"]["tensor_parallel_size"]) == (9, note)
    assert result["recommended_dcp"] is not None
    assert plan.main(["--model", path]) == 0
    assert f": TP 9 ({note}) on h200" in capsys.readouterr().out
    assert "tensor_parallel_size" not in _plan(capsys, "--model", path, "-tp", "3")["adjusted_defaults"]


@pytest.mark.parametrize("heads, kv_heads, tp, why", [
    (16, 2, 8, None),
    (60, 2, 6, "the default 8 does not divide the 60 query heads; they allow TP 1, 2, 4, 6, 10, 12, 20, 30, 60"),
    (24, 3, 6, "the default 8 does not split the 3 KV heads evenly; they allow TP 1, 3, 6, 12, 24"),
])
def test_the_default_tp_is_the_nearest_the_heads_allow(heads, kv_heads, tp, why):
    """60 heads: TP 6 and 10 are as near to 8, the smaller wins; 24 heads over 3 KV heads: TP 8 splits the
    query heads but not the KV heads."""
    cfg = ModelConfig.from_hf(HF_LLAMA | dict(num_attention_heads=heads, num_key_value_heads=kv_heads))
    assert plan.default_tp(cfg) == (tp, why)


def test_every_tp_the_heads_allow_that_fits_is_on_one_line(tmp_path, capsys):
    """The issue's case: SmolLM2 at TP 8 offered TP 1 and 9, not TP 3."""
    path = _write(tmp_path, HF_SMOL, "config.json")
    result = _plan(capsys, "--model", path, "-tp", "8")
    assert [(a["value"], a["dcp"]) for a in result["what_would_fit"]] == [(1, [1]), (3, [1]), (9, [1, 3])]
    assert plan.main(["--model", path, "-tp", "8"]) == 0
    assert ("\n- devices: TP 1 (1 device) fits, at DCP 1; TP 3 (3 devices) fits, at DCP 1; TP 9 (9 devices) fits, "
            "at DCP 1, 3\n") in capsys.readouterr().out


# -- expert parallelism -------------------------------------------------------------------------------
def test_moe_plans_compare_tensor_parallel_experts_with_ep(capsys):
    """The tiny DeepSeek-V3 (8 experts, top-2) at TP 8: both layouts side by side, the same weights (one
    expert a device either way) and the same collective bytes (one reduction either way). One sequence
    activates a quarter of the experts, and EP's busiest device reads a whole one where TP experts read
    a quarter; 32 sequences activate every expert and the reads are equal."""
    fixture = ("--model", "tests/fixtures/deepseek-v3", "--input-len", "128", "--output-len", "64")
    small = _plan(capsys, *fixture, "--concurrency", "1")["experts"]
    tp_row, ep_row = small["rows"]
    assert tp_row["weight_bytes_per_device"] == ep_row["weight_bytes_per_device"]
    assert tp_row["moe_collective_bytes_per_step"] == ep_row["moe_collective_bytes_per_step"] > 0
    # top-2 over 8 devices: a dispatch by all_to_all (2 x 2 / 8 + 7/8 of the tokens) would move less than the
    # reduction (2 x 7/8); DeepSeek-V3's top-8 moves more (below)
    assert ep_row["all_to_all_bytes_per_step"] == 0.75 * ep_row["moe_collective_bytes_per_step"]
    assert ep_row["expert_read_bytes_per_step"] > 3 * tp_row["expert_read_bytes_per_step"]
    assert small["recommended_expert_parallel"] is False
    large = _plan(capsys, *fixture, "--concurrency", "32")["experts"]
    tp_row, ep_row = large["rows"]
    assert ep_row["expert_read_bytes_per_step"] == pytest.approx(tp_row["expert_read_bytes_per_step"], rel=1e-3)
    assert large["recommended_expert_parallel"] is True


def test_the_deepseek_deployment_shows_both_and_recommends(capsys):
    assert cli.run(plan.main, ["--model", "configs/deepseek-v3-tp8-dcp8.json"]) == 0
    out = capsys.readouterr().out
    assert "| tensor-parallel (the table's) |" in out and "| EP (whole experts) |" in out
    assert "- experts: tensor-parallel, EP's busiest device reads" in out  # 32 sequences: few experts each step
    plan_json = _plan(capsys, "--model", "configs/deepseek-v3-tp8-dcp8.json", "--input-len", "1024")
    ep_row = plan_json["experts"]["rows"][1]  # top-8 over 8 devices: a dispatch would move 1.5x the reduction
    assert ep_row["all_to_all_bytes_per_step"] == pytest.approx(1.5 * ep_row["moe_collective_bytes_per_step"])


def test_the_experts_rows_are_the_tables_rows(capsys):
    """One model of a step: the experts section's row for each layout is the table's row at the
    recommended DCP size when planned with that layout (its step, faster backend). DeepSeek-V3's
    deployment showed 20.05 ms at DCP 4 in the table and 13.99 in the tensor-parallel row: the table
    read every routed expert each step, the section only those the batch activates (and added the
    MoE combine). One sequence here activates a quarter of the tiny model's experts."""
    fixture = ("--model", "tests/fixtures/deepseek-v3", "--input-len", "128", "--output-len", "64",
               "--concurrency", "1")
    plans = {ep: _plan(capsys, *fixture, *(["--enable-expert-parallel"] if ep else [])) for ep in (False, True)}
    for result in plans.values():
        for layout, row in zip((False, True), result["experts"]["rows"], strict=True):
            table_row = next(r for r in plans[layout]["sizes"] if r["dcp"] == result["recommended_dcp"])
            assert row["step_seconds"] == min(table_row["step_seconds"].values())
            assert row["expert_read_bytes_per_step"] == table_row["expert_read_bytes_per_step"]
            assert row["moe_collective_bytes_per_step"] == table_row["moe_collective_bytes_per_step"] > 0
    tp_row = plans[False]["sizes"][0]  # a step reads the routed experts it activates, not all it holds
    assert tp_row["weight_read_bytes_per_step"] < tp_row["weight_bytes_per_device"]


def test_deepseek_says_why_each_other_size_and_ep_lost(capsys):
    """The issues' case, DeepSeek-V3's deployment with --enable-expert-parallel: the reasons are about
    DCP 4, the pick (not "DCP 8 holds 8.0x the tokens"); DCP 1, 2 and 8 each get a line with their
    step and by how much it is slower; and the flag's EP, which the experts section compared and
    found slower, says so, by how much, instead of a bare "experts: tensor-parallel"."""
    result = _plan(capsys, "--model", "configs/deepseek-v3-tp8-dcp8.json", "--enable-expert-parallel")
    assert result["recommended_dcp"] == 4
    assert result["reasons"][0] == "model: MLA (one latent per token): DCP 4 holds 2,364,864 tokens, 4.0x DCP 1's"
    sizes, others = {r["dcp"]: r for r in result["sizes"]}, {o["dcp"]: o for o in result["not_recommended"]}
    assert sorted(others) == [1, 2, 8]
    best_ms = min(sizes[4]["step_seconds"].values()) * 1e3
    for dcp, other in others.items():
        assert other["step_ms"] == min(sizes[dcp]["step_seconds"].values()) * 1e3 > best_ms
        assert f"{other['step_ms'] - best_ms:.2f} ms (" in other["reason"]
        assert other["reason"].endswith(f"slower than DCP 4's {best_ms:.2f}")
    lost = result["experts"]["overruled"]
    assert lost["expert_parallel"] is True and result["experts"]["recommended_expert_parallel"] is False
    assert lost["step_ms"] == pytest.approx(best_ms)  # the table is planned with EP
    assert lost["slower_ms"] == pytest.approx(lost["step_ms"] - lost["recommended_step_ms"]) and lost["slower_ms"] > 0
    text = planner.plan_table(result, sections=experts.table_lines(result))
    assert (f"; --enable-expert-parallel, as the table above is planned, was compared and lost: EP's step "
            f"{lost['step_ms']:.2f} ms against tensor-parallel's {lost['recommended_step_ms']:.2f}, "
            f"{lost['slower_ms']:.2f} ms ({lost['slower_percent']:.1f}%) slower\n") in text
    assert "| EP (whole experts) (the table's) |" in text
    assert "\nNot recommended:\n" + "\n".join(f"- DCP {d}: {others[d]['reason']}" for d in (1, 2, 8)) in text


def test_ep_on_a_dense_model_is_one_line(tmp_path, capsys):
    """From the flag, from a deployment file given to --model, and from one planned as a file."""
    message = "enable_expert_parallel needs routed experts, and LlamaForCausalLM has none"
    assert message in _error(capsys, ["--model", "tiny-llama", "--enable-expert-parallel"])
    assert _plan(capsys, "--model", "tiny-llama")["experts"] is None
    dense = _write(tmp_path, DEPLOYMENT | {"parallel": DEPLOYMENT["parallel"] | {"enable_expert_parallel": True}})
    assert message in _error(capsys, ["--model", dense])
    assert message in _error(capsys, [dense])


def test_a_deployment_files_expert_parallel_is_the_default(tmp_path, capsys):
    """The file's "enable_expert_parallel" plans the table with EP's weights, as the flag does."""
    with open("configs/deepseek-v3-tp8-dcp8.json") as f:
        data = json.load(f)
    data["parallel"]["enable_expert_parallel"] = True
    path = _write(tmp_path, data)
    from_file = _plan(capsys, "--model", path, "--input-len", "1024")
    from_flag = _plan(capsys, "--model", "configs/deepseek-v3-tp8-dcp8.json", "--input-len", "1024",
                      "--enable-expert-parallel")
    assert from_file["enable_expert_parallel"] is from_flag["enable_expert_parallel"] is True
    assert "enable_expert_parallel" in from_file["from_file"]
    assert ([r["weight_bytes_per_device"] for r in from_file["sizes"]]
            == [r["weight_bytes_per_device"] for r in from_flag["sizes"]])
    assert _plan(capsys, "--model", "configs/deepseek-v3-tp8-dcp8.json")["enable_expert_parallel"] is False


def test_the_busiest_device_expectation_is_exact():
    """E[max of two devices' Binomial(3, p)], by enumerating every outcome; one device: the mean."""
    from itertools import product

    from dcpjax.plan.experts import expected_busiest

    p = 0.3
    chance = lambda bits: np.prod([p if b else 1 - p for b in bits])
    brute = sum(chance(a) * chance(b) * max(sum(a), sum(b)) for a in product((0, 1), repeat=3)
                for b in product((0, 1), repeat=3))
    assert expected_busiest(3, 2, p) == pytest.approx(brute)
    assert expected_busiest(5, 1, p) == pytest.approx(5 * p)


def test_a_bad_prefill_tp_or_dcp_is_one_line(capsys):
    assert "--prefill-tp 3: the model's 8 query heads and 2 KV heads allow TP 1, 2, 4, 8" in _error(
        capsys, ["--model", "tiny-llama", "--prefill-tp", "3"])
    assert "--prefill-dcp 2 at --prefill-tp 2: 'tensor_parallel_size > num_kv_heads' failed" in _error(
        capsys, ["--model", "tiny-llama", "--prefill-tp", "2", "--prefill-dcp", "2"])
    assert "--prefill-tp 1 --prefill-dcp 1: the prefill instance cannot hold one prompt: weights" in _error(
        capsys, ["--model", "configs/deepseek-v3-tp8-dcp8.json", "--prefill-tp", "1"])
    for flags, message in ((["--prefill-tp", "0"], "--prefill-tp must be >= 1"),
                           (["--prefill-tp", "2", "--kv-link-gbps", "0"], "--kv-link-gbps, --prefill-tflops and"),
                           (["--prefill-tp", "2", "--max-tpot-ms", "-1"], "--kv-link-gbps, --prefill-tflops and")):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error: the line, then where --help is
            plan.main(["--model", "tiny-llama", *flags])
        assert exit_.value.code == 2 and f"error: {message}" in capsys.readouterr().err
