"""Wrong arguments fail at once with a message naming the argument; endpoints resolve as
documented (tcp random ports, the environment variable, a 0700 runtime directory); a batch
that cannot be shared stops the producer with a reason its consumers are told."""

from __future__ import annotations

import os
import stat
import threading
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Producer, ProducerLost
from tensorsocket.cli.query import query_status
from tensorsocket.endpoint import ENV, beyond_this_machine, resolve, runtime_dir
from tensorsocket.sharding import open_epoch
from tensorsocket.transport.gpu_topology import GpuPathError
from tests.support import NestedLoader, expected_batch, join_or_fail, same, serving


def read_all(consumer: Consumer, epochs: int, batches: int) -> list[tuple[int, int]]:
    """Iterate ``epochs`` epochs, checking each batch bit for bit; return (epoch, index) seen."""
    seen = []
    for epoch in range(epochs):
        for index, batch in enumerate(consumer):
            assert same(batch, expected_batch(index, batches)), (epoch, index)
            seen.append((epoch, index))
            del batch
    assert sum(1 for _ in consumer) == 0 and consumer.finished
    return seen


class Serving:
    """Run ``producer.serve(epochs)`` in a thread; ``result()`` joins it and re-raises."""

    def __init__(self, producer: Producer, epochs: int) -> None:
        self.producer, self.error = producer, None
        self.thread = threading.Thread(target=self._run, args=(epochs,), name="serve")
        self.thread.start()

    def _run(self, epochs: int) -> None:
        try:
            self.producer.serve(epochs=epochs)
        except BaseException as exc:
            self.error = exc

    def result(self) -> None:
        join_or_fail(self.thread)
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------- Producer arguments


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"slots": 0}, ValueError, ["slots"]),
        ({"slots": -3}, ValueError, ["slots"]),
        ({"slots": "8"}, ValueError, ["slots"]),
        ({"slots": 2.0}, ValueError, ["slots"]),
        ({"min_consumers": 0}, ValueError, ["min_consumers"]),
        ({"min_consumers": "1"}, ValueError, ["min_consumers"]),
        ({"linger": -1}, ValueError, ["linger"]),
        ({"device": "tpu"}, ValueError, ["device", "tpu"]),
        ({"device": "cuda:x"}, ValueError, ["device", "cuda:x"]),
        ({"device": 3.5}, ValueError, ["device"]),
        ({"device": "cpu:1"}, ValueError, ["device", "cpu:1"]),
        ({"replay": -1}, ValueError, ["replay"]),
        ({"replay": 1.5}, ValueError, ["replay"]),
        ({"replay": "1G"}, ValueError, ["replay"]),
        ({"grace": -1}, ValueError, ["grace"]),
        ({"grace": "5"}, ValueError, ["grace"]),
        ({"grace": float("nan")}, ValueError, ["grace"]),  # (would never end)
        ({"grace": float("inf")}, ValueError, ["grace"]),
        ({"linger": float("inf")}, ValueError, ["linger"]),
        ({"linger": True}, ValueError, ["linger"]),
        ({"stragglers": "drop"}, ValueError, ["stragglers", "drop"]),
        ({"max_lag": 2}, ValueError, ["max_lag", "skip"]),
        ({"stragglers": "skip", "max_lag": 8}, ValueError, ["max_lag", "slots"]),
        ({"stragglers": "skip", "max_lag": 0}, ValueError, ["max_lag"]),
        ({"stragglers": "skip", "max_lag": 1.5}, ValueError, ["max_lag"]),
        ({"stragglers": "skip", "slots": 1}, ValueError, ["skip", "slots"]),
    ],
)
def test_producer_rejects_bad_options(name, kwargs, exc, words):
    with pytest.raises(exc) as info:
        Producer(NestedLoader(2), name=name, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert not (runtime_dir() / f"{name}.sock.lock").exists()  # refused: the name is not left locked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_producer_on_cuda_without_a_gpu_says_what_to_do(name, monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    with pytest.raises(GpuPathError) as info:
        Producer(NestedLoader(2), name=name, device="cuda:0")
    assert "device='cpu'" in str(info.value) and "TENSORSOCKET_FAKE_CUDA" in str(info.value)
    Producer(NestedLoader(2), name=name).close()  # nothing was left behind: the name is free


def test_producer_on_a_gpu_it_cannot_see_fails_at_construction(name, monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    with pytest.raises(ValueError, match=r"cuda:7.*sees \d GPU"):
        Producer(NestedLoader(2), name=name, device="cuda:7")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_gpu_consumer_without_a_gpu_fails_at_construction(name, monkeypatch):
    """Before: the Consumer was made and counted in (it met min_consumers), then its I/O
    thread failed to copy the first host batch to the GPU, and the consumer raised
    ProducerLost, blaming a producer that was fine."""
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    producer = Producer(NestedLoader(2), name=name, replay=0)
    with serving(producer, epochs=1):
        with pytest.raises(
            GpuPathError, match=r"Consumer\(device='cuda:0'\) needs a CUDA GPU: .*device='cpu'"
        ):
            Consumer(name=name, device="cuda:0")
        assert producer.status()["consumers"] == []  # it never joined
        with Consumer(name=name) as consumer:  # the stream goes on for one that can read it
            assert len(list(consumer)) == 2


def test_a_consumer_on_a_gpu_it_cannot_see_fails_at_construction(monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    with pytest.raises(GpuPathError, match=r"Consumer\(device='cuda:7'\) but this process sees \d GPU\(s\)"):
        Consumer(name="nobody-serves-this", device="cuda:7")


def test_producer_rejects_a_one_shot_generator_and_suggests_the_function(name):
    def batches():
        yield from range(3)

    with pytest.raises(TypeError, match="generator function"):
        Producer(batches(), name=name)
    with pytest.raises(TypeError, match="iterator"):
        Producer(iter([1, 2, 3]), name=name)


@pytest.mark.parametrize("loader", [42, None, object()])
def test_producer_rejects_a_loader_that_is_not_iterable(name, loader):
    with pytest.raises(TypeError, match="loader"):
        Producer(loader, name=name)


def test_a_loader_function_that_cannot_be_called_without_arguments_fails_at_construction(name):
    """It is called with no arguments once per epoch; before, the first epoch failed with the
    TypeError alone, as the consumers' ProducerLost, not naming the loader."""
    with pytest.raises(TypeError, match=r"loader .*<lambda>.* no arguments .*'epoch'"):
        Producer(lambda epoch: [1], name=name)
    with pytest.raises(TypeError, match=r"loader DataLoader .*'dataset'"):
        Producer(torch.utils.data.DataLoader, name=name)
    with pytest.raises(TypeError, match=r"<lambda> returned a value of type int, not an iterable"):
        open_epoch(lambda: 5, 0)
    assert list(open_epoch(lambda: [1, 2], 0)) == [1, 2]


@pytest.mark.parametrize(
    "where, words",
    [
        ({"name": "a/b"}, ["name"]),
        ({"name": "../escape"}, ["name"]),
        ({"name": ""}, ["name"]),
        ({"name": "x" * 65}, ["name"]),
        ({"name": "sweep", "endpoint": "ipc:///tmp/x.sock"}, ["name", "endpoint"]),
        ({"endpoint": "http://x"}, ["http://x"]),
        ({"endpoint": "tcp://127.0.0.1:notaport"}, ["notaport"]),
        ({"endpoint": "tcp://127.0.0.1:70000"}, ["70000"]),
        ({"endpoint": "tcp://127.0.0.1"}, ["tcp://127.0.0.1"]),
        ({"endpoint": "ipc://"}, ["ipc"]),
        ({"endpoint": 5555}, ["endpoint"]),
    ],
)
def test_bad_names_and_endpoints_are_refused_by_both_sides(where, words):
    for make in (lambda: Producer(NestedLoader(2), **where), lambda: Consumer(**where)):
        with pytest.raises(ValueError) as info:
            make()
        assert all(w in str(info.value) for w in words), str(info.value)


# ---------------------------------------------------------------------- Consumer arguments


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"timeout": 0}, ["timeout"]),
        ({"timeout": -1}, ["timeout"]),
        ({"timeout": "x"}, ["timeout"]),
        ({"timeout": float("nan")}, ["timeout"]),
        ({"prefetch": 0}, ["prefetch"]),
        ({"prefetch": "2"}, ["prefetch"]),
        ({"copy": "yes"}, ["copy"]),
        ({"copy": 1}, ["copy"]),
        ({"device": "nonsense"}, ["device", "nonsense"]),
        ({"device": "cpu:1"}, ["device", "cpu:1"]),
        ({"label": "x" * 200}, ["label"]),
        ({"label": "\udcff"}, ["label"]),  # (a lone surrogate: msgpack cannot encode it)
        ({"timeout": True}, ["timeout"]),
        ({"reconnect": float("nan")}, ["reconnect"]),
        ({"batch_size": 0}, ["batch_size"]),
        ({"batch_size": True}, ["batch_size"]),
        ({"batch_size": "32"}, ["batch_size"]),
        ({"batch_size": 32, "drop_last": "yes"}, ["drop_last"]),
        ({"drop_last": True}, ["drop_last", "batch_size"]),
        ({"late_join": "later"}, ["late_join", "later", "next_epoch"]),
        ({"late_join": None}, ["late_join"]),
    ],
)
def test_consumer_rejects_bad_options_before_connecting(name, kwargs, words):
    with pytest.raises(ValueError) as info:
        Consumer(name=name, **kwargs)  # no producer: a bad option must not wait for one
    assert all(w in str(info.value) for w in words), str(info.value)


