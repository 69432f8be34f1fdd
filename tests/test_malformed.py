"""Hostile and malformed traffic on both sides of the wire: the producer answers it with
ERROR / EVICTED and keeps serving a real consumer bit for bit; a consumer fed a bad BATCH
by a fake producer raises ProtocolError instead of crashing or hanging."""

from __future__ import annotations

import functools
import os
import random
import threading
import time
import uuid
from typing import Any

import msgpack
import pytest
import torch
import zmq

from tensorsocket import Consumer, Producer, ProducerLost, ProtocolError, layout_table, protocol
from tensorsocket.endpoint import resolve
from tensorsocket.host import boot_id, pid_namespace
from tensorsocket.producer.sessions import QUEUE_PER_PEER
from tensorsocket.protocol import Kind
from tests.support import NestedLoader, expected_batch, join_or_fail, same, serving, wait_until

EPOCHS = 2


# ---------------------------------------------------------------------- raw peers


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    sock.connect(endpoint)
    return sock


def hello(**override: Any) -> dict[str, Any]:
    fields = {
        "version": protocol.VERSION,
        "pid": os.getpid(),
        "boot_id": boot_id(),
        "pidns": pid_namespace(),
        "label": "raw",
        "prefetch": 1,
        "timeout": 30.0,
        "late_join": "replay",
        "batch_size": None,
        "device": "cpu",
        "group": None,
        "resume": None,
        "check_writes": False,
    }
    fields.update(override)
    return fields


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def receive(sock: zmq.Socket, kinds: set[Kind], timeout: float = 2.0) -> tuple[Kind, dict[str, Any]]:
    """The next message of one of ``kinds`` (others, e.g. HEARTBEAT or BATCH, are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1):
            raise AssertionError(f"no {sorted(k.value for k in kinds)} reply within {timeout} s")
        kind, msg = protocol.decode(sock.recv(), protocol.MAX_REPLY_BYTES)
        if kind in kinds:
            return kind, msg


def drain(sock: zmq.Socket, quiet: float = 0.2) -> list[Kind]:
    """Read until nothing arrives for ``quiet`` seconds; return the kinds read."""
    kinds = []
    while sock.poll(int(quiet * 1000)):
        kinds.append(protocol.decode(sock.recv(), protocol.MAX_REPLY_BYTES)[0])
    return kinds


def expect_error(sock: zmq.Socket, frames: bytes | list[bytes]) -> str:
    sock.send_multipart(frames if isinstance(frames, list) else [frames])
    kind, msg = receive(sock, {Kind.ERROR, Kind.EVICTED, Kind.WELCOME})
    assert kind is Kind.ERROR, (kind, msg, repr(frames)[:200])
    return msg["reason"]


def alive(endpoint: str) -> bool:
    """The producer answers a STATUS request from a fresh peer."""
    sock = dealer(endpoint)
    try:
        sock.send(protocol.encode(Kind.STATUS, status=None))
        _, msg = receive(sock, {Kind.STATUS})
        return msg["status"]["endpoint"] == endpoint
    finally:
        sock.close(0)


def hostile_frames(seed: int = 20240917) -> list[bytes | list[bytes]]:
    """Frames (or multi-frame messages) that must each get an ERROR reply."""
    rng = random.Random(seed)
    frames: list[bytes | list[bytes]] = [rng.randbytes(rng.randrange(0, 200)) for _ in range(150)]
    # Structured garbage: valid msgpack that is not a valid message.
    frames += [
        b"",
        pack(None),
        pack(7),
        pack("hello"),
        pack(b"\x00" * 10),
        pack([1, 2, 3]),
        pack(["k", "hello"]),
        pack({}),
        pack({"k": "nonsense"}),
        pack({"k": 17}),
        pack({"k": ["hello"]}),
        pack({"k": None}),
        pack({b"k": "hello"}),
        pack({"k": "hello", 1: 2}),
        b"\x81\xa1k\xc6\xff\xff\xff\xff",  # map whose bin value claims 4 GiB
        b"\x81\xa1k\xdb\xff\xff\xff\xff",  # ... a str claiming 4 GiB
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 G elements
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4 G pairs
        b"\x91" * 5000 + b"\xc0",  # arrays nested 5000 deep
        b"\x81\xa1k\xa5hel\xfflo",  # invalid UTF-8 in a str
        pack({"k": "hello"}),  # no fields at all
        pack({"k": "hello", **hello(), "extra": 1}),
        pack({"k": "hello", **hello(version=protocol.VERSION + 98)}),  # version checked below too
        pack({"k": "hello", **hello(version="1")}),
        pack({"k": "hello", **hello(version=True)}),
        pack({"k": "hello", **hello(version=1.0)}),
        pack({"k": "hello", **hello(pid="123")}),
        pack({"k": "hello", **hello(pid=-1)}),
        pack({"k": "hello", **hello(pid=2**40)}),
        pack({"k": "hello", **hello(boot_id=None)}),
        pack({"k": "hello", **hello(boot_id="x" * 1000)}),
        pack({"k": "hello", **hello(pidns=[1])}),
        pack({"k": "hello", **hello(label=b"raw")}),
        pack({"k": "hello", **hello(prefetch=0)}),
        pack({"k": "hello", **hello(prefetch=2**20)}),
        pack({"k": "hello", **hello(timeout=0)}),
        pack({"k": "hello", **hello(timeout=float("nan"))}),
        pack({"k": "hello", **hello(timeout=float("inf"))}),
        pack({"k": "hello", **hello(timeout="10")}),
        pack({"k": "hello", **hello(boot_id="another-host")}),  # well-formed, but remote
        pack({"k": "release"}),
        pack({"k": "release", "seqs": 3}),
        pack({"k": "release", "seqs": [-1]}),
        pack({"k": "release", "seqs": [1.5]}),
        pack({"k": "release", "seqs": list(range(5000))}),
        pack({"k": "heartbeat", "x": 1}),
        pack({"k": "modified", "seq": -1, "epoch": 0, "index": 0}),
        pack({"k": "status", "status": 5}),
        # multi-frame messages
        [pack({"k": "heartbeat"}), pack({"k": "heartbeat"})],
        [b"", pack({"k": "hello", **hello()})],
        [b"a", b"b", b"c"],
    ]
    return frames


# ---------------------------------------------------------------------- the producer side


def test_hostile_traffic_is_answered_and_a_real_consumer_is_served_exactly(name):
    batches = 6
    producer = Producer(NestedLoader(batches), name=name, slots=3, min_consumers=1)
    sockets: list[zmq.Socket] = []
    threads: list[threading.Thread] = []
    consumer = None
    traffic_done = threading.Event()
    first_batch = threading.Event()
    report: dict[str, Any] = {"seen": [], "bad": [], "error": None}
    served: dict[str, Any] = {}
    try:
        consumer = Consumer(name=name, timeout=10)

        def consume() -> None:
            try:
                for epoch in range(EPOCHS):
                    index = 0
                    for batch in consumer:
                        if not same(batch, expected_batch(index, batches)):
                            report["bad"].append((epoch, index))
                        report["seen"].append((epoch, index))
                        del batch
                        if not first_batch.is_set():
                            first_batch.set()  # hold the stream here while the hostile traffic runs
                            traffic_done.wait(30)
                        index += 1
                report["after_end"] = sum(1 for _ in consumer)
                report["finished"] = consumer.finished
            except Exception as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                first_batch.set()

        def serve() -> None:
            try:
                producer.serve(epochs=EPOCHS)
                served["ok"] = True
            except BaseException as exc:
                served["error"] = exc

        threads = [
            threading.Thread(target=consume, name="consume"),
            threading.Thread(target=serve, name="serve"),
        ]
        for t in threads:
            t.start()
        assert first_batch.wait(20)
        assert report["error"] is None, report["error"]

        def new_socket() -> zmq.Socket:
            sockets.append(dealer(producer.endpoint))
            return sockets[-1]

        # Random bytes, non-maps, unknown kinds, bad fields, multi-frame: one ERROR each.
        raw = new_socket()
        expected_bad = 0
        for frames in hostile_frames():
            expect_error(raw, frames)
            expected_bad += 1

        # A wrong protocol version is refused, and the reason says which versions.
        reason = expect_error(raw, protocol.encode(Kind.HELLO, **hello(version=protocol.VERSION + 1)))
        expected_bad += 1
        assert (
            "protocol" in reason and str(protocol.VERSION + 1) in reason and str(protocol.VERSION) in reason
        )

        # A consumer-bound message kind from a peer that is not a consumer: treated as a stranger.
        for frame in (
            protocol.encode(Kind.RELEASE, seqs=[0, 1, 2]),
            protocol.encode(Kind.HEARTBEAT),
            protocol.encode(Kind.MODIFIED, seq=0, epoch=0, index=0),
        ):
            stranger = new_socket()
            stranger.send(frame)
            kind, msg = receive(stranger, {Kind.ERROR, Kind.EVICTED})
            assert kind is Kind.EVICTED and "never joined" in msg["reason"]

        # A joined raw peer: releasing seqs it never held, or its HELLO again (a consumer sends
        # it at each handshake: one queued across a reconnect arrives twice), is ignored (no
        # reply, still joined); a HELLO naming another pid or a producer-only kind is an error.
        joined = new_socket()
        joined.send(protocol.encode(Kind.HELLO, **hello(label="raw-joined")))
        receive(joined, {Kind.WELCOME})
        joined.send(protocol.encode(Kind.RELEASE, seqs=[10**9, 2**63 - 1, 0, 0]))
        joined.send(protocol.encode(Kind.RELEASE, seqs=[]))
        joined.send(protocol.encode(Kind.HEARTBEAT))
        joined.send(protocol.encode(Kind.HELLO, **hello(label="raw-joined")))
        assert not {Kind.ERROR, Kind.EVICTED} & set(drain(joined, 0.3))
        assert "raw-joined" in [c["label"] for c in producer.status()["consumers"]]
        for frame in (
            protocol.encode(Kind.HELLO, **hello(label="raw-joined", pid=os.getpid() + 1)),
            protocol.encode(Kind.EPOCH_END, seq=0, epoch=0),
            protocol.encode(Kind.END, seq=0, epoch=0, reason=None),
            protocol.encode(Kind.ERROR, reason="from a consumer"),
            # (a consumer reports a changed batch before it releases it: one it does not hold is
            # a peer's mistake, not an ERROR line in the producer's log blaming it for every one)
            protocol.encode(Kind.MODIFIED, seq=2**63 - 1, epoch=0, index=0),
        ):
            expect_error(joined, frame)
            expected_bad += 1
        joined.send(protocol.encode(Kind.BYE, epoch_done=None))

        # A frame over MAX_REQUEST_BYTES: zmq drops that connection; the producer stays up.
        big = new_socket()
        big.send(b"\x00" * (protocol.MAX_REQUEST_BYTES + 1))
        big.send(pack({"k": "status", "status": None}) + b"\x00" * (protocol.MAX_REQUEST_BYTES * 4))
        time.sleep(0.2)
        assert alive(producer.endpoint)

        status = producer.status()
        assert status["bad_messages"] == expected_bad
        wait_until(
            lambda: [c["label"] for c in producer.status()["consumers"]] == [consumer.label],
            3,
            lambda: f"the raw peers to be gone; consumers: {producer.status()['consumers']}",
        )
        traffic_done.set()

        for t in threads:
            join_or_fail(t)
        assert served == {"ok": True}, served
        assert report["error"] is None, report["error"]
        assert report["bad"] == []
        assert report["seen"] == [(e, i) for e in range(EPOCHS) for i in range(batches)]
        assert report["after_end"] == 0 and report["finished"] is True
    finally:
        traffic_done.set()
        for s in sockets:
            s.close(0)
        if consumer is not None:
            consumer.close()
        producer.close()
        for t in threads:
            t.join(10)


def test_silent_raw_peer_is_evicted_and_told_so_when_it_returns(name):
    with Producer(NestedLoader(3), name=name) as producer:
        sock = dealer(producer.endpoint)
        try:
            sock.send(protocol.encode(Kind.HELLO, **hello(label="silent", timeout=1.0)))
            receive(sock, {Kind.WELCOME})
            assert [c["label"] for c in producer.status()["consumers"]] == ["silent"]
            wait_until(lambda: not producer.status()["consumers"], 5, "the silent peer to be evicted")
            kind, msg = receive(sock, {Kind.EVICTED})  # told when it was dropped
            assert "after 1 s without a message" in msg["reason"]
            drain(sock)
            sock.send(protocol.encode(Kind.HEARTBEAT))
            kind, msg = receive(sock, {Kind.ERROR, Kind.EVICTED})
            assert kind is Kind.EVICTED
            assert producer.status()["consumers"] == []
        finally:
            sock.close(0)


# ---------------------------------------------------------------------- the consumer side


class FakeProducer:
    """A raw ROUTER on ``name``'s endpoint: answers the first HELLO with a valid WELCOME
    announcing ``arenas`` (and numbered ``layouts``), then sends ``frames``. Afterwards it records the kinds the
    consumer sends (``received``) and answers each kind in ``replies`` with that frame."""

    def __init__(
        self,
        name: str,
        arenas: list[list[Any]],
        frames: list[bytes],
        replies: dict[Kind, bytes] | None = None,
        layouts: list[list[Any]] = (),  # type: ignore[assignment]
    ) -> None:
        self.endpoint = resolve(name=name)
        self.layouts = list(layouts)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoint)
        self.arenas, self.frames, self.replies = arenas, frames, replies or {}
        self.received: list[Kind] = []
        self.replied = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fake-producer")
        self.thread.start()

    def _run(self) -> None:
        try:
            if not self.socket.poll(10_000):
                return
            cid, frame = self.socket.recv_multipart()
            assert protocol.decode(frame)[0] is Kind.HELLO
            welcome = protocol.encode(
                Kind.WELCOME,
                pid=os.getpid(),
                boot_id=boot_id(),
                pidns=pid_namespace(),
                batches=1,
                samples=None,
                slots=1,
                stragglers="stall",
                transport="shm",
                gpu=None,
                arenas=self.arenas,
                heartbeat=0.1,
                stream="fake",
                restarted=None,
                layouts=self.layouts,
                session=None,  # (a fake producer speaks ZeroMQ only: consumers stay on it)
                starts_with=None,
            )
            protocol.decode(welcome, protocol.MAX_REPLY_BYTES)  # our WELCOME itself is valid
            self.socket.send_multipart([cid, welcome])
            for frame in self.frames:
                self.socket.send_multipart([cid, frame])
            deadline = time.monotonic() + 10
            while not self.stop.is_set() and time.monotonic() < deadline:
                if not self.socket.poll(20):
                    continue
                cid, frame = self.socket.recv_multipart()
                kind = protocol.decode(frame)[0]
                self.received.append(kind)
                if kind in self.replies:
                    self.socket.send_multipart([cid, self.replies[kind]])
                    self.replied.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.socket.close(0)

    def close(self) -> None:
        self.stop.set()
        join_or_fail(self.thread, 15)
        assert self.error is None, self.error


@pytest.fixture
def segment():
    """A real 4096-byte shared-memory segment, named like a producer's; unlinked after."""
    name = f"tensorsocket-{os.getuid()}-{os.getpid()}-fake{uuid.uuid4().hex[:6]}-0-1"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"\x00" * 4096)
    yield name
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def batch(layout: Any, slot: int = 0, **override: Any) -> bytes:
    fields = {"seq": 0, "epoch": 0, "index": 0, "place": slot, "layout": layout, "fingerprint": None}
    fields.update(override)
    return protocol.encode(Kind.BATCH, **fields)


