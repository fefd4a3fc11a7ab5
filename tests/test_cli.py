"""The command lines: user errors as one line and exit 2, MODEL as a positional, the server's log
flags and its line per request, and `python -m dcpjax`.

In-process where the error comes before any model is built (8 fake CPU devices here, so "too
few devices" is -tp 16); a few subprocesses for what only `python -m` shows (the `__main__`
blocks, nothing else on stderr).
"""

import argparse
import ast
import asyncio
import logging
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import uvicorn
from fastapi.testclient import TestClient

from dcpjax import LLM
from dcpjax import __main__ as dcpjax_main
from dcpjax.bench import __main__ as bench_main
from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli, generate
from dcpjax.serve import __main__ as serve
from dcpjax.serve.api import build_app
from dcpjax.serve.async_engine import Update
from dcpjax.serve.metrics import Metrics
from dcpjax.serve.process import shutdown
from dcpjax.serve.process.launch import server_env
from dcpjax.serve.request_log import RequestLog

MODEL = "tiny"
HUB_ID = "Qwen/Qwen3-0.6B"
MAINS = {"generate": generate.main, "serve": serve.main}
# serve binds its port before anything else: any free one, so a port 8000 in use elsewhere changes nothing
SERVE_PORT = ["--port", "0"]


def _argv(command: str, argv: list[str]) -> list[str]:
    return [*argv, *SERVE_PORT] if command == "serve" else argv


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# -- user errors: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize("command", MAINS)
@pytest.mark.parametrize("argv, fragments", [
    (["-tp", "16"], ["needs 16 devices", "--num-cpu-devices 16"]),
    # not 8: tiny-llama's 2 KV heads rule it out (the list is the model's, not TP's divisors)
    (["-tp", "8", "-dcp", "3"], ["must divide TP", "tensor_parallel_size=8: [1, 2, 4]."]),
    (["--model", "no-such-model"], ["'no-such-model' is neither a built-in model", "tiny-llama"]),
    (["--model", "./missing.gguf"], ["'./missing.gguf': no such file or folder", "check the path"]),
    ([HUB_ID], ["dcpjax does not download models", f"huggingface-cli download {HUB_ID}"]),
])
def test_user_errors_are_one_line_and_exit_2(command, argv, fragments, capsys):
    assert cli.run(MAINS[command], _argv(command, argv)) == cli.USAGE_EXIT
    err = one_error_line(capsys)
    assert all(f in err for f in fragments), err


@pytest.mark.parametrize("command", MAINS)
def test_every_problem_of_the_command_line_at_once(command, capsys):
    """SmolLM2 (9 query, 3 KV heads) at TP 16 on 8 devices: the TP its heads refuse, a max_model_len
    past its positions and the devices missing, in one error (it used to ask for --num-cpu-devices
    first, then refuse the TP)."""
    assert cli.run(MAINS[command], _argv(command, ["smollm2-135m-instruct", "-tp", "16", "--max-model-len",
                                                   "9000"])) == 2
    err = one_error_line(capsys)
    assert err.startswith("error: 3 problems: (1) ") and "9 % 16 = 9" in err, err
    assert "the model allows tensor_parallel_size [1, 3, 9]" in err and "[2, 8192]" in err, err
    assert "--num-cpu-devices 16" in err, err


@pytest.mark.parametrize("dcp, rule", [("2", "9 % 2 = 1"), ("9", "9 > 9 // 3 = 3")])
def test_valid_dcp_sizes_are_the_models(dcp, rule, capsys):
    """The sizes a message lists are those the same rules accept: -dcp 2 listed [1, 3, 9] (DCP divides
    TP, whatever the model), then -dcp 9 was refused by the model's rules."""
    assert cli.run(generate.main, ["smollm2-135m-instruct", "-tp", "9", "-dcp", dcp]) == 2
    err = one_error_line(capsys)
    assert rule in err and "valid decode_context_parallel_size for tensor_parallel_size=9: [1, 3]" in err, err