def test_consumer_without_a_producer_gives_up_within_its_timeout(name):
    with pytest.raises(ProducerLost, match=name):
        Consumer(name=name, timeout=0.2)


# ---------------------------------------------------------------------- serve() and batches


@pytest.mark.parametrize("epochs", [-1, 1.5, "2", True])
def test_serve_rejects_bad_epochs(name, epochs):
    with Producer(NestedLoader(2), name=name) as producer:
        with pytest.raises(ValueError, match="epochs"):
            producer.serve(epochs=epochs)


class _Unshareable:
    """Batch 0 is fine; batch 1 has a set and an object() deep inside."""

    def __init__(self, leaf: Any) -> None:
        self.leaf = leaf

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        yield expected_batch(0, 3)
        yield (expected_batch(1, 3)[0], {"ok": 1, "bad": [0, self.leaf]})
        yield expected_batch(2, 3)


@pytest.mark.parametrize("leaf, type_name", [({1, 2}, "set"), (object(), "object")])
def test_unshareable_leaf_stops_the_producer_and_tells_the_consumer_why(name, leaf, type_name):
    producer = Producer(_Unshareable(leaf), name=name, slots=2)
    consumer = None
    report: dict[str, Any] = {"seen": 0, "error": None}
    thread = None
    try:
        consumer = Consumer(name=name, timeout=10)

        def consume() -> None:
            try:
                for batch in consumer:
                    assert same(batch, expected_batch(report["seen"], 3))
                    report["seen"] += 1
                    del batch
            except Exception as exc:
                report["error"] = exc

        thread = threading.Thread(target=consume, name="consume")
        thread.start()
        path = "batch[1]['bad'][1]"
        with pytest.raises(TypeError) as info:
            producer.serve(epochs=2)
        assert path in str(info.value) and type_name in str(info.value)
        join_or_fail(thread)
        assert report["seen"] == 1
        error = report["error"]
        assert isinstance(error, ProducerLost), repr(error)
        assert "TypeError" in str(error) and path in str(error) and type_name in str(error)
    finally:
        if consumer is not None:
            consumer.close()
        producer.close()
        if thread is not None:
            thread.join(10)