def tensor_layout(
    dtype: str = "float32", shape: Any = (4,), offset: Any = 0, size: Any = 16, nbytes: Any = None
) -> list[Any]:
    return [["t", 0], [[dtype, list(shape), offset, size]], size if nbytes is None else nbytes]


def consume_one(name: str) -> Any:
    consumer = Consumer(name=name, timeout=2)
    try:
        return next(iter(consumer))
    finally:
        consumer.close()


def test_batch_in_an_unannounced_slot_raises_protocol_error(name):
    fake = FakeProducer(name, arenas=[], frames=[batch(tensor_layout())])
    try:
        with pytest.raises(ProtocolError):
            consume_one(name)
    finally:
        fake.close()


@pytest.mark.parametrize("compact", [False, True], ids=["inline", "compact"])
def test_batch_naming_a_place_never_announced_says_which(name, segment, compact):
    """The error names the place and that it was never announced (it said only "500": the
    reader's KeyError, for a compact BATCH, the usual form)."""
    frames = [batch(tensor_layout(), slot=500)]
    if compact:
        frames = [
            protocol.encode(Kind.LAYOUT, number=0, layout=tensor_layout()),
            protocol.encode_batch(0, 0, 0, 500, 0, None),
        ]
    fake = FakeProducer(name, arenas=[["shm", 0, segment, 4096]], frames=frames)
    try:
        with pytest.raises(ProtocolError, match="place 500.*never announced"):
            consume_one(name)
    finally:
        fake.close()


