"""The producer's publishing thread reads its consumers' releases over their sessions while it
publishes; its I/O thread reads them while the publisher is away (in a slow loader). Either
way every batch reaches every consumer once, bit for bit, in order; and what the publishing
thread does not apply itself (a BYE, a malformed message) goes to the I/O thread, in order."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tensorsocket import Consumer, Producer, protocol
from tensorsocket.producer import session_turns
from tensorsocket.producer import sessions as sessions_module
from tensorsocket.producer import shared as shared_module
from tensorsocket.producer.shared import TICK
from tensorsocket.protocol import Kind
from tests.support import NestedLoader, expected_batch, join_or_fail, same, serving, start_consumers

_PAUSE = 4 * TICK  # a loader this slow leaves the sessions to the I/O thread meanwhile


def record_release_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread that applies each RELEASE, in order (the real code runs)."""
    readers: list[str] = []
    apply = shared_module.Shared.apply_routine

    def recording(self: shared_module.Shared, cid: object, kind: Kind, msg: dict, now: float) -> bool:
        applied = apply(self, cid, kind, msg, now)
        if applied and kind is Kind.RELEASE:
            readers.append(threading.current_thread().name)
        return applied

    monkeypatch.setattr(shared_module.Shared, "apply_routine", recording)
    return readers


