"""colab/quickstart.ipynb runs top to bottom (executed as CI runs it, on CPU)."""

import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_runs_top_to_bottom(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the notebook sets up its own devices
    notebook = nbformat.read(ROOT / "colab" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "colab")}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "greedy outputs identical at DCP 1, 2, 4" in outputs
    assert "SmolLM2 answers identically at DCP 1 and 3" in outputs and "Paris" in outputs
    assert "DCP 4: " in outputs and "KV bytes per device" in outputs
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 4  # the capacity plot, then the sweep's three
    assert "Recommended: DCP 8" in outputs and "server,dcp,input_len,concurrency" in outputs