BAD_LAYOUTS = {
    "not a list": "garbage",
    "short": [1, 2],
    "none": None,
    "nbytes past the arena": tensor_layout(shape=[2048], size=8192),
    "leaf past nbytes": tensor_layout(offset=4096, size=16, nbytes=4096),
    "leaf past the arena": tensor_layout(offset=4096, size=16, nbytes=4112),
    "negative offset": tensor_layout(offset=-256),
    "unaligned offset": tensor_layout(offset=3),
    "size disagrees with shape": tensor_layout(shape=[5]),
    "huge shape": tensor_layout(shape=[2**47, 2**47, 0], size=0),
    "negative dim": tensor_layout(shape=[-4], size=-16),
    "unknown dtype": tensor_layout(dtype="float99"),
    "dtype not a string": tensor_layout(dtype=7),
    "object numpy dtype": [["a", 0], [["|O", [2], 0, 16]], 16],
    "tree points past the leaves": [["t", 3], [["float32", [4], 0, 16]], 16],
    "tree node not a pair": [["t"], [["float32", [4], 0, 16]], 16],
    "unknown tag": [["x", 0], [["float32", [4], 0, 16]], 16],
    "leaf read as two kinds": [["T", [["t", 0], ["a", 0]]], [["<f4", [4], 0, 16]], 16],
    "very deep tree": [functools.reduce(lambda node, _: ["L", [node]], range(200), ["v", None]), [], 0],
    "dict key not str": [["D", [[[1], ["v", 1]]]], [], 0],
    "value of a bad type": [["v", {"a": 1}], [], 0],
    "leaf not a list": [["t", 0], ["float32"], 16],
}


