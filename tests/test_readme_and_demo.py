"""The README's and docs/'s Python examples and the main job run as written (fresh processes);
their command lines parse with the commands' own parsers; their links resolve.

Every ```python block of README.md and docs/*.md runs in a fresh interpreter. Every
`python -m dcpjax...` line of a ```bash block is parsed by that command's parser (and its
TP/DCP checked against ParallelConfig's rules, and its model's where the model is here), without running it.
"""

import pathlib
import re
import shlex
import subprocess
import sys

import jax.numpy as jnp
import pytest

from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import generate
from dcpjax.loader.model_source import load_model_config
from dcpjax.runner.kv_layout import kv_cache_layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.devices import env_without_forced_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _clean_env():
    return env_without_forced_device_count()  # the snippets must set up devices themselves


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _blocks(path: pathlib.Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.DOTALL)


EXAMPLES = [(_name(path), i, block) for path in DOCS for i, block in enumerate(_blocks(path, "python"))]
README_BLOCKS = [block for name, _, block in EXAMPLES if name == "README.md"]


@pytest.mark.parametrize("block", [b for _, _, b in EXAMPLES], ids=[f"{n}-block{i}" for n, i, _ in EXAMPLES])
def test_doc_python_examples_run(block):
    result = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=_clean_env(), capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    # a line an example says is logged is logged, at the log level the example sets
    for claim in re.findall(r'logged (?:above )?as "([^"]+)"', block):
        assert claim.split(" N")[0] in result.stderr, f"the example says it logs {claim!r}: {result.stderr[-2000:]}"


def test_readme_has_examples():
    assert len(README_BLOCKS) >= 1
    # every example the README had before docs/ existed is still run, wherever it lives now
    ran = "\n".join(block for _, _, block in EXAMPLES)
    for marker in ("llm.generate(", "llm.chat(", "reset_prefix_cache", "speculative_config", "dcp_decode_attention",
                   "append_kv", "best_of=", "presence_penalty", "start_server"):
        assert marker in ran, f"no checked example uses {marker!r}"


def test_readme_first_page_has_the_two_commands_and_links_every_page():
    text = README.read_text()
    setup = ("```bash\nmake demo   # the main job: SmolLM2-135M-Instruct answering chat questions at TP 9, DCP 3 on 9 "
             "fake CPU devices, vs DCP 1\nmake test   # installs the package with test extras and runs the test suite "
             "(8 fake CPU devices)\n```")
    assert setup in text
    assert text.index(setup) < len("\n".join(text.splitlines()[:40]))  # first page, before any long text
    for page in DOCS[1:]:
        assert f"]({_name(page)})" in text, f"the README's Documentation list does not link {_name(page)}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_doc_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{_name(path)} links {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{_name(path)} links {target}: no such heading"


def _commands(path: pathlib.Path) -> list[list[str]]:
    """The `python -m dcpjax...` command lines of a page's bash blocks, as argument lists."""
    out = []
    for block in _blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip().startswith("python -m dcpjax"):
                continue
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                if word in ("&", "&&", "|", ">", ";"):
                    words = words[:i]
                    break
            out.append(words[2:])  # drop "python -m"
    return out


COMMANDS = [(_name(path), words) for path in DOCS for words in _commands(path)]


def _parse(module: str, argv: list[str]):
    from dcpjax.entrypoints import cli

    if module == "dcpjax":  # python -m dcpjax COMMAND ARGS
        if not argv:
            return None
        module, argv = f"dcpjax.{argv[0]}", argv[1:]
    if module == "dcpjax.generate":
        from dcpjax.entrypoints import generate

        return cli.parse_with_model(generate.build_parser(), argv)
    if module == "dcpjax.serve":
        from dcpjax.serve import __main__ as serve

        return cli.parse_with_model(serve.build_parser(), argv)
    if module == "dcpjax.bench":
        from dcpjax.bench import __main__ as bench

        return bench.parse_args(argv)
    if module == "dcpjax.plan":
        from dcpjax.plan import command as plan

        return plan.build_parser().parse_args(argv)
    if module == "dcpjax.demo":
        from dcpjax.demo import __main__ as demo

        return demo.build_parser().parse_args(argv)
    raise AssertionError(f"no such command: python -m {module}")