@pytest.mark.parametrize("argv, hint", [
    (["--tensor-paralel-size", "4"], "did you mean --tensor-parallel-size?"),
    (["--max-model-lenn", "64", "--prot", "1"],
     "--max-model-lenn: did you mean --max-model-len?; --prot: did you mean --port?"),
])
def test_a_misspelled_flag_is_two_short_lines(argv, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        serve.parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and hint in err, err
    assert err.splitlines()[1:] == ["python -m dcpjax.serve: see --help for every flag"], err  # no usage


def test_a_misspelled_subcommand_flag_is_guessed_too(capsys):
    with pytest.raises(SystemExit):
        bench_main.parse_args(["throughput", "--num-promts", "3"])
    assert "did you mean --num-prompts?" in capsys.readouterr().err


def test_a_busy_port_fails_before_the_model_loads(monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(LLM, "from_engine_args", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.run(serve.main, ["--port", str(port)]) == 2
    err = one_error_line(capsys)
    assert f"cannot serve on 127.0.0.1:{port}" in err and "pass another --port" in err, err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="needs 16 devices"):
        cli.run(generate.main, ["-tp", "16", "--debug"])


def test_several_processes_without_a_coordinator_is_a_usage_error(capsys):
    for argv in (["--num-processes", "2"], ["--num-processes", "2", "--process-id", "2"]):
        with pytest.raises(SystemExit) as exited:
            serve.parse_args(argv)
        assert exited.value.code == 2
    assert "--num-processes > 1 needs --coordinator-address" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs --coordinator-address"):  # a Namespace built by hand
        serve.init_distributed(argparse.Namespace(num_processes=2, coordinator_address=None))


def run_module(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, check=False,
                          env=server_env())


@pytest.mark.parametrize("argv, fragment", [
    (["dcpjax.generate", "-tp", "16"], "--num-cpu-devices 16"),
    (["dcpjax.serve", HUB_ID, *SERVE_PORT], "dcpjax does not download models"),
    (["dcpjax", "serve", "-tp", "8", "-dcp", "3", *SERVE_PORT], "must divide TP"),
])
def test_python_m_prints_one_line_and_exits_2(argv, fragment):
    done = run_module(*argv)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and fragment in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr  # nor JAX's "Unable to initialize backend" lines


# -- MODEL as a positional --------------------------------------------------------------------------
@pytest.mark.parametrize("parse", [generate.parse_args, serve.parse_args], ids=["generate", "serve"])
def test_positional_model_is_model(parse, capsys):
    assert EngineArgs.from_cli_args(parse(["tiny-qwen3", "-tp", "2"])).model == "tiny-qwen3"
    assert parse(["--model", "tiny-qwen3"]).model == "tiny-qwen3"
    assert parse(["tiny-qwen3", "--model", "tiny-qwen3"]).model == "tiny-qwen3"
    assert parse([]).model == EngineArgs().model
    assert not hasattr(parse(["tiny-qwen3"]), "model_tag")
    with pytest.raises(SystemExit) as exited:
        parse(["tiny-qwen3", "--model", "tiny-llama"])
    assert exited.value.code == 2
    assert "MODEL 'tiny-qwen3' and --model 'tiny-llama' differ" in capsys.readouterr().err


# -- the server's log flags and its line per request ------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=128, kv_cache_memory_bytes=1 << 16)


def test_log_flags_reach_uvicorn_and_the_app(llm, monkeypatch):
    seen = {}

    class Server:  # stands in for GracefulServer: records what it is given, serves nothing
        def __init__(self, config, engine, draining, timeout):
            seen["config"] = config

        def run(self, sockets):
            seen["sockets"] = sockets

    monkeypatch.setattr(shutdown, "GracefulServer", Server)
    for argv, level, logged in ([], "warning", True), (["--uvicorn-log-level", "info", "--disable-log-requests"],
                                                        "info", False):
        with serve.bind_port("127.0.0.1", 0) as sock:
            assert serve.serve_http(serve.parse_args(argv), llm, None, sock) == 0
            assert seen["sockets"] == [sock]  # uvicorn serves on the socket bound before loading
        config = seen["config"]
        assert isinstance(config, uvicorn.Config) and config.log_level == level
        assert any(m.cls is RequestLog for m in config.app.user_middleware) == logged
    with pytest.raises(SystemExit):
        serve.parse_args(["--uvicorn-log-level", "loud"])


class CountingEngine:
    """An AsyncEngine stand-in: every choice generates `tokens` tokens ("ab" each), then "length"."""

    def __init__(self, tokens: int = 3):
        self.tokens = tokens

    async def generate(self, seq):
        seq.text = ""
        for i in range(self.tokens):
            seq.token_ids.append(7)
            seq.text += "ab"
            seq.finish_reason = "length" if i == self.tokens - 1 else None
            yield Update("ab", [7], [], seq.finish_reason, seq)


def log_lines(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dcpjax.serve" and r.levelno == level]


@pytest.fixture()
def app_client(llm, caplog):
    caplog.set_level(logging.DEBUG, logger="dcpjax.serve")
    with TestClient(build_app(llm, CountingEngine(), Metrics(MODEL), served_model_name=MODEL, api_key="k")) as client:
        client.headers["Authorization"] = "Bearer k"
        yield client


def completion(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 3, **body})


def test_one_line_per_request_with_tokens_and_finish_reasons(app_client, caplog):
    out = completion(app_client, n=2).json()
    [line] = log_lines(caplog)
    assert line.startswith(f"POST /v1/completions 200 request_id={out['id']} prompt_tokens=4 completion_tokens=6 "
                           "finish_reason=length,length latency_ms="), line
    assert float(line.split("latency_ms=")[1]) >= 0


def test_a_stream_is_logged_when_it_ends(app_client, caplog):
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "stream": True}
    with app_client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert not log_lines(caplog)  # not before the stream ends
        assert list(lines)[-2:] == ["data: [DONE]", ""]
    [line] = log_lines(caplog)
    assert " 200 request_id=cmpl-" in line and "prompt_tokens=- completion_tokens=- finish_reason=length" in line
    assert not line.endswith("incomplete"), line
    caplog.clear()
    with app_client.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        r.read()
    [line] = log_lines(caplog)
    assert "prompt_tokens=2 completion_tokens=3 finish_reason=length" in line, line
    caplog.clear()
    with app_client.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())  # then the client goes away
    [line] = log_lines(caplog)
    assert " 200 request_id=cmpl-" in line and line.endswith(" incomplete"), line


