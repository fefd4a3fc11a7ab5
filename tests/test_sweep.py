"""`python -m dcpjax.bench sweep`: DCP 1 and DCP 2 servers through staged contexts and
concurrencies; a stage that fails stops that server's sweep with a message; JSON, CSV, PNGs."""

import csv
import json
import subprocess
import sys

import pytest

from dcpjax.bench.__main__ import parse_args


@pytest.mark.e2e  # half a minute of stages: newest jax only
def test_sweep_runs_stages_writes_files_and_stops_at_a_failing_stage(tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "dcpjax.bench", "sweep", "--num-cpu-devices", "8", "-tp", "8", "-dcp", "2",
               "--max-model-len", "128", "--input-len", "24,200", "--concurrency", "1,2", "--output-len", "4",
               "--prompts-per-stage", "2", "--output-dir", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # the 200-token stage cannot run
    assert "stage (context 200, concurrency 1) failed" in run.stdout and "max_model_len" in run.stdout
    stages = json.loads((out / "sweep.json").read_text())["stages"]
    # per server: context 24 at concurrency 1 and 2, then context 200 fails and ends its sweep
    assert [(s["dcp"], s["input_len"], s["concurrency"]) for s in stages] == [
        (1, 24, 1), (1, 24, 2), (1, 200, 1), (2, 24, 1), (2, 24, 2), (2, 200, 1)]
    done = [s for s in stages if not s.get("error")]
    assert all(s["failed"] == 0 and s["ttft"]["median_ms"] > 0 and s["output_throughput"] > 0 for s in done)
    # each stage draws prompts of its own: no stage is served from an earlier stage's prefix cache
    assert all(s["prefix_cache_hit_rate"] < 0.1 for s in done), [s["prefix_cache_hit_rate"] for s in done]
    assert {s["kv_cache_size_tokens"] for s in stages if s["dcp"] == 2} == {
        2 * s["kv_cache_size_tokens"] for s in stages if s["dcp"] == 1}
    rows = list(csv.DictReader((out / "sweep.csv").read_text().splitlines()))
    assert len(rows) == 6 and rows[2]["error"] and not rows[0]["error"]
    for name in ("throughput_vs_concurrency.png", "tpot_vs_context.png", "kv_capacity_vs_dcp.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "expected integers >= 1"),
    (["--input-len", "1k"], "comma-separated integers"),
])
def test_bad_sweep_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["sweep", *argv])
    assert message in capsys.readouterr().err
