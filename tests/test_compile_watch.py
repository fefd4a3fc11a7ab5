"""Compilation, watched: the persistent cache makes a second start load its steps, a step shape
first seen after ready is logged and counted, and the process's compile count is exact."""

import argparse
import json
import logging
import subprocess
import sys

import jax
import numpy as np
import pytest

from dcpjax import LLM, SamplingParams
from dcpjax.engine.args import EngineArgs
from dcpjax.runner.compile_watch import (
    CACHE_DIR_ENV,
    compile_watch,
    default_compilation_cache_dir,
    resolve_compilation_cache_dir,
    use_compilation_cache,
)

START = """
import json, sys
from dcpjax import LLM, SamplingParams
from dcpjax.runner.compile_watch import compile_watch
llm = LLM("tiny-llama", compilation_cache_dir=sys.argv[1], max_model_len=64, kv_cache_memory_bytes=1 << 16)
llm.generate(["a first prompt", "and a second"], SamplingParams(max_tokens=4, temperature=0))
watch = compile_watch()
print(json.dumps({"compiled": watch.compiled, "loaded": watch.loaded, "dir": llm.compilation_cache_dir}))
"""


def _start(cache_dir) -> dict:
    out = subprocess.run([sys.executable, "-c", START, str(cache_dir)], capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_its_steps_from_the_cache(tmp_path):
    """A fresh process each time (JAX's cache folder is process-wide): the second start compiles at
    most a quarter of what the first did and loads the rest."""
    first, second = _start(tmp_path), _start(tmp_path)
    assert first["dir"] == str(tmp_path) and first["compiled"] >= 2  # (a jit rebuilt per layer loads already)
    assert second["loaded"] >= first["compiled"], (first, second)
    assert second["compiled"] <= first["compiled"] // 4, (first, second)


def test_compile_watch_counts_compiles_exactly():
    watch, x = compile_watch(), np.ones(7, np.float32)  # numpy: no jnp op compiles
    before = watch.compiled
    f = jax.jit(lambda x: x * 3 + 1)
    f(x)
    f(x)  # in jit's own cache: no compile
    assert watch.compiled == before + 1


def test_a_step_shape_first_seen_after_ready_is_logged_and_counted(caplog):
    llm = LLM("tiny-llama", max_model_len=64, kv_cache_memory_bytes=1 << 16)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    llm.generate("warm up", greedy)
    llm.mark_ready()
    llm.runner.precompiled = True  # as after a precompile: a compile now is one that escaped it
    caplog.clear()  # the load's own warnings (tiny-llama's random weights)
    with caplog.at_level(logging.WARNING, logger="dcpjax.runner.model_runner"):
        llm.generate("warm up", greedy)  # the same shapes: nothing new
        assert llm.runner.steps_compiled_after_ready == 0 and not caplog.records
        llm.generate(["one", "two", "three"], greedy)  # 3 rows: a new row bucket
    assert llm.runner.steps_compiled_after_ready >= 1
    assert "compiled a decode call of 4 rows x 1 token" in caplog.text


def test_the_cache_folder_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert resolve_compilation_cache_dir("auto") == str(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    assert resolve_compilation_cache_dir("auto") is None  # how the tests turn it off
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == str(tmp_path / "dcpjax" / "jax")
    for off in (None, "", "none", "None"):
        assert resolve_compilation_cache_dir(off) is None
    assert resolve_compilation_cache_dir("~/x").endswith("/x") and "~" not in resolve_compilation_cache_dir("~/x")


def test_an_unwritable_cache_folder_is_a_warning_not_a_failure(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="dcpjax.runner.compile_watch"):
        assert use_compilation_cache(str(blocker / "cache")) is None
    assert "no compilation cache" in caplog.text and jax.config.jax_compilation_cache_dir in (None, "")


@pytest.mark.parametrize("flag, value", [(["--compilation-cache-dir", "none"], "none"), ([], "auto")])
def test_the_flag(flag, value):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(flag))
    assert args.compilation_cache_dir == value
    assert args.create_engine_config().compilation_cache_dir == value
