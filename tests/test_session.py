"""Consumers' sessions: after the handshake, a consumer on the producer's host moves its
messages to a Unix SEQPACKET connection of its own; one that cannot (another network
namespace, or a producer that offers none) stays on ZeroMQ; either way every batch arrives
once, bit for bit, in order; and nobody can speak on a session without its token."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import zmq

from tensorsocket import Consumer, Producer, protocol, session
from tensorsocket.producer import sessions as producer_sessions
from tensorsocket.protocol import Kind
from tensorsocket.session import Connection
from tests.support import SPAWN, NestedLoader, expected_batch, same, serving, start_consumers, wait_until


def collect(procs: list[Any], results: Any, n: int) -> list[dict[str, Any]]:
    reports = [results.get(timeout=90) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    return reports


def assert_exact(report: dict[str, Any], batches: int, epochs: int = 1) -> None:
    assert report["error"] is None, report["error"]
    assert report["bad"] == []
    assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]


def sessions_of(producer: Producer) -> producer_sessions.Sessions:
    return producer._io.sessions


def test_local_consumers_move_to_their_own_connections(name):
    batches = 40
    procs, results = start_consumers(name, 3, 2, batches, step=0.01)
    producer = Producer(NestedLoader(batches), name=name, slots=3, min_consumers=3)
    with serving(producer, epochs=2) as (thread, errors):
        wait_until(lambda: len(sessions_of(producer).by_cid) == 3, 30, "three consumers on sessions")
        reports = collect(procs, results, 3)
        thread.join(timeout=30)
    assert errors == []
    for report in reports:
        assert_exact(report, batches, epochs=2)


def test_a_producer_without_sessions_serves_everyone_over_zeromq(name, monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_SESSION", "0")
    batches = 12
    procs, results = start_consumers(name, 2, 1, batches)
    producer = Producer(NestedLoader(batches), name=name, slots=3, min_consumers=2)
    assert sessions_of(producer).address is None
    with serving(producer, epochs=1) as (thread, errors):
        reports = collect(procs, results, 2)
        thread.join(timeout=30)
        assert sessions_of(producer).by_cid == {}
    assert errors == []
    for report in reports:
        assert_exact(report, batches)


_NETNS_CONSUMER = """
import json, sys, time
from tests.support import expected_batch, same
from tensorsocket import Consumer
seen, bad = [], []
with Consumer(name=sys.argv[1], timeout=30) as consumer:
    for index, batch in enumerate(consumer):
        seen.append(index)
        time.sleep(0.05)
        bad += [] if same(batch, expected_batch(index, int(sys.argv[2]))) else [index]
