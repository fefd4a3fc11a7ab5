"""The KV transfer's socket transport (dcpjax.kv_transfer wire/store/server/client): real sockets on
127.0.0.1, no JAX, no engine."""

import concurrent.futures
import json
import socket
import threading

import ml_dtypes
import numpy as np
import pytest

from dcpjax.kv_transfer import client, wire
from dcpjax.kv_transfer.server import TransferServer
from dcpjax.kv_transfer.store import HeldTransfers
from dcpjax.kv_transfer.wire import TransferError


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "k_fp8": rng.normal(size=(2, 5, 8)).astype(ml_dtypes.float8_e4m3fn),
        "v_bf16": rng.normal(size=(3, 4)).astype(ml_dtypes.bfloat16),
        "positions": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],  # not contiguous
        "state": rng.normal(size=(7,)).astype(np.float32),
        "empty": np.zeros((0, 16), np.float32),
        "scalar": np.array(3.5, np.float32),
    }


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert np.ascontiguousarray(got[name]).tobytes() == np.ascontiguousarray(a).tobytes(), name


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def serving():
    """A store (fake clock, 10 s timeout) and a factory of started servers, closed afterwards."""
    clock, servers = Clock(), []
    store = HeldTransfers(10.0, 1 << 30, clock=clock)

    def start(**kwargs) -> TransferServer:
        server = TransferServer(store, sweep_interval_s=0.02, **kwargs).start()
        servers.append(server)
        return server

    yield store, clock, start
    for server in servers:
        server.close()


# -- wire --------------------------------------------------------------------------------------------
def test_round_trip_of_dtypes_and_bytes_counted():
    arrays = sample_arrays()
    a, b = socket.socketpair()
    with a, b, concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(wire.send_message, a, {"layout": {"dcp": 2}}, arrays)  # a writer, so no buffer fills
        header, got = wire.receive_message(b)
        assert sent.result(timeout=5) == wire.message_nbytes(header, got)
    assert wire.message_nbytes(header, got) == wire.message_nbytes({"layout": {"dcp": 2}}, arrays)
    assert header["layout"] == {"dcp": 2} and [e["name"] for e in header["arrays"]] == list(arrays)
    assert header["arrays"][0]["dtype"] == "float8_e4m3fn" and header["arrays"][1]["dtype"] == "bfloat16"
    assert_same(got, arrays)


def test_eof_mid_message_names_the_counts():
    arrays = {"x": np.ones((100,), np.float32)}
    total = wire.message_nbytes({}, arrays)
    a, b = socket.socketpair()
    with b:
        with a, pytest.raises(TransferError, match="fault injection"):
            wire.send_message(a, {}, arrays, limit_bytes=total - 10)
        with pytest.raises(TransferError, match=rf"after {total - 10} of {total} bytes .*array 'x'"):
            wire.receive_message(b)


def test_clean_eof_and_malformed_messages():
    a, b = socket.socketpair()
    a.close()
    with b, pytest.raises(wire.EndOfStream):
        wire.receive_message(b)
    cases = [(wire.LENGTH.pack(1 << 30), "over the limit"), (wire.LENGTH.pack(3) + b"{x}", "malformed"),
             (wire.LENGTH.pack(2) + b"{}"[:1], "after 9 of at least 10 bytes"),
             (json.dumps({"arrays": [{"name": "x", "dtype": "float99", "shape": [1]}]}).encode(), "unknown dtype")]
    for raw, match in cases:
        if match == "unknown dtype":
            raw = wire.LENGTH.pack(len(raw)) + raw
        a, b = socket.socketpair()
        with b:
            with a:
                a.sendall(raw)
            with pytest.raises(TransferError, match=match):
                wire.receive_message(b)


def test_a_header_check_runs_before_the_arrays_are_read():
    arrays = {"x": np.ones((100,), np.float32)}
    a, b = socket.socketpair()
    with a, b:
        wire.send_message(a, {"n": 1}, arrays)
        seen = []

        def check(header):
            seen.append(header)
            raise TransferError("not this one")

        with pytest.raises(TransferError, match="not this one"):
            wire.receive_message(b, check_header=check)
        assert seen[0]["n"] == 1 and seen[0]["arrays"] == wire.entries(arrays)
        assert len(b.recv(1000)) == 400  # the arrays' bytes were left unread


# -- store -------------------------------------------------------------------------------------------
def test_store_bounds_bytes_and_time():
    clock = Clock()
    store = HeldTransfers(5.0, 100, clock=clock)
    assert store.can_hold(100) and not store.can_hold(101)
    store.put("a", {}, 60)
    assert store.held_bytes == 60 and store.can_hold(40) and not store.can_hold(41)
    with pytest.raises(TransferError, match="reserved or held already"):
        store.put("a", {}, 1)
    with pytest.raises(TransferError, match="would pass the 100 bytes"):
        store.put("c", {}, 41)
    clock.now = 3.0
    store.put("b", {"n": np.ones(1)}, 10)
    assert list(store.get("b", 0)) == ["n"] and store.keys() == ["a", "b"]
    clock.now = 5.0
    with pytest.raises(KeyError, match="unknown or expired.* 5 s"):
        store.get("a", 0)
    assert store.expire() == ["a"] and len(store) == 1 and store.held_bytes == 10
    assert store.remove("b") == 10 and store.remove("b") is None and len(store) == 0


