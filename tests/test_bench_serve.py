"""`python -m dcpjax.bench serve` against a fake OpenAI-compatible server that records every request:
the warm-up's prompts, lengths and concurrency, --seed, vLLM's flag names, the table, and a
server that does not answer (one line, exit status 2). No model runs here: numbers are not asserted."""

import http.server
import json
import subprocess
import sys
import threading
import time

import pytest

from dcpjax.bench.__main__ import main, parse_args
from dcpjax.bench.serving import prompts_for, warmup_count
from dcpjax.entrypoints import cli
from dcpjax.serve.process.launch import HOST, free_port

BLOCK = 32  # the cache block of a TP 8 / DCP 2 server (16 x DCP 2): a shared first block is a prefix hit


class _Recorder(http.server.BaseHTTPRequestHandler):
    """/v1/models, /metrics and streamed /v1/completions; each completion recorded with the
    requests in flight when it arrived (itself included)."""

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(body)

    def _refused(self) -> bool:
        """A server started with --api-key: 401 without the key."""
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":
            self.send_error(401)
            return True
        return False

    def do_GET(self):
        if self._refused():
            return
        if self.path == "/v1/models":
            card = {"object": "list", "data": [{"id": "fake", "kv_cache_size_tokens": 4096}]}
            self._send(json.dumps(card).encode(), "application/json")
        else:
            self._send(b'dcpjax:kv_cache_usage_perc{model_name="fake"} 0.25\n', "text/plain")

    def do_POST(self):
        if self._refused():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.in_flight += 1
            server.seen.append({"prompt": body["prompt"], "max_tokens": body["max_tokens"],
                                "in_flight": server.in_flight})
        time.sleep(0.15)  # long enough for the other requests of a wave to arrive
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            finish = "length" if i == body["max_tokens"] - 1 else None
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 0}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        with server.lock:
            server.in_flight -= 1


@pytest.fixture()
def fake_server():
    server = http.server.ThreadingHTTPServer((HOST, 0), _Recorder)
    server.lock, server.in_flight, server.seen, server.key = threading.Lock(), 0, [], None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _bench(server, *flags) -> list[dict]:
    """Run `bench serve` against the fake server; the requests it received, in arrival order."""
    server.seen.clear()
    url = f"http://{HOST}:{server.server_address[1]}"
    assert main(["serve", "--base-url", url, "--no-progress", *flags]) == 0
    return list(server.seen)


WORKLOAD = ["--random-input-len", "40", "--random-output-len", "5", "--num-prompts", "8", "--max-concurrency", "3"]


def test_warm_up_runs_the_measured_shapes_with_other_prompts(fake_server, tmp_path, capsys):
    """The warm-up is two waves of --max-concurrency requests: the same prompt lengths, the same
    concurrency, the first wave at the measured output length; none of its prompts shares a
    cache block with a measured one. The table is printed; --json keeps the numbers."""
    seen = _bench(fake_server, *WORKLOAD, "--json", str(tmp_path / "out.json"))
    warm, measured = seen[:6], seen[6:]
    assert len(measured) == 8 and {len(r["prompt"]) for r in seen} == {40}
    assert [r["max_tokens"] for r in warm[:3]] == [5, 5, 5] and all(1 <= r["max_tokens"] <= 5 for r in warm)
    assert {r["max_tokens"] for r in measured} == {5}
    assert max(r["in_flight"] for r in warm) == 3 == max(r["in_flight"] for r in measured)
    assert not {r["prompt"][:BLOCK] for r in warm} & {r["prompt"][:BLOCK] for r in measured}
    out = capsys.readouterr().out
    assert "| metric | server |" in out and "| completed / failed | 8 / 0 |" in out and "| TTFT mean (ms) |" in out
    assert "input 40, output 5, 8 prompts, concurrency 3" in out and not out.lstrip().startswith("{")
    result = json.loads((tmp_path / "out.json").read_text())["server"]
    assert (result["completed"], result["seed"], result["num_warmups"]) == (8, 0, 6)
    assert result["kv_cache_size_tokens"] == 4096 and result["ttft"]["mean_ms"] > 0


