"""Imports flow one way, through the layers of LAYERS (each package or top-level module of dcpjax
may import only those before it); every package and module is in a layer; no two modules
import each other, even for types; functions and modules stay small.

Read from the source (ast), so a new import against the flow fails here with the file named.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dcpjax"
# Bottom to top. `outputs` (the result types) and `sequence` (the engine's request) are the public
# face's flat modules; `generate` is the shim of `python -m dcpjax.generate`.
LAYERS = [
    "outputs",  # RequestOutput, CompletionOutput, Logprob: plain data
    "kernels",  # decode attention returning LSE (Pallas, reference); the float64 oracles
    "sharding",  # the mesh, ParallelConfig, the KV layout, LSE-merge collectives, the public op
    "quantization",  # block formats, their numpy codecs, the weight held quantized (dequantized where used)
    "models",  # model families, their configs and layers
    "text",  # tokenizers and chat templates
    "sampling",  # SamplingParams and the on-device sampler
    "loader",  # checkpoints -> sharded parameters (beside the runner: see BESIDE)
    "runner",  # the model on the mesh, one call at a time, from the scheduler's typed messages
    "sequence",  # the engine's request: never seen by the runner
    "kv_transfer",  # prefill/decode disaggregation: a sequence's KV between two engines' layouts
    "spec_decode",  # proposers of drafts, on top of the runner
    "engine",  # requests, scheduler, the loop, outputs; EngineArgs
    "llm",  # the offline API
    "entrypoints",  # what every command shares; python -m dcpjax.generate
    "generate",
    "plan",  # python -m dcpjax.plan: nothing runs
    "demo",  # python -m dcpjax.demo
    "serve",  # python -m dcpjax.serve
    "bench",  # python -m dcpjax.bench (it starts servers)
]
BESIDE = [("loader", "runner")]  # neither imports the other
FACE = {"__init__", "__main__", "configs"}  # the package's own face (and its shipped deployment files)


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
    return sorted(folder.glob("**/*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


def test_every_package_and_module_is_in_a_layer():
    found = {path.name.removesuffix(".py") for path in PACKAGE.iterdir()
             if path.suffix == ".py" or (path.is_dir() and path.name != "__pycache__")}
    assert found - FACE == set(LAYERS), f"not in LAYERS: {sorted(found - FACE - set(LAYERS))}; " \
                                        f"gone: {sorted(set(LAYERS) - found)}"


def test_top_level_holds_the_public_face_only():
    flat = {path.name for path in PACKAGE.glob("*.py")}
    face = {"__init__.py", "__main__.py", "llm.py", "outputs.py", "sequence.py", "generate.py"}
    assert flat <= face, f"dcpjax/ holds {sorted(flat - face)}: a layer's module belongs in its package"


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_flow_one_way(layer):
    later = set(LAYERS[LAYERS.index(layer) + 1 :]) | {b for a, b in BESIDE if a == layer} | \
        {a for a, b in BESIDE if b == layer}
    for path in layer_files(layer):
        wrong = dcpjax_imports(path) & later
        assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports dcpjax.{sorted(wrong)}, later than {layer}"


def module_imports(path: pathlib.Path) -> set[str]:
    """The dcpjax modules a file imports, by full name ('dcpjax.loader.weights'); `from P import m`
    counts module m when P/m.py exists."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dcpjax.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dcpjax"):
            folder = PACKAGE.parent.joinpath(*node.module.split("."))
            subs = {f"{node.module}.{a.name}" for a in node.names if (folder / f"{a.name}.py").exists()}
            found |= subs or {node.module}
    return found


def test_no_import_circles():
    """No module imports one that imports it back (directly or round a longer circle); a package's
    own `__init__` re-exporting its modules is not a circle."""
    name = lambda path: ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    graph = {name(path): module_imports(path) for path in PACKAGE.glob("**/*.py")}
    for module, imported in graph.items():  # a module importing its own package's __init__ is not an edge back
        graph[module] = {m for m in imported if m in graph and not module.startswith(m + ".") and m != module}
    state, circles = {}, []

    def visit(module, stack):
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_modules_and_functions_stay_small():
    """Modules <= 400 lines, functions <= 60 (the bar the codebase keeps)."""
    for path in sorted(PACKAGE.glob("**/*.py")):
        source = path.read_text()
        assert source.count("\n") <= 400, f"{path.name}: {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{path.name}:{node.lineno} {node.name} is {length} lines"


# an object's parts that belong to another layer: code asks the object, never reaches through it
PARTS = {"runner", "engine", "scheduler", "allocator", "processor", "proposer", "llm"}
# private names that are not another object's state: namedtuple's API, jit's cache size, os._exit, argparse's
# group type, and LLM.from_engine_config's own object
PRIVATE_OK = {"_fields", "_replace", "_asdict", "_cache_size", "_exit", "_ArgumentGroup", "_load"}


def attribute_chain(node: ast.Attribute) -> list[str] | None:
    """`a.b.c` -> ['a', 'b', 'c'] (None when the chain does not start at a name)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def test_no_attribute_chain_reaches_through_another_object():
    """`engine.runner.x`, `self.scheduler.allocator.x` or `llm.runner._leaves` reach into a layer that
    the object owns: ask the object (`engine.stats()`, `scheduler.reset()`, `llm.weight_bytes_per_device`)."""
    found = []
    for path in sorted(PACKAGE.glob("**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            chain = attribute_chain(node) if isinstance(node, ast.Attribute) else None
            if not chain or len(chain) < 3:
                continue
            # a part reached and then read into: `x.part.y` (x not self), or any part after the first link
            through = (chain[1] in PARTS and chain[0] != "self") or any(name in PARTS for name in chain[2:-1])
            private = any(name.startswith("_") and not name.startswith("__") and name not in PRIVATE_OK
                          for name in chain[2:])
            if through or private:
                found.append(f"{path.relative_to(PACKAGE.parent)}: {'.'.join(chain)}")
    assert not found, "reaches through another object:\n" + "\n".join(sorted(set(found)))
