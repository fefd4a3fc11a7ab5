"""A multi-process server fails loudly and fast: a dead follower or an engine exception on either
side makes process 0 answer 503 (or refuse), turn /health to 503 and exit non-zero, and the
followers exit too, all within --failure-timeout (here 15 s; the default is 30)."""

import signal
import time

import httpx
import pytest

from dcpjax.serve.process.faults import DEFAULT_FAILURE_TIMEOUT, FAULT_ENV
from dcpjax.serve.process.launch import free_port, start_server

FAILURE_TIMEOUT = 15
REQUEST = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def two_processes(env=None):
    common = ["--num-cpu-devices", "4", "-tp", "8", "-dcp", "2", "--coordinator-address", f"127.0.0.1:{free_port()}",
              "--num-processes", "2", "--kv-cache-memory-bytes", str(4 << 20), "--max-model-len", "128",
              "--failure-timeout", str(FAILURE_TIMEOUT)]
    return start_server(common + ["--process-id", "0"], followers=[common + ["--process-id", "1"]], timeout=240,
                        env=env)


def answer_after_failure(base: str) -> str:
    """What a request gets once a process is gone: a 503, or no connection (process 0 exited)."""
    try:
        response = httpx.post(f"{base}/v1/completions", json=REQUEST, timeout=FAILURE_TIMEOUT + 30)
    except httpx.TransportError:
        return "refused"
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"
    return "503"


def wait_exit(proc, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - start


def test_default_failure_timeout_is_at_most_30_s():
    assert DEFAULT_FAILURE_TIMEOUT <= 30


def test_killed_follower_fails_requests_and_stops_process_0():
    with two_processes() as server:
        follower, leader = server.procs
        assert httpx.post(f"{server.base_url}/v1/completions", json=REQUEST, timeout=120).status_code == 200
        killed = time.monotonic()
        follower.send_signal(signal.SIGKILL)
        assert answer_after_failure(server.base_url) in ("503", "refused")
        code, _ = wait_exit(leader, FAILURE_TIMEOUT + 30)
        detected = time.monotonic() - killed
        assert code != 0 and detected < FAILURE_TIMEOUT + 15, (code, detected, server.log_tail())
        assert "process 0" in server.log_tail(), server.log_tail()


@pytest.mark.parametrize("process", [0, pytest.param(1, marks=pytest.mark.e2e)])  # the other side: newest jax
def test_engine_exception_on_either_side_stops_both(process):
    # the fault fires at that process's 5th engine step: during the first request below
    with two_processes(env={FAULT_ENV: f"step_error:{process}:5"}) as server:
        follower, leader = server.procs
        started = time.monotonic()
        assert answer_after_failure(server.base_url) in ("503", "refused")
        leader_code, _ = wait_exit(leader, FAILURE_TIMEOUT + 30)
        follower_code, _ = wait_exit(follower, FAILURE_TIMEOUT + 30)
        took = time.monotonic() - started
        assert leader_code != 0 and follower_code != 0, server.log_tail()
        assert took < 2 * FAILURE_TIMEOUT + 15, took
        assert "injected fault" in server.log_tail(), server.log_tail()


class _Channel:
    """What process 0 would broadcast, one list of commands per exchange."""

    def __init__(self, *exchanges):
        self.exchanges = list(exchanges)

    def exchange(self, commands=None):
        return self.exchanges.pop(0)


class _IdleEngine:
    def has_work(self):
        return False


@pytest.mark.parametrize("commands, reason", [
    ([{"op": "beat", "step": 3}], "diverged from process 0 (at step 0, process 0 at 3)"),
    ([{"op": "fail", "reason": "RuntimeError('x')"}], "process 0 failed: RuntimeError('x')"),
])
def test_follower_stops_on_divergence_or_a_failure_of_process_0(monkeypatch, caplog, commands, reason):
    from dcpjax.serve.process import faults, multihost

    def exit_process(code, delay=0.0):
        raise SystemExit(code)

    monkeypatch.setattr(faults, "exit_process", exit_process)
    channel = _Channel([{"op": "beat", "step": 0}], commands)
    with pytest.raises(SystemExit) as exited:
        multihost.follow(_IdleEngine(), channel, process=1, failure_timeout=60)
    assert exited.value.code == 1 and reason in caplog.text
    assert multihost.follow(_IdleEngine(), _Channel([{"op": "beat", "step": 0}, {"op": "stop"}]), 1, 60) == 0
