"""Every error line a command prints carries its fix: a walk over the CLIs' error paths.

Two kinds of line: argparse's, for a flag value it cannot take (`argument --flag: ...`: it names
the flag, and the line says which values would do: a range, a list, a form), and dcpjax's own
(`error: <what> — <how to fix>`, `entrypoints.cli`), where the em dash starts the fix. Each case
is one command line a user could type; the models are tiny (or only their config is read), so
nothing here loads more than a config.
"""

import json

import pytest

from dcpjax.entrypoints import cli, generate
from dcpjax.serve import __main__ as serve

SERVE_PORT = ["--port", "0"]
# what argparse's line must say of the values that would do
VALID_VALUES = ("must be", "expected", "one of", "invalid choice", "did you mean", "known:", "needs", "at most",
                "at least")


def error_of(main, argv, capsys) -> str:
    try:
        status = cli.run(main, argv)
    except SystemExit as exited:  # argparse's own exit
        status = exited.code
    assert status == cli.USAGE_EXIT, (argv, status)
    line, = (x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ") or ": error: " in x)
    return line


# dcpjax's own errors (the engine's checks, the configuration's rules): "error: what — fix"
OWN = [
    ["smollm2-135m-instruct", "--max-model-len", "100000"],
    ["smollm2-135m-instruct", "-tp", "9", "-dcp", "2"],
    ["tiny-llama", "-tp", "16"],
    ["tiny-llama", "--enable-expert-parallel"],
    ["tiny-llama", "--kv-cache-memory-bytes", "4k", "--max-model-len", "4096"],
    ["tiny-llama", "--kv-cache-memory-bytes", "64k", "--max-model-len", "4096"],
    ["./missing.gguf"],
    ["no-such-model"],
]
# argparse's: a flag value it cannot take
FLAGS = [
    ["tiny-llama", "--kv-transfer-config", json.dumps({"kv_role": "producer"})],
    ["tiny-llama", "--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "kv_port": -1})],
    ["tiny-llama", "--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "kv_buffer_size": 0})],
    ["tiny-llama", "--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "kv_connector": "NixlConnector"})],
    ["tiny-llama", "--kv-transfer-config", "{not json"],
    ["tiny-llama", "--max-num-seqs", "0"],
    ["tiny-llama", "--max-model-len", "ten"],
    ["tiny-llama", "--dtype", "float8"],
    ["tiny-llama", "-q", "int3"],
    ["tiny-llama", "--block-size", "0"],
    ["tiny-llama", "--kv-cache-memory-bytes", "lots"],
    ["tiny-llama", "--gpu-memory-utilization", "2"],
    ["tiny-llama", "--speculative-config", json.dumps({"method": "magic"})],
    ["tiny-llama", "--dcp-comm-backend", "nccl"],
]


@pytest.mark.parametrize("main", [generate.main, serve.main], ids=["generate", "serve"])
@pytest.mark.parametrize("argv", OWN, ids=lambda a: " ".join(a[1:]) or a[0])
def test_each_own_error_line_says_how_to_fix_it(main, argv, capsys):
    line = error_of(main, argv + (SERVE_PORT if main is serve.main else []), capsys)
    assert line.startswith("error: ") and " — " in line, line


@pytest.mark.parametrize("main", [generate.main, serve.main], ids=["generate", "serve"])
@pytest.mark.parametrize("argv", FLAGS, ids=lambda a: " ".join(a[1:]))
def test_each_flag_error_line_names_the_flag_and_the_values_that_would_do(main, argv, capsys):
    line = error_of(main, argv + (SERVE_PORT if main is serve.main else []), capsys)
    assert ": error: argument " in line and (" — " in line or any(v in line for v in VALID_VALUES)), line
    assert line.count(", got ") <= 1, line  # said once


@pytest.mark.parametrize("argv", [
    ["--decode", "http://127.0.0.1:8200"],
    ["--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"],
    ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--port", "70000"],
    ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--timeout", "0"],
], ids=["no prefill", "no scheme", "port", "timeout"])
def test_each_router_error_line_says_what_would_do(argv, capsys):
    from dcpjax.serve.router import __main__ as router

    line = error_of(router.main, argv, capsys)
    assert ": error: " in line and (" — " in line or any(v in line for v in VALID_VALUES + ("required",))), line