def test_store_reservations_count_and_never_expire():
    clock = Clock()
    store = HeldTransfers(5.0, 100, clock=clock)
    assert store.reserve("r", 70) and not store.reserve("s", 31) and store.reserve("s", 30)
    assert store.held_bytes == 100 and store.keys() == ["r", "s"] and store.nbytes("r") == 70
    with pytest.raises(KeyError, match="unknown or expired"):
        store.get("r", 0)  # reserved, not offered yet: nothing to pull
    with pytest.raises(TransferError, match="not reserved"):
        store.offer("t", {})
    clock.now = 10.0
    assert store.expire() == [] and store.held_bytes == 100  # its prefill still runs
    store.offer("r", {})  # its clock starts now
    with pytest.raises(TransferError, match="held already"):
        store.offer("r", {})
    clock.now = 14.0
    assert store.expire() == [] and store.get("r", 0) == {}
    clock.now = 15.0
    assert store.expire() == ["r"] and store.held_bytes == 30
    assert store.remove("s") == 30 and store.held_bytes == 0 and store.clear() == []


# -- server and client -------------------------------------------------------------------------------
def test_pull_round_trip_acknowledged_and_freed(serving):
    store, _, start = serving
    sent, done = [], threading.Event()
    server = start(on_sent=lambda *a: (sent.append(a), done.set()))
    arrays = sample_arrays()
    store.put("r1", arrays, 1000)
    result = client.pull("127.0.0.1", server.port, "r1")
    assert result.attempts == 1 and result.nbytes == sum(a.nbytes for a in arrays.values())
    assert_same(result.arrays, arrays)
    assert done.wait(5) and sent[0][:2] == ("r1", 1000) and len(store) == 0  # the bytes it was held as


def test_a_payload_not_as_expected_is_refused_before_its_bytes(serving):
    store, _, start = serving
    server = start()
    arrays = sample_arrays()
    store.put("r6", arrays, 1000)
    expected = {name: (a.shape, a.dtype) for name, a in arrays.items()}
    got = client.pull("127.0.0.1", server.port, "r6", expected=dict(reversed(expected.items())))
    assert list(got.arrays) == list(reversed(expected))  # expected's order
    store.put("r7", arrays, 1000)
    expected["v_bf16"] = ((3, 4), np.float32)
    with pytest.raises(TransferError, match=r"not what this server expects: 'v_bf16' is bfloat16\[3, 4\], this "
                                            r"server expects float32\[3, 4\]") as info:
        client.pull("127.0.0.1", server.port, "r7", retries=2, expected=expected)
    assert info.value.attempts == 1 and "r7" in store


def test_unknown_key_is_refused_without_retry(serving):
    _, _, start = serving
    server = start()
    with pytest.raises(TransferError, match="refused: KV transfer 'nope' is unknown or expired.* 10 s") as info:
        client.pull("127.0.0.1", server.port, "nope", retries=3)
    assert info.value.attempts == 1


def test_a_transfer_broken_once_is_retried(serving):
    store, _, start = serving
    done = threading.Event()
    server = start(fault={"fail_after_bytes": 100, "fail_count": 1}, on_sent=lambda *a: done.set())
    arrays = {"kv": np.arange(4096, dtype=np.float32)}
    store.put("r2", arrays, arrays["kv"].nbytes)
    result = client.pull("127.0.0.1", server.port, "r2", retries=1)
    assert result.attempts == 2
    assert_same(result.arrays, arrays)
    assert done.wait(5) and "r2" not in store


def test_out_of_attempts_keeps_the_payload_until_it_expires(serving):
    store, clock, start = serving
    expired, done = [], threading.Event()
    server = start(fault={"fail_after_bytes": 100, "fail_count": 2},
                   on_expired=lambda keys: (expired.extend(keys), done.set()))
    store.put("r3", {"kv": np.zeros(1024, np.float32)}, 4096)
    with pytest.raises(TransferError, match=r"r3 from 127.0.0.1:\d+ failed after 2 attempt\(s\): connection closed"):
        client.pull("127.0.0.1", server.port, "r3", retries=1)
    assert "r3" in store
    clock.now = 10.0
    assert done.wait(5) and expired == ["r3"] and len(store) == 0


def test_release_and_unknown_ops(serving):
    store, _, start = serving
    server = start()
    store.put("r4", {}, 1)
    assert client.release("127.0.0.1", server.port, "r4") and "r4" not in store
    assert not client.release("127.0.0.1", server.port, "r4")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        wire.send_message(sock, {"op": "push"})
        error = wire.receive_message(sock)[0]["error"]
        assert "unknown op 'push': a KV transfer server takes ['pull', 'release']" in error
    server.close()
    assert not client.release("127.0.0.1", server.port, "r4", timeout_s=1)


def test_a_future_payload_is_waited_for(serving):
    store, _, start = serving
    server = start()
    future = concurrent.futures.Future()
    store.put("r5", future, 8)
    threading.Timer(0.1, future.set_result, [{"x": np.arange(2, dtype=np.int32)}]).start()
    result = client.pull("127.0.0.1", server.port, "r5")
    assert result.arrays["x"].tolist() == [0, 1]


def test_a_stalled_transfer_times_out_and_stays_held(serving):
    store, _, start = serving
    server = start(fault={"stall_after_bytes": 100})
    store.put("r8", {"kv": np.zeros(1024, np.float32)}, 4096)
    with pytest.raises(TransferError, match=r"failed after 1 attempt\(s\): timed out"):
        client.pull("127.0.0.1", server.port, "r8", retries=0, timeout_s=0.5)
    assert "r8" in store


def test_a_busy_port_names_the_fix():
    store = HeldTransfers(1.0, 1)
    with TransferServer(store) as server, pytest.raises(OSError, match=f"127.0.0.1:{server.port}.*another kv_port"):
        TransferServer(store, port=server.port)
