"""The KV transports behind one interface (dcpjax.kv_transfer.transport), each test on both: the TCP one
(SocketConnector) and jax.experimental.transfer's (JaxTransferConnector). The producer runs in a
subprocess with its own 2 CPU devices (this file, run as a script), the consumer here, on 127.0.0.1
ports the system picks; the bound, expiry and a consumer gone mid-pull are tested in-process."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dcpjax.kv_transfer import wire
from dcpjax.kv_transfer.transport import NAMES, TRANSPORTS, UnknownConnector
from dcpjax.kv_transfer.transport.base import payload_nbytes
from dcpjax.kv_transfer.wire import TransferError

CONNECTORS = ["SocketConnector", "JaxTransferConnector"]
ROOT = Path(__file__).resolve().parents[1]


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "k_f32": rng.normal(size=(2, 3, 4)).astype(np.float32),  # 96 bytes: a cut at 100 falls after it
        "v_bf16": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
        "k_fp8": rng.normal(size=(4, 8)).astype(ml_dtypes.float8_e4m3fn),
        "positions": np.arange(7, dtype=np.int32),
        "empty": np.zeros((0, 16), np.float32),
        "scalar": np.array(2.5, np.float32),
    }


def expected_of(arrays: dict) -> dict:
    import jax

    return {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in arrays.items()}


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        g = np.asarray(got[name])
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert g.tobytes() == np.ascontiguousarray(a).tobytes(), name


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- the producer, in its own process ----------------------------------------------------------------
class Producer:
    """A subprocess holding a sender; JSON lines in (commands), JSON lines out (replies)."""

    def __init__(self, connector: str, **options):
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env = {**os.environ, "XLA_FLAGS": " ".join(flags),  # its own 2 devices (serve), not the tests' 8
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, __file__, connector, json.dumps(options)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.address = self._read()["address"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer exited ({self.proc.wait(5)})")
        return json.loads(line)

    def call(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        return self._read()

    def offer(self, key: str) -> None:
        assert self.call("offer", key=key)["ok"]

    def state(self) -> dict:
        return self.call("state")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(10)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def serve(connector: str, options: dict) -> None:
    """The producer subprocess's loop (this file run as a script)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    from dcpjax.kv_transfer.transport import TRANSPORTS

    events: list = []
    devices = jax.local_devices()
    sender = TRANSPORTS[connector][0](
        "127.0.0.1", 0, max_bytes=options.get("max_bytes", 1 << 30), timeout_s=options.get("timeout_s", 60.0),
        fault=options.get("fault"), on_sent=lambda k, n, s: events.append(["sent", k, n]),
        on_released=lambda k: events.append(["released", k]), on_expired=lambda ks: events.append(["expired", ks]))
    print(json.dumps({"address": sender.address}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "offer":
            arrays = sample_arrays()
            ok = sender.reserve(command["key"], payload_nbytes(arrays))
            if ok:  # device arrays on either device (the socket sender copies them to the host itself)
                arrays = {name: jax.device_put(a, devices[i % 2]) if i % 2 or connector != "SocketConnector" else a
                          for i, (name, a) in enumerate(arrays.items())}
                sender.offer(command["key"], arrays)
            reply = {"ok": ok}
        elif op == "state":
            reply = {"held_bytes": sender.held_bytes, "keys": sender.keys(), "events": events}
        elif op == "quit":
            break
        else:
            reply = {"error": op}
        print(json.dumps(reply), flush=True)
    sender.close()


@pytest.fixture(scope="module", params=CONNECTORS)
def producer(request):
    """One plain producer process per transport, shared by the tests that leave it as they found it."""
    p = Producer(request.param)
    yield request.param, p
    p.close()


def receiver_for(connector: str, **kwargs):
    kwargs.setdefault("timeout_s", 10.0)
    kwargs.setdefault("retries", 1)
    return TRANSPORTS[connector][1](**kwargs)


# -- across two processes ----------------------------------------------------------------------------
def test_round_trip_of_dtypes_across_processes(producer):
    import jax

    connector, p = producer
    p.offer("r1")
    receiver = receiver_for(connector, **({"device": jax.devices()[3]} if connector != "SocketConnector" else {}))
    arrays = sample_arrays()
    result = receiver.pull(p.address, "r1", expected_of(arrays))
    assert result.attempts == 1 and result.nbytes == payload_nbytes(arrays) and result.seconds > 0
    assert_same(result.arrays, arrays)
    if connector == "SocketConnector":
        assert all(isinstance(a, np.ndarray) for a in result.arrays.values())
    else:  # on the receiver's device, each array whole
        assert all(a.devices() == {jax.devices()[3]} for a in result.arrays.values())
    state = wait_for(lambda: (s := p.state())["events"] and s, what="the ack")
    assert state["events"][-1] == ["sent", "r1", payload_nbytes(arrays)]
    assert state["held_bytes"] == 0 and state["keys"] == []


def test_unknown_key_is_refused_without_retry(producer):
    connector, p = producer
    with pytest.raises(TransferError, match="refused: KV transfer 'nope' is unknown or expired") as info:
        receiver_for(connector, retries=3).pull(p.address, "nope", expected_of(sample_arrays()))
    assert info.value.attempts == 1


@pytest.mark.parametrize("change", ["dtype", "shape", "missing", "extra"])
def test_a_payload_not_as_expected_is_refused_and_stays_held(producer, change):
    import jax

    connector, p = producer
    key = f"m-{change}"
    p.offer(key)
    expected = expected_of(sample_arrays())
    if change == "dtype":  # same bytes per element: only the check tells them apart
        expected["positions"] = jax.ShapeDtypeStruct((7,), np.float32)
    elif change == "shape":
        expected["k_f32"] = jax.ShapeDtypeStruct((3, 2, 4), np.float32)
    elif change == "missing":
        del expected["scalar"]
    else:
        expected["more"] = jax.ShapeDtypeStruct((1,), np.float32)
    receiver = receiver_for(connector, retries=2)
    with pytest.raises(TransferError, match="not what this server expects") as info:
        receiver.pull(p.address, key, expected)
    assert info.value.attempts == 1 and key in p.state()["keys"]
    assert receiver.release(p.address, key) and not receiver.release(p.address, key)
    assert p.state()["held_bytes"] == 0


def test_release_frees_it_and_a_pull_is_then_refused(producer):
    connector, p = producer
    p.offer("r2")
    receiver = receiver_for(connector)
    assert receiver.release(p.address, "r2")
    state = p.state()
    assert state["events"][-1] == ["released", "r2"] and state["held_bytes"] == 0
    with pytest.raises(TransferError, match="unknown or expired"):
        receiver.pull(p.address, "r2", expected_of(sample_arrays()))


def test_a_handle_of_the_other_transport_is_refused(producer):
    connector, p = producer
    other = next(c for c in CONNECTORS if c != connector)
    with pytest.raises(TransferError, match=f"served by a {connector} producer; this server's kv_connector is {other}"):
        receiver_for(other).pull(p.address, "x", {})


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_pull_cut_mid_way_is_retried_once_then_out_of_attempts(connector):
    p = Producer(connector, fault={"fail_after_bytes": 100, "fail_count": 3})
    try:
        arrays, receiver = sample_arrays(), receiver_for(connector, retries=1)
        p.offer("c1")
        with pytest.raises(TransferError, match=r"c1 from 127.0.0.1:\d+ failed after 2 attempt\(s\)") as info:
            receiver.pull(p.address, "c1", expected_of(arrays))  # faults 1 and 2: out of attempts
        assert info.value.attempts == 2 and "c1" in p.state()["keys"]  # held for a later try
        result = receiver.pull(p.address, "c1", expected_of(arrays))  # fault 3, then a whole pull
        assert result.attempts == 2
        assert_same(result.arrays, arrays)
        wait_for(lambda: p.state()["held_bytes"] == 0, what="the ack")
    finally:
        p.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_stalled_producer_times_out_and_a_killed_one_fails_the_pull_at_once(connector):
    p = Producer(connector, fault={"stall_after_bytes": 100})
    try:
        expected, receiver = expected_of(sample_arrays()), receiver_for(connector, timeout_s=1.0, retries=0)
        p.offer("s1")
        started = time.monotonic()
        with pytest.raises(TransferError, match="s1"):
            receiver.pull(p.address, "s1", expected)  # stalls: no progress for 1 s
        assert time.monotonic() - started < 5.0
        receiver = receiver_for(connector, timeout_s=30.0, retries=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(receiver.pull, p.address, "s1", expected)
            time.sleep(1.0)  # stalled mid-pull
            assert not pulling.done()
            p.kill()
            killed = time.monotonic()
            with pytest.raises(TransferError, match=r"failed after 2 attempt\(s\)"):
                pulling.result(timeout=20)
            assert time.monotonic() - killed < 5.0  # the producer's end closed: no wait for timeout_s
    finally:
        p.close()


# -- in-process: the bound, expiry, a consumer gone ----------------------------------------------------
@pytest.fixture(params=CONNECTORS)
def make_sender(request):
    senders = []

    def make(**kwargs):
        kwargs.setdefault("max_bytes", 1 << 20)
        kwargs.setdefault("timeout_s", 30.0)
        sender = TRANSPORTS[request.param][0]("127.0.0.1", 0, sweep_interval_s=0.02, **kwargs)
        senders.append(sender)
        return sender

    make.connector = request.param
    yield make
    for sender in senders:
        sender.close()


def test_reserve_offer_withdraw_and_the_bound(make_sender):
    import jax

    sender = make_sender(max_bytes=1000)
    assert sender.reserve("a", 600) and not sender.reserve("b", 401) and sender.reserve("b", 400)
    assert sender.held_bytes == 1000 and sender.keys() == ["a", "b"]
    with pytest.raises(TransferError, match="reserved or held already"):
        sender.reserve("a", 1)
    with pytest.raises(TransferError, match="not reserved"):
        sender.offer("c", {})
    with pytest.raises(TransferError, match="pass the 400 reserved"):
        sender.offer("b", {"x": np.zeros(101, np.float32)})
    sender.offer("a", {"x": np.zeros(150, np.float32)})
    with pytest.raises(TransferError, match="held already"):
        sender.offer("a", {})
    assert sender.withdraw("b") == 400 and sender.withdraw("b") is None and sender.held_bytes == 600
    if make_sender.connector == "JaxTransferConnector":  # one device per array, or fully replicated
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        sharded = jax.device_put(np.zeros(8, np.float32), split)
        assert sender.reserve("s", 32)
        with pytest.raises(TransferError, match="sharded over 2 devices"):
            sender.offer("s", {"x": sharded})
        assert sender.withdraw("s") == 32
    assert sender.withdraw("a") == 600 and sender.held_bytes == 0 and sender.keys() == []


def test_the_bound_holds_under_16_concurrent_producers_and_pulls(make_sender):
    """16 threads reserve (waiting when refused), offer, and have each payload pulled or withdrawn; the
    held bytes are checked at every step from every thread and a watcher."""
    sender, most = make_sender(max_bytes=4096), 4096
    receiver = receiver_for(make_sender.connector, timeout_s=20.0)
    seen, violations, stop = [], [], threading.Event()

    def check() -> None:
        held = sender.held_bytes
        seen.append(held)
        if held > most:
            violations.append(held)

    def watch() -> None:
        while not stop.is_set():
            check()

    def work(i: int) -> None:
        rng = random.Random(i)
        for j in range(4):
            key, n = f"t{i}-{j}", rng.choice([4, 64, 256])
            while not sender.reserve(key, n * 4):  # a prefill waits for room
                check()
                time.sleep(0.001)
            check()
            arrays = {"x": np.full(n, i, np.float32)}
            future = concurrent.futures.Future()
            sender.offer(key, future if j % 2 else arrays)
            if j % 2:
                future.set_result(arrays)  # a copy that finishes later
            check()
            if rng.random() < 0.7:
                got = receiver.pull(sender.address, key, {"x": ((n,), np.float32)})
                assert np.asarray(got.arrays["x"]).tolist() == [i] * n
            else:
                assert sender.withdraw(key) == n * 4
            check()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(work, i) for i in range(16)]:
            f.result(timeout=120)
    wait_for(lambda: sender.held_bytes == 0, what="the last acks")
    stop.set()
    watcher.join(5)
    assert not violations and max(seen) > most // 2 and sender.keys() == []


def test_an_offered_payload_expires_a_reservation_never(make_sender):
    expired, done = [], threading.Event()
    sender = make_sender(timeout_s=0.2, on_expired=lambda keys: (expired.extend(keys), done.set()))
    assert sender.reserve("kept", 8) and sender.reserve("gone", 8)
    sender.offer("gone", {"x": np.zeros(2, np.float32)})
    assert done.wait(5) and expired == ["gone"]
    time.sleep(0.3)
    assert sender.keys() == ["kept"] and sender.held_bytes == 8  # its prefill still runs
    with pytest.raises(TransferError, match="unknown or expired"):
        receiver_for(make_sender.connector).pull(sender.address, "gone", {"x": ((2,), np.float32)})
    assert sender.withdraw("kept") == 8 and sender.held_bytes == 0


def test_a_consumer_gone_mid_pull_leaves_it_held_until_it_expires(make_sender):
    """The decode server dies after the producer began sending (no ack): the payload stays for a retry,
    then expires; nothing stays referenced."""
    import jax

    from dcpjax.kv_transfer.transport import jax_transfer

    expired = []
    sender = make_sender(timeout_s=1.0, on_expired=expired.extend)
    arrays = {"x": np.arange(1024, dtype=np.float32)}
    assert sender.reserve("g", 4096)
    sender.offer("g", arrays)
    address = sender.address
    with socket.create_connection((address["host"], address["port"]), timeout=5) as sock:
        if make_sender.connector == "SocketConnector":
            wire.send_message(sock, {"op": "pull", "key": "g"})
            sock.recv(64)  # the payload is on its way; then the consumer is gone
        else:
            sender.register_timeout_s = 0.3
            wire.send_message(sock, {"op": "jax_pull", "key": "g"})
            wire.receive_message(sock)
            wire.send_message(sock, {"op": "go", "key": "g"})
            uuid = wire.receive_message(sock)[0]["uuid"]  # offered to jax; the consumer never pulls it
    time.sleep(0.2)
    assert sender.keys() == ["g"]  # no ack: held for a retry
    wait_for(lambda: expired == ["g"], what="the expiry")
    assert sender.held_bytes == 0 and sender.keys() == []
    if make_sender.connector == "JaxTransferConnector":  # jax's table let go of it too: a pull of it fails
        receiver = receiver_for(make_sender.connector)
        connection = receiver._transfer_server().connect(jax_transfer._join(address["host"], address["transfer_port"]))
        spec = jax.ShapeDtypeStruct((1024,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        out = connection.pull(uuid, [spec], timeout=jax_transfer._deadline(0.1))
        wait_for(lambda: out[0].is_ready(), what="the expired pull's failure")  # the sweeper's poke fails it
        with pytest.raises(Exception, match="Pull expired"):
            np.asarray(out[0])


def test_the_registry_refuses_unknown_names_naming_those_there_are():
    assert set(NAMES) == set(CONNECTORS) and set(TRANSPORTS) == set(CONNECTORS)
    sender, receiver = TRANSPORTS["SocketConnector"]
    assert sender.name == receiver.name == "SocketConnector" and not sender.device_arrays
    sender, receiver = TRANSPORTS["JaxTransferConnector"]
    assert sender.name == receiver.name == "JaxTransferConnector" and sender.device_arrays
    for bad in ["NixlConnector", None]:
        with pytest.raises(ValueError, match="JaxTransferConnector.*SocketConnector") as info:
            TRANSPORTS[bad]
        assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownConnector)


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
