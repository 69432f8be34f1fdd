"""Ctrl-C in a Producer's constructor or its close(), in a program that catches it and goes on
(a notebook): the name, the I/O thread and the shared memory are given back, never left to a
producer nobody can close."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from tensorsocket import Consumer, Producer
from tensorsocket.producer import facade, io_loop
from tensorsocket.transport.shm import ShmStore
from tests.support import NestedLoader, expected_batch, same, serving, shm_segments

BATCHES = 4


def _producer_io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tensorsocket-producer-io"]


def _takes_every_batch(name: str, got: list[bool]) -> None:
    with Consumer(name=name, timeout=10) as consumer:
        for batch in consumer:
            got.append(same(batch, expected_batch(len(got), BATCHES)))


def _serves_a_consumer(name: str) -> None:
    """A new producer of ``name`` (so the name is free) serves a consumer every batch."""
    got: list[bool] = []
    with serving(Producer(NestedLoader(BATCHES), name=name, slots=2, replay=0), epochs=1) as (thread, errors):
        _takes_every_batch(name, got)
    assert errors == [] and got == [True] * BATCHES


@pytest.mark.parametrize("where", ["as-the-bind-returns", "as-the-publisher-is-made"])
def test_ctrl_c_in_the_constructor_gives_the_name_back(name, monkeypatch, where):
    """Before: once the I/O thread had bound the name, nothing stopped it if the constructor
    did not finish. It answered HELLOs and heartbeats with no publisher behind it, so a consumer
    that joined waited past its timeout, and the name stayed taken ("already serving") for the
    process's life. Now the constructor stops it and frees what it made."""
    if where == "as-the-bind-returns":
        start = io_loop.IoLoop.start

        def interrupted(self: Any) -> str:
            start(self)
            raise KeyboardInterrupt

        monkeypatch.setattr(io_loop.IoLoop, "start", interrupted)
    else:

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt

        monkeypatch.setattr(facade, "Publisher", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Producer(NestedLoader(BATCHES), name=name, slots=2, replay=0)
    monkeypatch.undo()
    assert _producer_io_threads() == []
    _serves_a_consumer(name)


def _interrupt_on_entering(code: Any, armed: list[bool]) -> Any:
    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and armed[0] and frame.f_code is code:
            armed[0] = False
            raise KeyboardInterrupt

    return trace


def test_ctrl_c_in_close_leaves_it_to_the_next_close(name):
    """Before: close() marked the producer closed first, so one cut short by Ctrl-C as it freed
    its places (here: as the store's close() began) left the shared memory and the name taken
    for the process's life, and every later close() did nothing. Now the next one does it."""
    producer = Producer(NestedLoader(BATCHES), name=name, slots=2, replay=0)
    got: list[bool] = []
    consumer = threading.Thread(target=_takes_every_batch, args=(name, got), daemon=True)
    consumer.start()
    armed = [True]
    sys.settrace(_interrupt_on_entering(type(producer._shared.store).close.__code__, armed))
    try:
        with pytest.raises(KeyboardInterrupt):
            producer.serve(epochs=1)  # (it closes at the end)
    finally:
        sys.settrace(None)
    consumer.join(timeout=30)
    assert not armed[0] and got == [True] * BATCHES
    assert shm_segments(os.getpid()) != []  # (cut short before the places were freed)
    producer.close()
    assert shm_segments(os.getpid()) == []
    _serves_a_consumer(name)


def test_a_second_ctrl_c_in_the_constructors_clean_up_still_gives_the_name_back(name, monkeypatch):
    """Before: a constructor that failed (here Ctrl-C as its publisher was made) freed what it
    had made, but a second Ctrl-C in that clean-up (here as the places were freed) left the name
    taken for the process's life, with no Producer to close. Now the clean-up is done whole and
    the first Ctrl-C is raised."""

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(facade, "Publisher", interrupted)
    armed = [True]
    sys.settrace(_interrupt_on_entering(ShmStore.close.__code__, armed))
    try:
        with pytest.raises(KeyboardInterrupt):
            Producer(NestedLoader(BATCHES), name=name, slots=2, replay=0)
    finally:
        sys.settrace(None)
    monkeypatch.undo()
    assert not armed[0]  # (the second Ctrl-C was raised in the clean-up)
    assert _producer_io_threads() == [] and shm_segments(os.getpid()) == []
    _serves_a_consumer(name)


def test_an_io_thread_stopped_before_it_began_never_binds(name, monkeypatch):
    """Ctrl-C can cut Thread.start() short after the new thread exists but before it runs: it
    has no ident yet, so the constructor's clean-up cannot join it, and it ran later. Before, it
    then bound the name after the producer had given it back (an ipc bind takes the path from
    whoever holds it by then). Now a thread that begins after the stop binds nothing."""
    run, listen, bound = io_loop.IoLoop._run, io_loop.listen, []

    def late(self: Any, *args: Any) -> None:  # scheduled only once the constructor stopped it
        deadline = time.monotonic() + 10
        while not self.shared.stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        run(self, *args)

    def cut_short(self: Any) -> str:
        self.thread.start()
        raise KeyboardInterrupt

    def counted(*args: Any) -> Any:
        bound.append(args)
        return listen(*args)

    monkeypatch.setattr(io_loop.IoLoop, "_run", late)
    monkeypatch.setattr(io_loop.IoLoop, "start", cut_short)
    monkeypatch.setattr(io_loop, "listen", counted)
    with pytest.raises(KeyboardInterrupt):
        Producer(NestedLoader(BATCHES), name=name, slots=2, replay=0)
    for thread in _producer_io_threads():
        thread.join(timeout=10)
    monkeypatch.undo()
    assert bound == [] and _producer_io_threads() == []
    _serves_a_consumer(name)