def test_refused_requests_are_logged_and_probes_only_at_debug(app_client, caplog):
    assert completion(app_client, model="other").status_code == 404
    assert app_client.post("/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1},
                           headers={"Authorization": "Bearer wrong", "X-Request-Id": "r-1"}).status_code == 401
    assert app_client.get("/health").status_code == 200
    assert [line.split(" prompt_tokens")[0] for line in log_lines(caplog)] == [
        "POST /v1/completions 404 request_id=-", "POST /v1/completions 401 request_id=r-1"]
    assert [line.split(" latency")[0] for line in log_lines(caplog, logging.DEBUG)] == [
        "GET /health 200 request_id=- prompt_tokens=- completion_tokens=- finish_reason=-"]


def test_disable_log_requests_logs_nothing(llm, caplog):
    caplog.set_level(logging.DEBUG, logger="dcpjax.serve")
    app = build_app(llm, CountingEngine(), Metrics(MODEL), served_model_name=MODEL, log_requests=False)
    with TestClient(app) as client:
        assert completion(client).status_code == 200
    assert not [r for r in caplog.records if r.name == "dcpjax.serve"]


def raw_app(*messages, fail: bool = False):
    """An ASGI app sending `messages` (then raising, if `fail`)."""
    async def app(scope, receive, send):
        for message in messages:
            await send(message)
            await asyncio.sleep(0)
        if fail:
            raise RuntimeError("broken mid-response")
    return app


def start(content_type: bytes) -> dict:
    return {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]}


