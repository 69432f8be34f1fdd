"""Consumers of one stream in one process (consumer/siblings.py): a thread that takes them in
turn under stragglers="stall" gets an error (or, while the other was never iterated, a
warning) instead of a wait that never ends; programs that are right are left alone."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Hoarding, Producer
from tests.support import NestedLoader, expected_batch, join_or_fail, same, serving, wait_until

TIMEOUT = 0.5  # each consumer's: how long a wait lasts before it asks


def _ids(batches: int) -> list[torch.Tensor]:
    return [torch.full((4,), float(i)) for i in range(batches)]


def _in_a_thread(body: Any, limit: float = 30.0) -> list[BaseException]:
    """Run ``body`` in a thread of its own (so a hang fails the test, it does not stall it)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="the wait", daemon=True)
    thread.start()
    join_or_fail(thread, limit)
    return errors


@contextlib.contextmanager
def _warned(words: str) -> Iterator[threading.Event]:
    """An event set once tensorsocket logs a message containing ``words``."""
    warned = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if words in record.getMessage():
                warned.set()

    watch = Watch()
    logging.getLogger("tensorsocket").addHandler(watch)
    try:
        yield warned
    finally:
        logging.getLogger("tensorsocket").removeHandler(watch)


def test_two_consumers_taken_in_turn_by_one_thread_raise_instead_of_waiting_forever(name: str) -> None:
    producer = Producer(_ids(12), name=name, slots=2, replay=0, min_consumers=2)
    with serving(producer, 1):
        first = Consumer(name=name, timeout=TIMEOUT, label="first")
        second = Consumer(name=name, timeout=TIMEOUT, label="second")
        taken: list[float] = []

        def in_turn() -> None:
            next(iter(second))  # this thread iterated it: it is this thread's to move on
            for batch in first:
                taken.append(float(batch[0]))

        started = time.monotonic()
        try:
            [error] = _in_a_thread(in_turn)
        finally:
            first.close()
            second.close()
        assert isinstance(error, Hoarding) and "'second'" in str(error) and "zip" in str(error)
        # (second took and dropped batch 0: its place held batch 2; batch 3's needs batch 1's)
        assert taken == [0.0, 1.0, 2.0] and time.monotonic() - started < 20


@pytest.mark.parametrize("handed", [False, True], ids=["made-here", "iterator-made-here"])
def test_one_made_here_and_never_iterated_gets_a_warning_and_may_still_be_taken(
    name: str, caplog: pytest.LogCaptureFixture, handed: bool
) -> None:
    """The other thread that will take it may still be setting up: warn, never raise. So too
    when this thread made its iterator too (iter()) and hands that to the other thread."""
    producer = Producer(_ids(12), name=name, slots=2, replay=0, min_consumers=2)
    with _warned("not iterated yet") as warned:
        with serving(producer, 1), Consumer(name=name, timeout=TIMEOUT, label="first") as first:
            with Consumer(name=name, timeout=TIMEOUT, label="late") as late:
                late_taken: list[float] = []
                epoch = iter(late) if handed else None

                def late_starter() -> None:  # takes `late` only once the warning was given
                    assert warned.wait(20)
                    late_taken.extend(float(batch[0]) for batch in (late if epoch is None else epoch))

                starter = threading.Thread(target=late_starter, daemon=True)
                starter.start()
                taken = [float(batch[0]) for batch in first]
                join_or_fail(starter, 20)
                assert taken == late_taken == [float(i) for i in range(12)]
        assert warned.is_set()


def test_a_next_epoch_joiner_held_back_before_its_first_batch_by_one_this_thread_iterated_warns(
    name: str,
) -> None:
    """The README helper's case: a thread takes a few batches of one consumer, then iterates a
    second that joins at the next epoch; the producer cannot get there before the first takes
    what it was sent. Before: a silent wait for ever (the check knew only a consumer's wait
    for the batch after one it took). Now a warning names the other (not an error: the
    waiting one cannot tell where the producer is, and a slow loader looks the same); here
    closing the first from another thread then lets the second go on."""
    producer = Producer(_ids(12), name=name, slots=2, replay=0)
    with _warned("for its first batch while consumer 'first'") as warned:
        with serving(producer, 2), Consumer(name=name, timeout=TIMEOUT, label="first") as first:
            late = Consumer(name=name, timeout=TIMEOUT, label="late", late_join="next_epoch")
            taken: list[float] = []

            def in_turn() -> None:  # (first's batch, and the next sent to it, hold both places)
                held = next(iter(first))  # noqa: F841
                taken.extend(float(b[0]) for b in late)

            waiting = threading.Thread(target=in_turn, daemon=True)
            waiting.start()
            assert warned.wait(20), "no warning"
            first.close()
            join_or_fail(waiting, 20)
            late.close()
            assert taken == [float(i) for i in range(12)]  # (epoch 1, whole)


def test_skipping_stragglers_and_zip_over_a_slow_loader_are_left_alone(name: str) -> None:
    """Under stragglers="skip" the producer does not wait for the other one; in zip() each
    takes its turn, and a loader slower than the consumers' timeout is no deadlock."""
    producer = Producer(_ids(12), name=name, slots=2, replay=0, min_consumers=2, stragglers="skip")
    with serving(producer, 1):
        with Consumer(name=name, timeout=TIMEOUT) as first, Consumer(name=name, timeout=TIMEOUT) as second:
            next(iter(second))
            assert [float(b[0]) for b in first] == [float(i) for i in range(12)]
    # (slots=4: zip's cached result tuple keeps an old pair alive, a batch more held by each)
    slow = Producer(NestedLoader(6, delay=3 * TIMEOUT), name=name + "z", slots=4, replay=0, min_consumers=2)
    with serving(slow, 1):
        with Consumer(name=name + "z", timeout=TIMEOUT) as a, Consumer(name=name + "z", timeout=TIMEOUT) as b:
            count = 0
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert same(x, expected_batch(i, 6)) and same(y, expected_batch(i, 6))
                count += 1
            assert count == 6


@pytest.mark.parametrize("session", ["1", "0"], ids=["session", "zeromq"])
def test_one_consumer_iterated_by_two_threads_at_once_is_refused(
    name: str, session: str, monkeypatch
) -> None:
    """A consumer, like a DataLoader iterator, is iterated by one thread at a time. Before, a
    second thread in next() got "concurrent poll() invocation" on a session, and over ZeroMQ
    the two threads silently split the batches. Now the second one is told; the first goes on
    with every batch, and an iterator handed on between threads afterwards is still fine."""
    monkeypatch.setenv("TENSORSOCKET_SESSION", session)  # (read by the producer)
    producer = Producer(NestedLoader(3, delay=2.0), name=name, slots=2, replay=0)
    with serving(producer, 1), Consumer(name=name, label="shared", timeout=30) as consumer:
        it = iter(consumer)
        got = [same(next(it), expected_batch(0, 3))]  # (the next batch is then ~2 s away)
        waiting = threading.Thread(
            target=lambda: got.append(same(next(it), expected_batch(1, 3))), daemon=True
        )
        waiting.start()
        wait_until(lambda: consumer._batches.inside is not None, 30, "the thread to wait in next()")
        with pytest.raises(RuntimeError, match="consumer 'shared' is in next\\(\\) in another thread"):
            next(it)
        join_or_fail(waiting, 30)
        got += [same(b, expected_batch(i, 3)) for i, b in enumerate(it, start=2)]  # handed back: fine
        assert got == [True] * 3, got
