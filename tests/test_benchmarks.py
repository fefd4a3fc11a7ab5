"""The benchmark scripts still run (tiny sizes; numbers are not asserted here)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_attention_benchmark_smoke():
    out = _run("benchmarks/attention.py", "--contexts", "256", "--total-tokens", "512", "--repeats", "1")
    assert "max KV tokens / device" in out and "HLO collective bytes" in out and "kernel / memcpy" in out
    # the capacity table reads the library: DCP 8 holds 8x the MLA tokens of DCP 1
    assert "| DeepSeek-V3-like MLA (128 h, 512 + 64) | 8 |" in out and "| 8.00x |" in out


def test_gpu_check_dry_run_on_cpu():
    out = _run("benchmarks/gpu_check.py", "--cpu-smoke")
    assert out.count("PASS") == 4