def test_the_log_never_fails_a_request(caplog):
    caplog.set_level(logging.DEBUG, logger="dcpjax.serve")
    garbage = raw_app(start(b"application/json"), {"type": "http.response.body", "body": b'{"id": [not json'})
    assert TestClient(RequestLog(garbage)).get("/x").text == '{"id": [not json'  # no `with`: no lifespan
    assert log_lines(caplog)[0].startswith("GET /x 200 request_id=- prompt_tokens=- completion_tokens=- ")
    caplog.clear()
    cut = raw_app(start(b"text/event-stream"), {"type": "http.response.body", "body": b'data: {"id": "c-1", "choi',
                                                "more_body": True},
                  {"type": "http.response.body", "body": b'ces": []}\n\n', "more_body": True}, fail=True)
    with pytest.raises(RuntimeError, match="broken mid-response"):
        TestClient(RequestLog(cut)).get("/s")
    [line] = log_lines(caplog)
    assert line.startswith("GET /s 200 request_id=c-1 ") and line.endswith(" incomplete"), line  # split event read
    caplog.clear()
    with pytest.raises(RuntimeError):
        TestClient(RequestLog(raw_app(fail=True))).get("/bug")
    assert log_lines(caplog)[0].startswith("GET /bug 500 ")


# -- python -m dcpjax -------------------------------------------------------------------------------
def test_python_m_dcpjax_lists_the_commands(capsys):
    assert dcpjax_main.main([]) == 0
    out = capsys.readouterr().out
    for name in ("generate", "serve", "bench", "plan", "demo"):
        assert f"\n  {name} " in out
    assert "python -m dcpjax COMMAND --help" in out
    assert dcpjax_main.main(["nope"]) == 2
    assert "unknown command 'nope'" in one_error_line(capsys)


@pytest.mark.parametrize("name", dcpjax_main.COMMANDS)
def test_python_m_dcpjax_runs_each_command(name, capsys):
    with pytest.raises(SystemExit) as exited:
        dcpjax_main.main([name, "--help"])
    assert exited.value.code == 0 and f"usage: python -m dcpjax.{name}" in capsys.readouterr().out


def test_python_m_dcpjax_passes_the_status_on(capsys):
    assert dcpjax_main.main(["serve", "-tp", "8", "-dcp", "3", *SERVE_PORT]) == 2
    assert "must divide TP" in one_error_line(capsys)


def test_python_m_dcpjax_imports_no_command_up_front():
    """Only what `import dcpjax` costs: a command's module is imported when it runs."""
    tree = ast.parse(pathlib.Path(dcpjax_main.__file__).read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    # dcpjax.entrypoints: its `cli` (what every command shares), no command
    assert imported <= {"__future__", "importlib", "sys", "collections.abc", "dcpjax", "dcpjax.entrypoints"}, imported


def test_a_server_that_refuses_its_flags_is_one_line_for_its_launcher(capsys):
    """bench compare / sweep start servers: one that refuses its flags is the user's error, not a traceback."""
    from dcpjax.serve.process.launch import start_server

    def main(argv):
        start_server(["--kv-cache-dtype", "int4"], timeout=120)
        return 0

    assert cli.run(main, []) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the server did not start") and "int4" in lines[0], lines


def test_generate_says_first_when_the_weights_are_random(capsys):
    """`python -m dcpjax.generate --prompt hi` runs the default tiny-llama, whose random weights print
    noise: the first line of the output says so, and names the built-in model with real weights."""
    assert generate.main(["--prompt", "hi", "--max-tokens", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("note: tiny-llama has random weights") and "--model smollm2-135m-instruct" in first


def test_generate_help_shows_the_sampling_defaults():
    """--help names each sampling flag's default (greedy: temperature 0), as the engine flags do."""
    entries = re.split(r"\n  (?=-)", generate.build_parser().format_help())  # one per flag
    for flag, default in (("--max-tokens", "32"), ("--temperature", "0.0"), ("--top-p", "1.0"), ("--top-k", "0"),
                          ("--min-p", "0.0")):
        entry, = (" ".join(e.split()) for e in entries if e.startswith(flag + " "))
        assert f"(default: {default})" in entry, entry
    assert "0 is greedy" in " ".join(entries)
