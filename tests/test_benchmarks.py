"""The benchmark scripts still run (tiny sizes; numbers are not asserted here)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("comm, collective", [("ag_rs", "reduce-scatter"), ("a2a", "all-to-all")])
def test_attention_benchmark_smoke(comm, collective):
    out = _run("benchmarks/attention.py", "--contexts", "256", "--total-tokens", "512", "--repeats", "1",
               "--dcp-comm-backend", comm)
    assert "max KV tokens / device" in out and "HLO collective bytes" in out and "kernel / memcpy" in out
    # the capacity table reads the library: DCP 8 holds 8x the MLA tokens of DCP 1
    assert "| DeepSeek-V3-like MLA (128 h, 512 + 64) | 8 |" in out and "| 8.00x |" in out
    # the compiled program moves exactly what the algorithm needs: no hidden KV traffic
    step_rows = [line for line in out.splitlines() if " x 2 | " in line]
    assert len(step_rows) == 6
    for row in step_rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == cells[-2], row
        assert (collective in cells[-3]) == (cells[2] != "1"), row


@pytest.mark.e2e  # slow: one Python (marker docs in pyproject.toml)
def test_gpu_check_dry_run_on_cpu():
    out = _run("benchmarks/gpu_check.py", "--cpu-smoke")
    assert sum("PASS" in line for line in out.splitlines() if line.startswith("|")) == 4
    assert "Pallas within 0.01 of dequantize: True" in out  # the quantized matmul's GPU program, interpreted


def test_decode_benchmark_smoke():
    out = _run("benchmarks/decode.py", "--contexts", "64", "--steps", "4", "--batch", "2", "--dcp", "1", "2")
    rows = [line for line in out.splitlines() if line.startswith("| 64 |")]
    assert len(rows) == 2 and "1.00x" in rows[0]


def test_bench_throughput_breakdown():
    """bench throughput on 8 fake devices: the breakdown is printed, the timed run compiles
    nothing new, and the asynchronous loop gives the synchronous loop's tokens."""
    import json

    out = _run("-m", "dcpjax.bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
               "--num-cpu-devices", "8", "-tp", "4", "-dcp", "2", "--num-iters", "2", "--json")
    result = json.loads(out[out.index("{"):])
    assert result["output_tokens"] == 32 and result["recompilations"] == 0 and result["identical_to_sync"]
    assert len(result["all_elapsed_s"]) == 2 and result["elapsed_s"] in result["all_elapsed_s"]
    assert result["timings"]["steps"] >= 8 and 0 <= result["device_idle"] <= 1
    assert result["weight_bytes"] > 0 and result["read_bandwidth_GBps"] > 0 and "weight-read floor" not in out


def test_weight_bytes_count_every_device_shard():
    """The weights each device holds (what bench's weight-read floor sums over the fake devices):
    every device holds its shards, and the fullest one what the planner computes for the same layout."""
    import jax.numpy as jnp

    from dcpjax import LLM
    from dcpjax.plan.deployment import weight_bytes_per_device

    llm = LLM("tiny-llama", tensor_parallel_size=8, decode_context_parallel_size=2, max_model_len=64,
              kv_cache_memory_bytes=1 << 20)
    held = llm.weight_bytes_by_device()
    assert len(held) == 8 and min(held.values()) > 0
    assert llm.weight_bytes_per_device == weight_bytes_per_device(llm.model_config, llm.parallel_config, jnp.float32)