print(json.dumps({"seen": seen, "bad": bad}))
"""


def _own_network_namespace() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _own_network_namespace(), reason="needs unshare -n (root, as on CI)")
def test_a_consumer_that_cannot_reach_the_session_stays_on_zeromq(name):
    """A consumer in another network namespace cannot reach the producer's abstract address
    (the ipc:// endpoint, a file, it can): it stays on ZeroMQ beside one that moved."""
    import json

    batches = 30
    procs, results = start_consumers(name, 1, 1, batches, step=0.1)  # both still there mid-stream
    outsider = subprocess.Popen(
        ["unshare", "-n", sys.executable, "-c", _NETNS_CONSUMER, name, str(batches)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    producer = Producer(NestedLoader(batches), name=name, slots=3, min_consumers=2)
    try:
        with serving(producer, epochs=1) as (thread, errors):
            wait_until(
                lambda: len(producer._shared.peers) == 2 and len(sessions_of(producer).by_cid) == 1,
                60,
                lambda: (
                    f"both consumers joined, one on a session ({len(sessions_of(producer).by_cid)} on one)"
                ),
            )
            report = collect(procs, results, 1)[0]
            out, _ = outsider.communicate(timeout=60)
            thread.join(timeout=30)
    finally:
        outsider.kill()
    assert errors == []
    assert_exact(report, batches)
    assert json.loads(out) == {"seen": list(range(batches)), "bad": []}


def _big_batches(batches: int) -> list[Any]:
    """Every third batch carries ~120 KB of strings: its BATCH message is too large for one
    datagram and goes over ZeroMQ, with its place kept on the session."""
    return [
        {"x": expected_batch(i, batches)[0], "names": [f"{i}-" + "n" * 1200] * 100 if i % 3 == 0 else []}
        for i in range(batches)
    ]


def _take_big(name: str, batches: int, results: Any) -> None:
    from tensorsocket import Consumer

    report: dict[str, Any] = {"seen": [], "bad": [], "error": None}
    try:
        with Consumer(name=name, timeout=30) as consumer:
            for index, batch in enumerate(consumer):
                report["seen"].append(index)
                if not same(batch, _big_batches(batches)[index]):
                    report["bad"].append(index)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


def test_messages_too_large_for_a_datagram_keep_their_place(name):
    batches = 12
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_take_big, args=(name, batches, results))
    proc.start()
    producer = Producer(_big_batches(batches), name=name, slots=2)
    with serving(producer, epochs=1) as (thread, errors):
        report = results.get(timeout=90)
        thread.join(timeout=30)
    proc.join(timeout=30)
    assert errors == []
    assert report == {"seen": list(range(batches)), "bad": [], "error": None}


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + address)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_connections_without_a_valid_token_are_closed_and_the_stream_goes_on(name, monkeypatch, caplog):
    monkeypatch.setattr(producer_sessions, "_BIND_WITHIN", 0.5)
    batches = 60
    procs, results = start_consumers(name, 1, 1, batches, step=0.05)
    producer = Producer(NestedLoader(batches), name=name, slots=3)
    with serving(producer, epochs=1) as (thread, errors):
        sessions = sessions_of(producer)
        wait_until(lambda: len(sessions.by_cid) == 1, 30, "the consumer on its session")
        used = next(iter(sessions.by_cid))
        attempts = {
            "a wrong token": protocol.encode(Kind.SESSION, token="0" * 32),
            "garbage": b"\xc1\x00not msgpack",
            "another kind": protocol.encode(Kind.RELEASE, seqs=[0, 1, 2]),
            "a datagram over the size limit": b"x" * (protocol.MAX_REQUEST_BYTES + 1),
            "an empty datagram": b"",
        }
        for what, frame in attempts.items():
            sock = _connect(sessions.address)
            sock.send(frame)
            assert _closed_by_peer(sock), f"a connection that sent {what} was not closed"
            sock.close()
        silent = _connect(sessions.address)
        assert _closed_by_peer(silent), "a connection that never said whose it is was not closed"
        silent.close()
        assert list(sessions.by_cid) == [used]  # the consumer's own session untouched
        assert any(
            r.levelname == "WARNING" and "did not present a valid token" in r.getMessage()
            for r in caplog.records
        )
        report = collect(procs, results, 1)[0]
        thread.join(timeout=30)
    assert errors == []
    assert_exact(report, batches)


def test_consumers_that_leave_at_once_are_no_intruders(name, caplog):
    """A consumer closed right after it joined may leave before the producer reads its
    session's first message: that token was its own, so no warning (there were ~12 in 100)."""
    producer = Producer(lambda: (torch.zeros(4) for _ in range(1 << 20)), name=name, replay=0)
    with serving(producer, epochs=None):
        for _ in range(100):
            Consumer(name=name, timeout=5).close()
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "valid token" in r.getMessage()]


def test_a_session_is_bound_under_the_producers_lock(name, monkeypatch):
    """The publishing thread evicts joiners (a replayed batch that changed, no room to replay)
    under the producer's lock, forgetting each one's unused session token, while the I/O
    thread binds a session by taking its token: unlocked, a bind between forget's listing of
    the tokens and its removal of one raised KeyError in the publishing thread, ending the
    stream for every consumer."""
    real, owned = producer_sessions.Sessions.bind, []
    producer = Producer(lambda: (torch.zeros(4) for _ in range(1 << 20)), name=name, replay=0)

    def bind(self: producer_sessions.Sessions, fd: int, peers: Any) -> Any:
        owned.append(producer._shared.lock._is_owned())
        return real(self, fd, peers)

    monkeypatch.setattr(producer_sessions.Sessions, "bind", bind)
    with serving(producer, epochs=None), Consumer(name=name, timeout=5):
        wait_until(lambda: len(sessions_of(producer).by_cid) == 1, 30, "the consumer on its session")
    assert owned and all(owned), owned


