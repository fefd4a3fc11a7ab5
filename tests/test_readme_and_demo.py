"""The README's Python example and the main job run as written (fresh processes)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _clean_env():
    import os

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the snippets must set up devices themselves
    return env


def test_readme_python_example_runs():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.strip().splitlines()[-1]) > 0  # bytes_per_device


def test_demo_prints_bytes_and_errors():
    result = subprocess.run(
        [sys.executable, "-m", "dcpjax.demo", "--num-cpu-devices", "8", "--context-len", "512"],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+\(", line)]
    assert len(rows) == 6  # GQA: DCP 1, 2; MLA: DCP 1, 2, 4, 8
    assert all(float(row[-1]) < 1e-5 and float(row[-2]) < 1e-5 for row in rows)
    assert "not valid" in result.stdout