def sent(layout: Any, via: str, segment: str) -> dict[str, Any]:
    """A fake producer's arguments that send ``layout`` with a BATCH: inline, numbered in a
    LAYOUT message before it, or numbered in the WELCOME."""
    arenas = [["shm", 0, segment, 4096]]
    if via == "inline":
        return {"arenas": arenas, "frames": [batch(layout)]}
    if via == "LAYOUT":
        return {"arenas": arenas, "frames": [protocol.encode(Kind.LAYOUT, number=5, layout=layout), batch(5)]}
    return {"arenas": arenas, "frames": [batch(5)], "layouts": [[5, layout]]}


LAYOUT_VIAS = ["inline", "LAYOUT", "WELCOME"]


@pytest.mark.parametrize("via", LAYOUT_VIAS)
def test_fake_producer_with_a_good_layout_is_served(name, segment, via):
    """The control case: the same fake producer with a valid layout yields the batch."""
    layout = [["T", [["t", 0], ["v", "x"]]], [["float32", [4], 0, 16]], 16]
    fake = FakeProducer(name, **sent(layout, via, segment))
    try:
        got = consume_one(name)
        assert same(got, (torch.zeros(4), "x"))
    finally:
        fake.close()


@pytest.mark.parametrize("via", LAYOUT_VIAS)
@pytest.mark.parametrize("layout", BAD_LAYOUTS.values(), ids=BAD_LAYOUTS.keys())
def test_garbage_layout_raises_protocol_error(name, segment, layout, via):
    fake = FakeProducer(name, **sent(layout, via, segment))
    try:
        with pytest.raises(ProtocolError):
            consume_one(name)
    finally:
        fake.close()