@pytest.mark.parametrize("words", [w for _, w in COMMANDS], ids=[f"{n}-cmd{i}" for i, (n, _) in enumerate(COMMANDS)])
def test_doc_command_lines_parse(words):
    try:
        args = _parse(words[0], words[1:])
    except SystemExit as exit_:
        pytest.fail(f"`python -m {shlex.join(words)}` does not parse (exit {exit_.code}): see stderr above")
    if args is not None and hasattr(args, "decode_context_parallel_size"):
        pc = ParallelConfig(args.tensor_parallel_size, args.decode_context_parallel_size,
                            args.cp_kv_cache_interleave_size, args.dcp_comm_backend)
        pc.check()  # the rules' ValueError
        try:  # and the model's, where the page names one that is here
            cfg = load_model_config(args.model)
        except (ValueError, OSError):
            return
        pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)


def test_docs_show_command_lines():
    assert len(COMMANDS) >= 10
    assert {words[0] for _, words in COMMANDS} >= {"dcpjax.generate", "dcpjax.serve", "dcpjax.plan", "dcpjax.bench"}


def test_readme_plan_output_is_what_plan_prints():
    text = README.read_text()
    match = re.search(r"```bash\n(python -m dcpjax\.plan [^\n]*)\n```\n\n```\n(.*?)```", text, re.DOTALL)
    assert match, "the README's planner example: a ```bash command, then its output in a ``` block"
    command, shown = match.groups()
    result = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=_clean_env(),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.splitlines()
    for line in shown.splitlines():
        assert line in printed, f"the README shows {line!r}; the planner prints:\n{result.stdout}"


def test_install_page_shows_what_make_demo_runs():
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    make = " ".join(recipe.replace("\\\n", " ").replace("$(VENV)/bin/python", "python").split())
    shown = [" ".join(b.replace("\\\n", " ").split()) for b in _blocks(ROOT / "docs" / "install.md", "bash")]
    assert make in shown, f"docs/install.md does not show make demo's command: {make}"


def test_make_demos_capacities_are_the_readmes():
    """`make demo` fixes its KV bytes per device, so the capacities the README shows are what it prints
    on every host (the CPU default, a share of the host's free memory, varied from run to run)."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    argv = recipe.replace("\\\n", " ").split()
    assert "--kv-cache-memory-bytes" in argv, "make demo sizes its KV cache from the host's free memory"
    args = EngineArgs.from_cli_args(generate.parse_args(argv[argv.index("dcpjax.generate") + 1:]))
    cfg = load_model_config(args.model)
    tokens = {dcp: kv_cache_layout(cfg, ParallelConfig(args.tensor_parallel_size, dcp), block_size=args.block_size,
                                   bytes_per_device=args.kv_cache_memory_bytes, dtype=jnp.float32).num_blocks
              * args.block_size * dcp for dcp in (1, args.decode_context_parallel_size)}
    shown = f"KV capacity 3.00x ({tokens[3]:,} vs {tokens[1]:,} tokens)"
    for page in (README, ROOT / "docs" / "install.md"):
        assert shown in page.read_text(), f"{_name(page)} does not show make demo's capacities: {shown}"


def test_architecture_layout_names_every_module():
    layout = re.search(r"## Layout\n\n```\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), re.DOTALL)
    named = {line.split()[0] for line in layout.group(1).splitlines() if line and not line[0].isspace()}
    for path in named:
        assert (ROOT / path).exists(), f"docs/architecture.md's layout names {path}, which does not exist"
    package = ROOT / "dcpjax"
    modules = {f"dcpjax/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {f"dcpjax/{p.name}/" for p in package.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    missing = sorted(m for m in modules if m not in named and not any(n.startswith(m) for n in named))
    assert not missing, f"docs/architecture.md's layout does not name {missing}"


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
