"""Imports flow one way: kernels <- sharding <- models <- sampling <- sequence <- runner <- spec_decode
<- engine <- llm <- serve / bench (loader: beside the runner, below llm).

Read from the source (ast), so a new import against the flow fails here with the file named.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dcpjax"
# each layer, and the dcpjax modules it must never import
TOP = ["llm", "serve", "bench"]  # the offline API, and what builds on it
LAYERS = {
    "kernels": ["sharding", "models", "sampling", "sequence", "loader", "runner", "spec_decode", "engine", *TOP],
    "sharding": ["models", "sampling", "sequence", "loader", "runner", "spec_decode", "engine", *TOP],
    "models": ["sampling", "sequence", "loader", "runner", "spec_decode", "engine", *TOP],
    "sampling": ["sequence", "loader", "runner", "spec_decode", "engine", *TOP],  # part of the step
    "sequence": ["loader", "runner", "spec_decode", "engine", *TOP],  # the request, read by runner and engine
    "loader": ["runner", "spec_decode", "engine", *TOP],  # checkpoints -> sharded parameters
    "runner": ["loader", "spec_decode", "engine", *TOP],  # the proposers build on the runner
    "spec_decode": ["engine", *TOP],
    "engine": TOP,
    "llm": TOP[1:],  # the server and benchmarks build on it, never the reverse
}


def dcpjax_imports(path: pathlib.Path) -> set[str]:
    """The dcpjax submodules a file imports: 'dcpjax.sharding.mesh' -> 'sharding'."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {name.split(".")[1] for name in names if name.startswith("dcpjax.")}
    return found


def layer_files(layer: str) -> list[pathlib.Path]:
    folder = PACKAGE / layer
    return sorted(folder.glob("*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", list(LAYERS))
def test_imports_flow_one_way(layer):
    for path in layer_files(layer):
        wrong = dcpjax_imports(path) & set(LAYERS[layer])
        assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports dcpjax.{sorted(wrong)}, later than {layer}"


def test_modules_and_functions_stay_small():
    """Modules <= 400 lines, functions <= 60 (the bar the codebase keeps)."""
    for path in sorted(PACKAGE.glob("**/*.py")):
        source = path.read_text()
        assert source.count("\n") <= 400, f"{path.name}: {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{path.name}:{node.lineno} {node.name} is {length} lines"