@pytest.mark.parametrize(
    "frames",
    [
        [batch(0)],  # never announced
        [protocol.encode(Kind.LAYOUT, number=1, layout=tensor_layout()), batch(0)],  # another was
        [batch(True)],  # not a number, not a layout
    ],
    ids=["unannounced", "another number", "bool"],
)
def test_batch_naming_a_layout_not_announced_raises_protocol_error(name, segment, frames):
    fake = FakeProducer(name, arenas=[["shm", 0, segment, 4096]], frames=frames)
    try:
        with pytest.raises(ProtocolError):
            consume_one(name)
    finally:
        fake.close()


def test_more_layouts_than_a_producer_numbers_raise_protocol_error(name, segment):
    layouts = [[n, tensor_layout()] for n in range(layout_table.MAX_LAYOUTS + 1)]
    fake = FakeProducer(name, arenas=[["shm", 0, segment, 4096]], frames=[batch(0)], layouts=layouts)
    try:
        with pytest.raises(ProtocolError, match="more than"):
            consume_one(name)
    finally:
        fake.close()


# A segment that is gone is also what a consumer frozen past its eviction meets, from a
# producer that is not hostile, so ProducerLost is as right as ProtocolError there.
BAD_ARENAS = {
    "announced bigger than the segment": (lambda seg, outside: ["shm", 0, seg, 1 << 20], ProtocolError),
    "segment that does not exist": (
        lambda seg, outside: ["shm", 0, seg + "-gone", 4096],
        (ProtocolError, ProducerLost),
    ),
    "name escaping /dev/shm": (lambda seg, outside: ["shm", 0, "../.." + outside, 4096], ProtocolError),
    "absolute path as name": (lambda seg, outside: ["shm", 0, outside, 4096], ProtocolError),
    "not a tensorsocket segment": (
        lambda seg, outside: ["shm", 0, "some-other-program", 4096],
        ProtocolError,
    ),
}