def test_unshareable_leaf_raises_from_the_producer_loop_too(name):
    with Producer(_Unshareable({1}), name=name) as producer:
        consumer = Consumer(name=name, timeout=10)
        try:
            epoch = iter(producer)
            next(epoch)
            with pytest.raises(TypeError, match=r"batch\[1\]\['bad'\]\[1\] is a set"):
                next(epoch)
        finally:
            consumer.close()


# ---------------------------------------------------------------------- endpoints


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:*", "tcp://:*", "tcp://127.0.0.1:0"])
def test_tcp_random_port_is_reported_and_reachable(endpoint):
    batches = 3
    with Producer(NestedLoader(batches), endpoint=endpoint) as producer:
        host, _, port = producer.endpoint[len("tcp://") :].rpartition(":")
        assert host == "127.0.0.1" and port.isdigit() and 0 < int(port) < 65536
        consumer = Consumer(endpoint=producer.endpoint, timeout=10)
        try:
            serving = Serving(producer, epochs=2)
            assert read_all(consumer, 2, batches) == [(e, i) for e in range(2) for i in range(batches)]
            serving.result()
        finally:
            consumer.close()


def test_an_ipv6_loopback_endpoint_is_served():
    """ZeroMQ binds and connects to an IPv6 address only with its IPV6 option set: before, the
    producer's constructor failed ("No such device")."""
    batches = 3
    with Producer(NestedLoader(batches), endpoint="tcp://[::1]:*") as producer:
        assert producer.endpoint.startswith("tcp://[::1]:")
        consumer = Consumer(endpoint=producer.endpoint, timeout=10)
        try:
            assert query_status(producer.endpoint, timeout=10)["endpoint"] == producer.endpoint
            serving = Serving(producer, epochs=1)
            assert read_all(consumer, 1, batches) == [(0, i) for i in range(batches)]
            serving.result()
        finally:
            consumer.close()


