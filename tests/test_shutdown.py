"""SIGTERM under load: accepted requests finish, new ones get 503 + Retry-After, the server exits 0."""

import json
import signal
import threading

import httpx
import pytest

from dcpjax.serve.process.launch import start_server

MAX_TOKENS = 400


class Stream(threading.Thread):
    """One streamed completion; records its status, chunks and finish reason."""

    def __init__(self, base: str, index: int):
        super().__init__(daemon=True)
        self.base, self.index = base, index
        self.started = threading.Event()
        self.status, self.chunks, self.finish, self.error = None, 0, None, None

    def run(self) -> None:
        body = {"model": "tiny-llama", "prompt": f"request {self.index}", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[len("data: "):])["choices"][0]
                        self.chunks += 1
                        self.finish = choice["finish_reason"] or self.finish
                        self.started.set()
        except httpx.HTTPError as error:  # an accepted request must never end this way
            self.error = repr(error)
        finally:
            self.started.set()


@pytest.mark.parametrize("timeout, finish", [(60, "length"), (0.2, "abort")])
def test_sigterm_drains_accepted_requests_and_exits_zero(timeout, finish):
    """With time enough every request completes; past --shutdown-timeout the rest are aborted,
    each stream still ending with a final chunk (finish_reason "abort"), never cut off."""
    args = ["--num-cpu-devices", "1", "--kv-cache-memory-bytes", str(8 << 20), "--max-model-len", "512",
            "--shutdown-timeout", str(timeout)]
    with start_server(args, timeout=240) as server:
        base, process = server.base_url, server.procs[0]
        streams = [Stream(base, i) for i in range(6)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(60)
        process.send_signal(signal.SIGTERM)
        in_flight = sum(s.finish is None for s in streams)
        refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny-llama", "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["type"] == "service_unavailable"
        try:  # draining: unhealthy; with a 0.2 s timeout on a loaded host it may have exited already
            assert httpx.get(f"{base}/health").status_code == 503
        except httpx.ConnectError:
            assert timeout < 1 and process.wait(timeout=60) == 0, server.log_tail()
        for stream in streams:
            stream.join(timeout=120)
        assert process.wait(timeout=60) == 0, server.log_tail()
    assert in_flight > 0  # the signal came while requests were generating
    for s in streams:  # every accepted request got its end: complete, or an explicit abort
        assert (s.status, s.error) == (200, None), vars(s)
        assert s.finish == ("length" if s.finish == "length" else finish), vars(s)
        assert s.chunks >= MAX_TOKENS or s.finish == "abort", vars(s)
    if finish == "abort":
        assert any(s.finish == "abort" for s in streams)