def test_bench_throughput_with_speculation(tmp_path):
    """--speculative-config also times the engine without it: the same tokens, the speed-up and the
    acceptance (tiny-llama drafting for itself accepts nearly every draft); prompts from a file."""
    import json

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[97, 98, 99] * 8, [100, 101] * 12]))
    spec = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3}
    out = _run("-m", "dcpjax.bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "12",
               "--dataset-path", str(prompts), "--speculative-config", json.dumps(spec), "--no-breakdown",
               "--num-iters", "1", "--json")
    result = json.loads(out[out.index("{"):])
    assert result["without_speculation"]["identical_tokens"] and result["output_tokens"] == 48
    assert result["spec_decode"]["mean_acceptance_length"] > 3 and result["speedup_vs_no_spec"] > 0
    assert result["dataset"] == str(prompts) and result["speculative_config"] == spec


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (the bench extra)")
def test_make_cycle_llama_follows_its_cycles(tmp_path):
    """The speculative-decoding workload's model continues its prompts' cycles (the script checks
    it with transformers and fails otherwise); dcpjax loads the folder and agrees."""
    import json

    out = _run("benchmarks/make_cycle_llama.py", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.json"),
               "--num-prompts", "2", "--input-len", "80", "--hidden", "32", "--heads", "8", "--kv-heads", "4",
               "--layers", "1", "--intermediate", "32")
    assert "wrote" in out
    from dcpjax import LLM, SamplingParams

    prompts = json.loads((tmp_path / "p.json").read_text())
    llm = LLM(str(tmp_path / "m"), max_model_len=128)
    [result] = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=40))
    cycle = next(p for p in range(1, 80) if prompts[0][p:] == prompts[0][:-p])
    assert result.outputs[0].token_ids == [prompts[0][(80 + i) % cycle] for i in range(40)]


def test_prefill_kv_reads_count():
    """The analytic count: a tile of queries reads each page once, so never more than before."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefill_kv_reads", ROOT / "benchmarks" / "prefill_kv_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kv_reads = module.kv_reads

    gqa = dict(group=8, dk=128, dv=128, itemsize=2, latent=False, chunk=512, prefix=4096, block_size=16)
    before, now = kv_reads(**gqa, target="gpu")
    # GPU: 128 rows (16 queries x 8 heads) per program -> one page walk per 16 queries
    assert before / now == pytest.approx(16.0, rel=0.01)
    before_one, now_one = kv_reads(**(gqa | dict(chunk=1)), target="tpu")
    assert before_one == now_one  # decode: nothing to share


@pytest.mark.oldest_jax  # slow: one Python (marker docs in pyproject.toml)
def test_roofline_check_smoke():
    out = _run("benchmarks/roofline_check.py", "--contexts", "128", "--batch", "1", "--steps", "3", "--dcp", "1", "2")
    assert "measured CPU preset" in out
    rows = [line for line in out.splitlines() if line.startswith("| 128 |")]
    assert len(rows) == 2 and all(line.rstrip().endswith("x |") for line in rows)


def test_compare_transformers_is_checked_before_anything_is_timed(monkeypatch):
    """A baseline that cannot run fails at once, naming the install, not after the dcpjax timing."""
    from dcpjax.bench import throughput

    with pytest.raises(SystemExit, match="Hugging Face folder, a GGUF file or a built-in pretrained model"):
        throughput.check_transformers("tiny-llama")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs torch: pip install -e \"\.\[bench\]\""):
        throughput.check_transformers(str(ROOT / "tests" / "fixtures" / "qwen3"))


@pytest.mark.e2e
def test_compile_after_ready_smoke():
    """A precompiled server (small grid) starts twice, the second from the first's cache, and a mixed
    workload compiles nothing (the script exits 1 otherwise)."""
    out = _run("benchmarks/compile_after_ready.py", "--tensor-parallel-size", "4", "--max-model-len", "96",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--requests", "24", "--max-prompt-chars", "40")
    assert "start 2: ready in" in out and "0 XLA compiles" in out.splitlines()[2]
    assert "0 failed; XLA compiles while serving: 0; step compilations after ready: 0" in out


def test_expert_parallel_benchmark_counts_what_the_formula_says():
    """The script's HLO bytes against the traffic formula (the compiled program against the analytic
    count). Its routed FLOPs are a formula of the routing it draws (XLA:CPU's cost analysis counts
    ragged_dot densely), so the last line checks only their order: EP's busiest device does more
    of the work. That EP computes the right thing is tests/test_expert_parallel.py's and the parity
    tests' job."""
    rows = json.loads(_run("benchmarks/expert_parallel.py", "--tokens", "16", "--json"))
    assert [r["experts"] for r in rows] == ["tensor-parallel", "EP"]
    for r in rows:  # the compiled layer's collectives are the one reduction, EP or not
        assert r["hlo_collective_bytes"] == pytest.approx(r["formula_bytes"], rel=0.05)
    assert rows[1]["routed_flops_per_device"] > rows[0]["routed_flops_per_device"]  # EP's busiest device


