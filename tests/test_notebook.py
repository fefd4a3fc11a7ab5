"""colab/quickstart.ipynb runs top to bottom (executed as CI runs it, on CPU), from outside the
repository: nothing it reads may depend on the working directory (configs/ included)."""

import csv
import io
import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from dcpjax.sharding.devices import env_without_forced_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "colab" / "quickstart.ipynb"


def _install_cell() -> str:
    return nbformat.read(NOTEBOOK, as_version=4).cells[1].source


def _run_install_cell(cwd: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    """The first cell as plain Python (it has no IPython syntax) in a fresh process at `cwd`."""
    return subprocess.run([sys.executable, *flags, "-c", _install_cell()], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def test_install_cell_does_nothing_where_dcpjax_is_installed(tmp_path):
    result = _run_install_cell(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("/dcpjax/__init__.py")  # the package, not a folder of that name
    assert 'REPO_URL = ""' in _install_cell()  # the one line a Colab user edits


def test_install_cell_names_a_folder_that_shadows_the_package(tmp_path):
    (tmp_path / "dcpjax").mkdir()  # what `git clone ... dcpjax` leaves in the working directory
    # -E -S: no PYTHONPATH nor site-packages, so only that folder answers `import dcpjax` (as it
    # does in front of an editable install's finder)
    result = _run_install_cell(tmp_path, "-E", "-S")
    assert result.returncode != 0
    assert f"the folder {tmp_path / 'dcpjax'} hides the dcpjax package" in result.stderr


def test_install_cell_asks_for_the_repository_where_nothing_is_installed(tmp_path):
    result = _run_install_cell(tmp_path, "-E", "-S")  # no PYTHONPATH nor site-packages: no dcpjax, no pip run
    assert result.returncode != 0
    assert "dcpjax is not installed: set REPO_URL" in result.stderr


def _sweep_rows(outputs: str) -> list[dict]:
    """The rows of sweep.csv as the sweep cell prints it."""
    return list(csv.DictReader(io.StringIO(outputs[outputs.index("server,dcp,input_len,concurrency"):])))


@pytest.mark.e2e
def test_quickstart_runs_top_to_bottom(monkeypatch, tmp_path):
    flags = env_without_forced_device_count().get("XLA_FLAGS")  # the notebook sets up its own devices
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if flags:
        monkeypatch.setenv("XLA_FLAGS", flags)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # run where neither configs/ nor ../configs exists: the deployments come from the package
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "greedy outputs identical at DCP 1, 2, 4" in outputs
    assert "SmolLM2 answers identically at DCP 1 and 3" in outputs and "Paris" in outputs
    assert "DCP 4: " in outputs and "KV bytes per device" in outputs
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 4  # the capacity plot, then the sweep's three
    assert "Recommended: DCP 8" in outputs
    rows = _sweep_rows(outputs)
    assert len(rows) == 8  # 2 contexts x 2 concurrencies, at DCP 1 and DCP 2
    # every stage draws its own prompts: one reusing an earlier stage's is served from the
    # prefix cache (98-99.8 % hits), which inflates its throughput
    assert all(float(row["prefix_cache_hit_rate"]) < 0.1 for row in rows), rows
