"""The README's Python example and the main job run as written (fresh processes)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _clean_env():
    import os

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the snippets must set up devices themselves
    return env


README_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


@pytest.mark.parametrize("block", README_BLOCKS, ids=[f"block{i}" for i in range(len(README_BLOCKS))])
def test_readme_python_examples_run(block):
    result = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=_clean_env(), capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_readme_has_examples():
    assert len(README_BLOCKS) >= 2


def test_demo_prints_bytes_and_errors():
    result = subprocess.run(
        [sys.executable, "-m", "dcpjax.demo", "--num-cpu-devices", "8", "--context-len", "512"],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+\(", line)]
    assert len(rows) == 6  # GQA: DCP 1, 2; MLA: DCP 1, 2, 4, 8
    assert all(float(row[-1]) < 1e-5 and float(row[-2]) < 1e-5 for row in rows)
    assert "not valid" in result.stdout


def test_generate_cli_compares_dcp_with_dcp_1():
    result = subprocess.run(
        [sys.executable, "-m", "dcpjax.generate", "--num-cpu-devices", "8", "-tp", "8", "-dcp", "4",
         "--compare-dcp-1", "--max-tokens", "8", "--kv-cache-memory-bytes", "4194304", "--max-model-len", "256"],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KV capacity 4.00x" in result.stdout and "greedy outputs identical: True" in result.stdout
    assert "KV cache size:" in result.stderr  # the start-up log line