@pytest.mark.parametrize(
    "endpoint, beyond",
    [
        ("tcp://127.0.0.1:5555", False), ("tcp://127.3.2.1:5555", False), ("tcp://localhost:*", False),
        ("tcp://[::1]:5555", False), ("ipc:///tmp/x.sock", False), ("tcp://*:5555", True),
        ("tcp://0.0.0.0:5555", True), ("tcp://[::]:5555", True), ("tcp://10.0.0.7:*", True),
        ("tcp://node3:5555", True), ("tcp://eth0:5555", True),
    ],
)  # fmt: skip
def test_an_endpoint_other_hosts_may_reach_is_told_apart(endpoint, beyond):
    """Which endpoints the producer secures with CURVE keys, and a client connects to with
    them. A test that bound one would listen beyond this machine (tests/test_keys.py binds one in
    a private network namespace), so the rule is tested on its own."""
    assert beyond_this_machine(endpoint) is beyond


def test_environment_variable_names_the_endpoint(name, monkeypatch):
    batches = 2
    monkeypatch.setenv(ENV, resolve(name=name))
    with Producer(NestedLoader(batches), name=name) as producer:
        consumer = Consumer(timeout=10)  # neither name nor endpoint: the environment decides
        try:
            assert consumer.endpoint == producer.endpoint
            assert len(consumer) == batches
            serving = Serving(producer, epochs=1)
            assert read_all(consumer, 1, batches) == [(0, 0), (0, 1)]
            serving.result()
        finally:
            consumer.close()


def test_explicit_name_wins_over_the_environment(name, monkeypatch):
    monkeypatch.setenv(ENV, "tcp://127.0.0.1:1")
    assert resolve(name=name) == f"ipc://{runtime_dir() / name}.sock"
    assert resolve() == "tcp://127.0.0.1:1"
    monkeypatch.delenv(ENV)
    assert resolve() == resolve(name="default")


def test_environment_variable_may_hold_a_name(name, monkeypatch):
    monkeypatch.setenv(ENV, name)  # a name, as `--name` takes: "default: $TENSORSOCKET_ENDPOINT"
    assert resolve() == resolve(name=name)


@pytest.mark.parametrize("value", ["bad/name", "udp://127.0.0.1:1", "tcp://127.0.0.1:x"])
def test_a_bad_environment_variable_is_named_in_the_error(value, monkeypatch):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"^\${ENV}="):
        resolve()


def test_runtime_directory_is_private():
    path = runtime_dir()
    st = os.stat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()


def test_runtime_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    fresh = runtime_dir()
    assert fresh == tmp_path / "tensorsocket"
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    os.chmod(fresh, 0o755)
    with pytest.raises(PermissionError, match="0700"):
        runtime_dir()
    with pytest.raises(PermissionError):
        Producer(NestedLoader(2), name="shared-dir")


def test_a_prefetch_beyond_what_a_hello_carries_is_capped_like_any_above_slots(name):
    """The README: prefetch's maximum is the producer's slots. Before, one above 65536 passed
    construction and the producer refused the HELLO as malformed."""
    with Producer(NestedLoader(3), name=name, slots=2) as producer, serving(producer, epochs=1):
        with Consumer(name=name, prefetch=100_000, timeout=10) as consumer:
            assert [batch[1]["meta"][2] for batch in consumer] == [0, 1, 2]