def test_seed_draws_the_prompts(fake_server):
    """The same seed sends the same prompts; another seed other ones (no shared first block: a
    rerun does not hit the cache its first run filled), and --num-warmups 0 sends no warm-up."""
    first = [r["prompt"] for r in _bench(fake_server, *WORKLOAD, "--num-warmups", "0")]
    again = [r["prompt"] for r in _bench(fake_server, *WORKLOAD, "--num-warmups", "0", "--seed", "0")]
    other = [r["prompt"] for r in _bench(fake_server, *WORKLOAD, "--num-warmups", "0", "--seed", "1")]
    assert len(first) == 8 and set(first) == set(again)  # the arrival order may vary
    assert not {p[:BLOCK] for p in first} & {p[:BLOCK] for p in other}


@pytest.mark.parametrize("dataset", ["random", "prefix_repetition"])
def test_warm_up_prompts_are_never_measured_prompts(dataset):
    """Over a few seeds, no warm-up prompt (nor prefix) starts like a measured prompt of any seed."""
    flags = ["--dataset-name", dataset, "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8"]
    warm, measured = set(), set()
    for seed in range(4):
        args = parse_args(["serve", *flags, "--seed", str(seed)])
        warm |= {p[:BLOCK] for p in prompts_for(args, warmup_count(args), warmup=True)}
        measured |= {p[:BLOCK] for p in prompts_for(args, args.num_prompts)}
    assert len(measured) >= 4 * (4 if dataset == "prefix_repetition" else 32) and not warm & measured


def test_prefix_repetition_warm_up_hits_its_own_prefixes():
    """One request per prefix misses; the warm-up goes on past them, so a prefix hit's shapes
    (a suffix chunk beside a long block table) are compiled before the measured run too."""
    args = parse_args(["serve", "--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "4",
                       "--max-concurrency", "1", "--num-prompts", "32"])
    starts = [p[:BLOCK] for p in prompts_for(args, warmup_count(args), warmup=True)]
    assert len(starts) == 6 and len(set(starts)) == 4  # 4 misses, 2 hits


def test_vllm_flag_names_and_the_short_ones_are_the_same_flags():
    vllm = parse_args(["serve", "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "100",
                       "--prefix-repetition-suffix-len", "10", "--prefix-repetition-num-prefixes", "3",
                       "--prefix-repetition-output-len", "7", "--seed", "5"])
    short = parse_args(["serve", "--dataset", "prefix-repetition", "--prefix-len", "100", "--suffix-len", "10",
                        "--num-prefixes", "3", "--output-len", "7", "--seed", "5"])
    assert vllm == short and vllm.dataset == "prefix_repetition"
    random = parse_args(["compare", "--dataset-name", "random", "--random-input-len", "50", "--random-output-len", "9"])
    assert (random.input_len, random.output_len) == (50, 9)
    assert parse_args(["compare", "--input-len", "50", "--output-len", "9"]) == random
    assert parse_args(["serve"]).seed == 0 and warmup_count(parse_args(["serve", "--num-prompts", "5"])) == 5


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "invalid choice: 'sharegpt'"),
    (["--max-concurrency", "0"], "--max-concurrency: expected an integer >= 1"),
    (["--num-warmups", "-1"], "--num-warmups: expected an integer >= 0"),
])
def test_bad_workload_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_a_server_that_does_not_answer_is_one_line(capsys):
    port = free_port()
    assert cli.run(main, ["serve", "--base-url", f"http://{HOST}:{port}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (len(err) == 1 and err[0].startswith("error: ")
            and f"the server at http://{HOST}:{port} does not answer" in err[0])
    assert f"python -m dcpjax.serve --port {port}" in err[0]


def test_a_server_that_wants_a_key_says_so(fake_server, capsys):
    fake_server.key = "secret"
    url = f"http://{HOST}:{fake_server.server_address[1]}"
    assert cli.run(main, ["serve", "--base-url", url, "--no-progress", *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "HTTP 401" in err and "--api-key" in err and not fake_server.seen
    assert len(_bench(fake_server, *WORKLOAD, "--api-key", "secret")) == 6 + 8


def test_the_command_line_exits_2_and_debug_shows_the_traceback():
    command = [sys.executable, "-m", "dcpjax.bench", "serve", "--base-url", f"http://{HOST}:{free_port()}"]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode == 2 and plain.stderr.startswith("error: ") and "Traceback" not in plain.stderr
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=120, check=False)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "does not answer" in debug.stderr