@pytest.mark.parametrize("via", ["welcome", "arena"])
@pytest.mark.parametrize("arena, error", BAD_ARENAS.values(), ids=BAD_ARENAS.keys())
def test_bad_arena_announcement_raises_protocol_error(name, segment, arena, error, via, tmp_path):
    # A hostile producer must not make the consumer map an arbitrary file of its user.
    outside = tmp_path / "tensorsocket-not-shm"
    outside.write_bytes(b"\x01" * 4096)
    announced = arena(segment, str(outside))
    if via == "welcome":
        fake = FakeProducer(name, arenas=[announced], frames=[batch(tensor_layout())])
    else:
        frames = [protocol.encode(Kind.ARENA, arena=announced), batch(tensor_layout())]
        fake = FakeProducer(name, arenas=[], frames=frames)
    try:
        with pytest.raises(error):
            consume_one(name)
    finally:
        fake.close()


def test_unexpected_kind_from_producer_raises_protocol_error(name):
    fake = FakeProducer(name, arenas=[], frames=[protocol.encode(Kind.HELLO, **hello())])
    try:
        with pytest.raises(ProtocolError):
            consume_one(name)
    finally:
        fake.close()


def test_eviction_reply_to_a_release_after_end_does_not_fail_the_consumer(name, segment):
    """A consumer says BYE when END arrives; batches it still holds are released later, and
    the producer answers those RELEASEs from a stranger with EVICTED. After END no slot is
    reused, so the consumer must finish cleanly, not raise Evicted."""
    frames = [
        batch([["t", 0], [["float32", [4], 0, 16]], 16]),
        protocol.encode(Kind.EPOCH_END, seq=1, epoch=0),
        protocol.encode(Kind.END, seq=2, epoch=1, reason=None),
    ]
    stranger = protocol.encode(Kind.EVICTED, reason="unknown consumer: it was evicted or never joined")
    fake = FakeProducer(
        name, arenas=[["shm", 0, segment, 4096]], frames=frames, replies={Kind.RELEASE: stranger}
    )
    consumer = Consumer(name=name, timeout=5)
    try:
        epoch = iter(consumer)
        held = next(epoch)
        # END seen while we still hold the batch
        wait_until(
            lambda: Kind.BYE in fake.received,
            5,
            lambda: f"our BYE; the fake got {fake.received}",
            interval=0.01,
        )
        assert same(held, torch.zeros(4))
        del held
        assert fake.replied.wait(5)  # our RELEASE drew EVICTED
        time.sleep(0.2)
        assert list(epoch) == []
        assert list(consumer) == [] and consumer.finished
    finally:
        consumer.close()
        fake.close()


