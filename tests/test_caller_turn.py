"""The caller's thread reads its own batches while it waits in next(); the I/O thread reads
them while the caller is away (a training step): either way every batch arrives once, bit for
bit, in order, and releases flow, even with a one-place window."""

from __future__ import annotations

import threading
import time

import pytest

from tensorsocket import Consumer, Producer, ProducerLost, protocol
from tensorsocket.consumer import inbox
from tensorsocket.consumer.shared import HANDOVER
from tensorsocket.protocol import Kind
from tests.support import NestedLoader, expected_batch, same, serving


def record_batch_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread that reads each BATCH, in order (the real handler runs)."""
    readers: list[str] = []
    handle = inbox.Inbox.handle

    def recording(self: inbox.Inbox, frame: bytes) -> bool:
        if protocol.decode(frame, protocol.MAX_REPLY_BYTES)[0] is Kind.BATCH:
            readers.append(threading.current_thread().name)
        return handle(self, frame)

    monkeypatch.setattr(inbox.Inbox, "handle", recording)
    return readers


@pytest.mark.parametrize("slots", [1, 4])
def test_batches_read_by_either_thread_arrive_once_in_order(name, slots, monkeypatch):
    batches, epochs = 30, 2
    readers = record_batch_readers(monkeypatch)
    producer = Producer(NestedLoader(batches), name=name, slots=slots, replay=0)
    with serving(producer, epochs=epochs) as (thread, errors):
        seen: list[tuple[int, int]] = []
        bad: list[tuple[int, int]] = []
        with Consumer(name=name, timeout=30) as consumer:
            for epoch in range(epochs):
                index = 0  # (not enumerate(): its cached tuple would hold the last batch in next())
                for batch in consumer:
                    seen.append((epoch, index))
                    if not same(batch, expected_batch(index, batches)):
                        bad.append((epoch, index))
                    del batch
                    if index % 5 == 4:  # away from next() for longer than HANDOVER: a "step"
                        time.sleep(HANDOVER * 6)
                    index += 1
        thread.join(timeout=30)
    assert errors == []
    assert bad == []
    assert seen == [(e, i) for e in range(epochs) for i in range(batches)]
    # Both threads read batches: the caller's while it waited in next(), the I/O thread's
    # while the caller slept (the next batches, up to the window), and again after the
    # caller's thread had read some (the first few come over ZeroMQ, on the I/O thread).
    assert "MainThread" in readers, readers
    assert "tensorsocket-consumer-io" in readers[readers.index("MainThread") :], readers


def test_batches_of_gpu_memory_are_read_by_the_io_thread_only(name, monkeypatch):
    """A GPU reader's batches are built on the I/O thread, as before: the caller's thread
    reads only batches that are views of host memory (here on the CUDA stand-in)."""
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    readers = record_batch_readers(monkeypatch)
    producer = Producer(NestedLoader(12), name=name, device="cuda:0", slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, timeout=30, device="cuda:0") as consumer:
            assert consumer._conn.reader.kind == "cuda"
            got = []
            for batch in consumer:
                got.append(same(batch, expected_batch(len(got), 12)))
        thread.join(timeout=30)
    assert errors == []
    assert got == [True] * 12
    assert set(readers) == {"tensorsocket-consumer-io"}, readers


def test_a_read_that_fails_in_the_callers_thread_ends_the_stream_instead_of_skipping_a_batch(
    name, monkeypatch, caplog
):
    """A BATCH read by the caller's thread and then lost (an OSError mapping its arena, say, or
    Ctrl-C half-way): next() raises ProducerLost rather than go on without that batch, and the
    consumer leaves at once (the producer does not wait for it)."""
    handle = inbox.Inbox.handle

    def failing(self: inbox.Inbox, frame: bytes) -> bool:
        if threading.current_thread().name == "MainThread":
            raise OSError("injected: cannot map the arena")
        return handle(self, frame)

    producer = Producer(NestedLoader(40), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, timeout=30) as consumer:
            taken = 0
            with pytest.raises(ProducerLost, match="failed while it read: OSError: injected"):
                for batch in consumer:
                    assert same(batch, expected_batch(taken, 40))
                    taken += 1
                    del batch
                    if taken == 3:  # the first batches come over ZeroMQ: fail from here on
                        monkeypatch.setattr(inbox.Inbox, "handle", failing)
            assert 3 <= taken < 40
    assert errors == []
    assert "not finished" not in caplog.text  # (a consumer still registered at close() is)