@pytest.mark.e2e
def test_disaggregation_benchmark_smoke():
    """One engine and a P/D pair serve the same requests; every one completes and moves its prompt's
    analytic KV (the timings are the benchmark's to report, not this test's)."""
    out = _run("benchmarks/disaggregation.py", "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
               "--no-progress")
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines() if line.startswith("| "))}
    assert rows["completed / failed"][:2] == ["4 / 0", "4 / 0"]
    sent, received, _ = rows["KV transfers sent / received / released (warm-ups incl.)"][1].split(" / ")
    assert sent == received and int(sent) >= 4
    assert rows["KV bytes per request"][1] == rows["KV bytes per request, analytic"][1] != "0"


def test_kv_transport_benchmark_smoke():
    """Both transports pull a prompt's KV across two processes (bytes/s are the benchmark's to report)."""
    out = _run("benchmarks/kv_transport.py", "--tokens", "1024", "--repeats", "1")
    assert "| SocketConnector | 1,024 |" in out and "| JaxTransferConnector | 1,024 |" in out


def test_kv_transfer_bytes_are_measured_before_they_are_tabled():
    """The 'after' formulas equal the bytes a real pair moved on each leg, and each leg moves no more
    than before the connector's rework (fewer on the legs the rework cut)."""
    out = _run("benchmarks/kv_transfer_bytes.py", "--tokens", "1024")
    assert "== the formulas" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if "| 1,024 |" in line]
    assert len(rows) == 12
    ratios = {(r[0], r[2]): float(r[5]) for r in rows}
    assert all(ratio <= 1.0 for ratio in ratios.values())
    assert ratios[("TP 9 -> TP 9 / DCP 3", "device->host")] < 0.4  # each KV head copied once, not 3 times
    assert ratios[("TP 3 -> TP 9 / DCP 3", "host->device")] <= 0.5  # each DCP rank gets only its own positions
    mla = "MLA-like latent (576 wide), TP 8 -> TP 8 / DCP 8"
    assert ratios[(mla, "device->host")] < 0.2 and ratios[(mla, "host->device")] < 0.2


def test_sparse_attention_benchmark_smoke(tmp_path):
    """Sparse and dense side by side: the sparse step's collectives, read from its compiled HLO, are the
    dense step's plus the top-k all_gather's bytes."""
    rows_file = tmp_path / "rows.json"
    out = _run("benchmarks/sparse_attention.py", "--context", "4096", "--dcp", "2", "--repeats", "1",
               "--json", str(rows_file))
    assert "| 2 |" in out
    (row,) = json.loads(rows_file.read_text())
    assert row["sparse_collective_kb"] * 1e3 == pytest.approx(row["dense_collective_kb"] * 1e3 + 4 * 2048 * 8 * 1)


def test_quantized_matmul_benchmark_smoke():
    out = _run("benchmarks/quantized_matmul.py", "--rows", "1", "--calls", "1")
    rows = [line for line in out.splitlines() if line.startswith("| 576 x 1536 [K, N] | 1 |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[-3] == "1.0"  # held MB: 0.88 M codes + their float16 scales and minimums
    assert all(float(d.split()[1]) < 1e-5 for d in cells[-1].split(", "))  # each backend vs "dequantize"