@pytest.mark.parametrize("check_writes", [False, True])
def test_batches_carry_a_fingerprint_only_while_a_consumer_checks_writes(name, check_writes):
    """A consumer mapping batches read-only (the default) needs no fingerprint: none is taken."""
    producer = Producer(NestedLoader(3), name=name, slots=2, replay=0)
    with serving(producer, epochs=1):
        sock = dealer(producer.endpoint)
        try:
            sock.send(protocol.encode(Kind.HELLO, **hello(check_writes=check_writes, prefetch=4)))
            receive(sock, {Kind.WELCOME})
            _, msg = receive(sock, {Kind.BATCH}, timeout=10)
            assert (msg["fingerprint"] is not None) is check_writes
            bye = protocol.encode(Kind.BYE, epoch_done=None)
            sock.send(bye)  # (else the stream waits for it: 10 s a case)
        finally:
            sock.close(0)


def test_a_peer_repeating_modified_cannot_flood_the_producers_log(name, caplog):
    """A consumer reports a batch that changed while it held it once, as it lets it go; a peer
    repeating the report for a batch it holds is logged for its first 20 reports and every
    1000th after, saying how many (before: an ERROR line each, naming every holder)."""
    producer = Producer(NestedLoader(3), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (_, errors):
        sock = dealer(producer.endpoint)
        try:
            sock.send(protocol.encode(Kind.HELLO, **hello(label="repeater", check_writes=True)))
            receive(sock, {Kind.WELCOME})
            _, batch = receive(sock, {Kind.BATCH}, timeout=10)
            report = protocol.encode(
                Kind.MODIFIED, seq=batch["seq"], epoch=batch["epoch"], index=batch["index"]
            )
            for _ in range(2000):
                sock.send(report)
            sock.send(b"")  # a bad message: once it is counted, every report before was read
            wait_until(lambda: producer.status()["bad_messages"] == 1, 30, "the reports to be read")
            lines = [r.getMessage() for r in caplog.records if "changed in shared memory" in r.getMessage()]
            assert len(lines) == 22 and "consumer 'repeater'" in lines[0]
            assert "2000 such reports from it so far" in lines[-1]
            assert [c["label"] for c in producer.status()["consumers"]] == ["repeater"]  # (still joined)
            sock.send(protocol.encode(Kind.BYE, epoch_done=None))
        finally:
            sock.close(0)
    assert errors == []


def test_peers_that_never_read_their_replies_cost_bounded_memory(name, caplog):
    """Two raw peers send STATUS requests and read none of the replies: the producer keeps
    at most QUEUE_PER_PEER messages for each (its ZeroMQ queue) instead of all of them. The
    one that joined is evicted (what it is sent next would be lost); the other's replies are
    dropped; the producer says so and goes on answering."""
    flood = QUEUE_PER_PEER + 3000
    request = protocol.encode(Kind.STATUS, status=None)
    with Producer(NestedLoader(3), name=name) as producer:
        stranger, joined = dealer(producer.endpoint), dealer(producer.endpoint)
        try:
            joined.send(protocol.encode(Kind.HELLO, **hello(label="deaf", timeout=600.0)))
            receive(joined, {Kind.WELCOME})
            for sock in (stranger, joined):
                sock.setsockopt(zmq.RCVHWM, 10)
                for _ in range(flood):
                    sock.send(request)
                sock.send(b"")  # a bad message: once it is counted, every request before was read
            wait_until(lambda: producer.status()["bad_messages"] == 2, 120, "the requests to be read")
            assert producer.status()["dropped_replies"] >= 2 * (flood - QUEUE_PER_PEER - 2000)
            assert producer.status()["consumers"] == []  # "deaf" was evicted
            assert "consumer 'deaf'" in caplog.text and "read none of the last" in caplog.text
            for sock in (stranger, joined):
                assert QUEUE_PER_PEER // 2 <= len(drain(sock)) <= QUEUE_PER_PEER + 2000
            assert alive(producer.endpoint)
        finally:
            stranger.close(0)
            joined.close(0)


def test_a_straggler_that_reads_nothing_is_told_of_its_gap_once_not_once_a_batch(name):
    """stragglers="skip": a raw peer that took its first batch and then reads nothing (a
    stopped process) while the leader takes all 151. It used to be sent a SKIPPED for every
    batch published meanwhile: 10,000 of them (QUEUE_PER_PEER) got a stopped ZeroMQ consumer
    evicted long before its timeout. Now it is sent one SKIPPED for the whole gap, right
    before the next batch it is sent once it releases the one it holds, and the count is
    exact: what it was sent and what it was told it skipped add up to the epoch."""
    batches = 151
    producer = Producer(
        NestedLoader(batches), name=name, slots=4, replay=0, stragglers="skip", min_consumers=2
    )
    with serving(producer, epochs=1) as (_, errors):
        straggler = dealer(producer.endpoint)
        try:
            straggler.send(protocol.encode(Kind.HELLO, **hello(label="stopped", timeout=600.0)))
            receive(straggler, {Kind.WELCOME})
            with Consumer(name=name, timeout=10) as leader:
                assert sum(1 for _ in leader) == batches
            told: list[tuple[Kind, Any]] = []
            while not told or told[-1][0] is not Kind.END:
                kind, msg = receive(
                    straggler, {Kind.BATCH, Kind.SKIPPED, Kind.EPOCH_END, Kind.END}, timeout=10
                )
                told.append((kind, msg["index"] if kind is Kind.BATCH else msg.get("count")))
                if kind is Kind.BATCH:
                    straggler.send(protocol.encode(Kind.RELEASE, seqs=[msg["seq"]]))
            straggler.send(protocol.encode(Kind.BYE, epoch_done=None))
            assert errors == []
            kinds = [kind for kind, _ in told]
            assert kinds[:3] == [Kind.BATCH, Kind.SKIPPED, Kind.BATCH] and kinds.count(Kind.SKIPPED) == 1, (
                told
            )
            assert kinds[-2:] == [Kind.EPOCH_END, Kind.END], told
            (_, first), (_, gap), (_, after) = told[:3]
            sent = [index for kind, index in told if kind is Kind.BATCH]
            assert first == 0 and after == 1 + gap and sent[1:] == list(range(after, batches)), told
        finally:
            straggler.close(0)