def test_sends_the_kernel_cannot_take_wait_in_order():
    """A peer that does not read (frozen, say): sends queue in the kernel, then in
    ``pending``; once it reads, flush() delivers every frame, in order."""
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Connection(near)
    frames = [i.to_bytes(4, "big") * 256 for i in range(20000)]
    for frame in frames:
        sender.send(frame)
    assert sender.pending, "the kernel took 20 MB without a reader: the test proves nothing"
    got = []
    far.settimeout(10)
    deadline = time.monotonic() + 60
    while len(got) < len(frames) and time.monotonic() < deadline:
        sender.flush()
        try:
            got.append(far.recv(1 << 16))
        except TimeoutError:
            break
    assert got == frames and not sender.pending
    far.close()
    sender.send(b"to nobody")  # the peer is gone: dropped, never raised
    sender.flush()
    assert sender.broken and not sender.pending
    sender.close()


def test_a_peer_that_reads_nothing_is_cut_off_once_its_pending_bytes_pass_the_bound(monkeypatch, caplog):
    """What the kernel cannot take waits in ``pending``, up to MAX_PENDING_BYTES: past it the
    connection is cut off (it keeps nothing more) and the peer sees it closed after what the
    kernel already held, so memory stays bounded whatever a peer that never reads is sent."""
    monkeypatch.setattr(session, "MAX_PENDING_BYTES", 4 << 20)
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Connection(near)
    frame = b"x" * (60 << 10)
    sent = 0
    while not sender.broken and sent < 10_000:
        sender.send(frame)
        sent += 1
    assert sender.broken and not sender.pending and sender.pending_bytes == 0, sent
    sender.send(frame)  # dropped: nothing is kept any more
    assert not sender.pending
    assert "read none of the last 4 MiB" in caplog.text
    far.settimeout(10)
    got = 0
    while (data := far.recv(1 << 16)) != b"":  # what the kernel held, then the end
        assert data == frame
        got += 1
    assert 0 < got < sent
    far.close()
    sender.close()


class _FullQueue:
    """A ROUTER socket whose queue for every peer is full (ROUTER_MANDATORY raises EAGAIN)."""

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        raise zmq.Again()


def test_a_large_frame_a_full_zeromq_queue_cannot_take_cuts_the_session_off():
    """A frame too large for a datagram goes over ZeroMQ, LARGE over the session. If the
    peer's ZeroMQ queue is full (it read none of the last QUEUE_PER_PEER), the frame is
    dropped: announcing it would leave the peer waiting for bytes that never come, so its
    connection is cut off (both ends see it closed) instead."""
    sessions = producer_sessions.Sessions()
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn = Connection(near)
    sessions.by_cid[b"c"], sessions.cid_of[conn.fd] = conn, b"c"
    try:
        assert sessions.send(_FullQueue(), b"c", b"x" * (session.MAX_DATAGRAM + 1))  # type: ignore[arg-type]
        assert conn.broken
        far.settimeout(10)
        assert far.recv(1 << 16) == b""  # closed, no LARGE for a frame that never comes
    finally:
        sessions.close()
        far.close()


def test_a_switch_says_whose_zeromq_queue_was_full():
    """What was queued for ZeroMQ goes at a consumer's switch to its session, with SWITCHED:
    the peers whose queue was full are reported (the I/O thread evicts a joined one), not
    dropped unseen."""
    sessions = producer_sessions.Sessions()
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        full = sessions.switch(_FullQueue(), (b"c", Connection(near)), [(b"other", b"reply")])  # type: ignore[arg-type]
        assert full == [b"other", b"c"]
    finally:
        sessions.close()
        far.close()


def _as_nobody(address: str) -> str:
    """Connect to ``address`` from a forked child running as user nobody and say what the
    producer did within 5 s (a connection that says nothing is kept for 10 s)."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 3
        try:
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(5)
            sock.connect("\0" + address)
            code = 0 if sock.recv(1 << 16) == b"" else 1
        except ConnectionResetError:
            code = 0
        except TimeoutError:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "closed", 1: "answered", 2: "kept open"}.get(os.waitstatus_to_exitcode(status), "failed")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_users_connection_is_closed_at_once(name):
    """Abstract addresses have no file permissions: the producer checks the peer's uid (so
    another user cannot even hold descriptors of ours while it guesses tokens)."""
    producer = Producer(NestedLoader(8), name=name, slots=3)
    try:
        assert _as_nobody(sessions_of(producer).address) == "closed"
    finally:
        producer.close()