def record_left_frames(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every frame the publishing thread read and left to the I/O thread, as that thread takes it."""
    left: list[bytes] = []
    read = sessions_module.Sessions.read

    def recording(self: sessions_module.Sessions, fd: int, most: int = 1000) -> tuple[list[bytes], bool]:
        left.extend(self.stashed.get(fd, []))
        return read(self, fd, most)

    monkeypatch.setattr(sessions_module.Sessions, "read", recording)
    return left


class PausingLoader(NestedLoader):
    """Pauses before every 10th batch."""

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i % 10 == 9:
                time.sleep(_PAUSE)
            yield batch


@pytest.mark.parametrize("slots", [1, 4])
def test_releases_read_by_either_producer_thread_keep_every_batch_once(name, slots, monkeypatch):
    batches, epochs = 40, 2
    readers = record_release_readers(monkeypatch)
    producer = Producer(PausingLoader(batches), name=name, slots=slots, replay=0, min_consumers=2)
    with serving(producer, epochs=epochs) as (thread, errors):
        procs, results = start_consumers(name, 2, epochs, batches, options={"timeout": 30})
        reports = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        for report in reports:
            assert report["error"] is None, report["error"]
            assert report["bad"] == []
            assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]
        join_or_fail(thread, 30)
    assert errors == []
    # The publishing thread applied releases (in its turn), and the I/O thread again after it
    # (while the loader paused; the first releases come over ZeroMQ, before the sessions).
    assert "test-serve" in readers, readers
    assert "tensorsocket-producer-io" in readers[readers.index("test-serve") :], readers


def test_a_bye_the_publishing_thread_reads_is_applied_by_the_io_thread(name, monkeypatch, caplog):
    """With one place the publishing thread waits for each release on the sessions itself, so
    it reads the BYE of a consumer that leaves: the I/O thread drops that consumer, and the
    other goes on to the end (the producer never waits for the one that left)."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    monkeypatch.setattr(session_turns, "HANDOVER", 60.0)  # the publishing thread's turn never lapses
    left = record_left_frames(monkeypatch)
    batches = 60
    producer = Producer(NestedLoader(batches), name=name, slots=1, replay=0, min_consumers=2)
    with serving(producer, epochs=1) as (thread, errors):
        leaver_saw: list[int] = []

        def leaver() -> None:
            with Consumer(name=name, timeout=30, label="leaver") as consumer:
                for batch in consumer:  # (no zip() or enumerate(): their tuple would hold a batch)
                    if same(batch, expected_batch(len(leaver_saw), batches)):
                        leaver_saw.append(len(leaver_saw))
                    del batch
                    if len(leaver_saw) >= 5 and consumer._conn.link.switched:  # (its BYE goes on the session)
                        break

        other = threading.Thread(target=leaver)
        other.start()
        got = []
        with Consumer(name=name, timeout=30, label="stayer") as consumer:
            for batch in consumer:
                got.append(same(batch, expected_batch(len(got), batches)))
                del batch
        join_or_fail(other, 30)
        join_or_fail(thread, 30)
    assert errors == []
    assert leaver_saw == list(range(len(leaver_saw))) and 5 <= len(leaver_saw) < batches
    assert got == [True] * batches
    assert "consumer 'leaver'" in caplog.text and "left" in caplog.text
    kinds = [protocol.decode(frame)[0] for frame in left if frame]
    assert Kind.BYE in kinds, f"the BYE never went through the hand-over: {kinds}"


def test_a_malformed_message_the_publishing_thread_reads_is_reported_and_the_stream_goes_on(
    name, monkeypatch, caplog
):
    """Garbage on a consumer's session, read by the publishing thread: the I/O thread counts
    it and answers ERROR (the consumer logs it), and every batch still reaches both consumers."""
    monkeypatch.setattr(session_turns, "HANDOVER", 60.0)  # the publishing thread's turn never lapses
    left = record_left_frames(monkeypatch)
    batches = 40
    producer = Producer(NestedLoader(batches), name=name, slots=1, replay=0, min_consumers=2)
    garbage = b"\xc1\x00 not msgpack"
    with serving(producer, epochs=1) as (thread, errors):
        other_got: list[bool] = []

        def other() -> None:
            with Consumer(name=name, timeout=30) as consumer:
                for batch in consumer:
                    other_got.append(same(batch, expected_batch(len(other_got), batches)))
                    del batch

        helper = threading.Thread(target=other)
        helper.start()
        got = []
        with Consumer(name=name, timeout=30) as consumer:
            for batch in consumer:
                got.append(same(batch, expected_batch(len(got), batches)))
                del batch
                if len(got) == 5:  # (on its session by now: the first batches come over ZeroMQ)
                    link = consumer._conn.link
                    assert link.conn is not None and link.switched
                    with consumer._shared.link_lock:
                        link.conn.send(garbage)
            status = producer.status()
        join_or_fail(helper, 30)
        join_or_fail(thread, 30)
    assert errors == []
    assert got == [True] * batches and other_got == [True] * batches
    assert status["bad_messages"] == 1
    assert "the producer at" in caplog.text and "reports" in caplog.text
    assert garbage in left, "the garbage never went through the hand-over"


def test_messages_sent_together_are_applied_in_order_one_read_at_a_time(name, monkeypatch):
    """The publishing thread reads one message per session each time it looks: a burst
    (three heartbeats, then garbage) is still applied in order, the heartbeats by that thread
    and the garbage handed to the I/O thread after them, and every batch still arrives."""
    monkeypatch.setattr(session_turns, "HANDOVER", 60.0)  # the publishing thread's turn never lapses
    left = record_left_frames(monkeypatch)
    applied: list[tuple[str, Kind]] = []
    apply = shared_module.Shared.apply_routine

    def recording(self: shared_module.Shared, cid: object, kind: Kind, msg: dict, now: float) -> bool:
        done = apply(self, cid, kind, msg, now)
        if done and kind is Kind.HEARTBEAT:
            applied.append((threading.current_thread().name, kind))
        return done

    monkeypatch.setattr(shared_module.Shared, "apply_routine", recording)
    batches = 30
    producer = Producer(NestedLoader(batches), name=name, slots=1, replay=0)
    garbage = b"\xc1\x00 not msgpack"
    with serving(producer, epochs=1) as (thread, errors):
        got = []
        with Consumer(name=name, timeout=30) as consumer:
            for batch in consumer:
                got.append(same(batch, expected_batch(len(got), batches)))
                del batch
                if len(got) == 5:
                    link = consumer._conn.link
                    assert link.conn is not None and link.switched
                    with consumer._shared.link_lock:
                        for frame in [protocol.encode(Kind.HEARTBEAT)] * 3 + [garbage]:
                            link.conn.send(frame)
            status = producer.status()
        join_or_fail(thread, 30)
    assert errors == []
    assert got == [True] * batches
    assert status["bad_messages"] == 1
    assert garbage in left, "the garbage never went through the hand-over"
    by_publisher = [who for who, _ in applied if who != "tensorsocket-producer-io"]
    assert len(by_publisher) >= 3, (
        f"the burst's heartbeats were not applied by the publishing thread: {applied}"
    )
