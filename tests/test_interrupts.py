"""Ctrl-C in a consumer's own thread: a KeyboardInterrupt the caller catches leaves the consumer
usable (or ends its stream with a clear error), never holding a lock its I/O thread needs, and
never without a batch it was sent."""

from __future__ import annotations

import _thread
import gc
import sys
import threading
import time
import weakref
from typing import Any

import pytest

from tensorsocket import Consumer, Producer, ProducerLost, protocol, wakeup
from tensorsocket.consumer import delivery, handshake, inbox, io_loop, iteration, link
from tensorsocket.protocol import Kind
from tests.support import NestedLoader, expected_batch, same, serving, wait_until


class InterruptedAcquire:
    """The consumer's link lock, but once armed, the next timed ``acquire()`` (the caller's
    thread's: the I/O thread takes it with ``with``) raises KeyboardInterrupt just after it
    took the lock: where Ctrl-C lands when its signal arrives as ``acquire()`` returns (Python
    raises it at the call's end, before the caller's next line)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.armed, self.fired = lock, False, 0

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self.lock.acquire(*args, **kwargs)
        if got and self.armed:
            self.armed = False
            self.fired += 1
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.lock.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:  # (_is_owned, locked)
        return getattr(self.lock, name)


def _through_interrupts(
    it: Any, batches: int, seen: list[int], interrupts: list[int], after: Any, kind: Any = KeyboardInterrupt
) -> None:
    """Iterate ``it`` to its end as a program that catches Ctrl-C and goes on does (a notebook
    cell run again), each batch checked and counted into ``seen``, ``after(len(seen))`` with
    the batch still bound (as a loop's variable is); each KeyboardInterrupt (or ``kind``) into
    ``interrupts``."""
    while True:
        try:
            for batch in it:
                assert same(batch, expected_batch(len(seen), batches)), f"batch {len(seen)}"
                seen.append(len(seen))
                after(len(seen))
            return
        except kind:
            interrupts.append(1)  # (not the exception: its traceback's frames hold batches)


def test_ctrl_c_as_the_callers_thread_takes_the_link_lock_does_not_leave_it_held(name):
    """Before: the lock stayed held by the caller's thread, so its I/O thread waited for it for
    ever (no heartbeat: the producer evicted the consumer after its timeout) and next() waited
    for ever too, past every timeout. After: the caller catches the interrupt and goes on."""
    batches = 30
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    outcome: dict[str, Any] = {}

    def trainer() -> None:
        try:
            with Consumer(name=name, timeout=3) as consumer:
                lock = consumer._shared.link_lock = InterruptedAcquire(consumer._shared.link_lock)
                got, interrupted, it = [], 0, iter(consumer)
                while True:
                    try:
                        for batch in it:
                            got.append(same(batch, expected_batch(len(got), batches)))
                            del batch
                            if len(got) in (5, 15):
                                lock.armed = True
                        break
                    except KeyboardInterrupt:
                        interrupted += 1
                outcome.update(got=got, interrupted=interrupted, fired=lock.fired)
        except BaseException as exc:
            outcome["error"] = exc

    with serving(producer, epochs=1) as (thread, errors):
        worker = threading.Thread(target=trainer, name="trainer", daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "next() hung after a Ctrl-C it caught"
        thread.join(timeout=30)
    assert errors == []
    assert "error" not in outcome, outcome
    assert outcome["fired"] == outcome["interrupted"] >= 1
    assert outcome["got"] == [True] * batches


def test_ctrl_c_as_the_callers_thread_reads_a_batch_never_skips_it(name, monkeypatch):
    """The caller's thread reads its session while it waits in next(). Ctrl-C whose signal came
    as a datagram was read is raised as recv() returns, with the datagram read: before, that
    batch was gone and the next next() gave the one after it, as if nothing had happened.
    After: as for an interrupt while it handles the batch, the stream ends with ProducerLost
    (this consumer can no longer be exact), never with a batch missing."""
    batches = 40
    recv = link.Link.recv
    armed = [False]

    def interrupted(self: link.Link) -> bytes | None:
        frame = recv(self)
        if frame is not None and armed[0] and threading.current_thread().name != "tensorsocket-consumer-io":
            armed[0] = False
            raise KeyboardInterrupt  # (the frame is read)
        return frame

    monkeypatch.setattr(link.Link, "recv", interrupted)
    producer = Producer(NestedLoader(batches, delay=0.01), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, timeout=30) as consumer:
            seen, interrupts = [], []

            def arm(count: int) -> None:
                armed[0] = armed[0] or count == 10  # (the first ones come over ZeroMQ)

            with pytest.raises(ProducerLost, match="failed while it read: KeyboardInterrupt"):
                _through_interrupts(iter(consumer), batches, seen, interrupts, arm)
            assert len(interrupts) == 1
            assert 10 <= len(seen) < batches
    assert errors == []


def test_ctrl_c_as_a_batch_is_taken_from_the_io_threads_queue_never_skips_it(name, monkeypatch):
    """Over ZeroMQ the I/O thread builds each batch and queues it; next() waits on the queue.
    Ctrl-C that came while it waited is raised as queue.get() returns, with the batch taken:
    before, that batch was gone and the next next() gave the one after it (3 of 3 soak runs
    sending real SIGINTs lost batches). After: the interrupted next() loses nothing; the next
    one returns that batch, and the epoch is whole.

    Each Ctrl-C is sent only as the I/O thread handles the batch the caller is waiting for in
    next(). Sent for whichever batch came next (2 in 10 suite runs failed), it landed wherever
    the caller was when the I/O thread had read a batch ahead of a slow step: in the loop's
    body, before it counted the batch it had (the loop then dropped that batch itself:
    "AssertionError: batch 5"), or in some other object's __del__ run by gc (only printed)."""
    monkeypatch.setenv("TENSORSOCKET_SESSION", "0")  # (read by the producer)
    batches = 30
    handle = inbox.Inbox.handle
    armed = [0]
    seen: list[int] = []
    sent: list[int] = []  # (for a failure's message: the batches each Ctrl-C was sent with)

    def interrupting(self: inbox.Inbox, frame: bytes) -> bool:
        kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
        # (caller_inside: next() found nothing queued and waits; the batch is the one it waits for)
        if armed[0] and kind is Kind.BATCH and self.shared.caller_inside and msg["index"] == len(seen):
            armed[0] -= 1
            sent.append(msg["index"])
            _thread.interrupt_main()  # as Ctrl-C does; raised in the main thread at its next check
        return handle(self, frame)

    monkeypatch.setattr(inbox.Inbox, "handle", interrupting)
    # slow enough that next() waits on the queue for most batches
    producer = Producer(NestedLoader(batches, delay=0.05), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, timeout=30) as consumer:
            interrupts: list[int] = []
            printed: list[str] = []  # (what Python only printed)
            hook = sys.unraisablehook  # (the consumer's, delivery._Rescuer: it passes on the rest)
            previous = hook.previous  # type: ignore[attr-defined]
            monkeypatch.setattr(
                hook,
                "previous",
                lambda u: (printed.append(f"{u.exc_type.__name__} in {u.object!r}"), previous(u)),
            )

            def arm(count: int) -> None:
                armed[0] += count in (5, 15)

            # No collection meanwhile: a Ctrl-C landing in a __del__ that gc runs (other tests'
            # garbage) is only printed, as Python does for any finalizer; not what this checks.
            collecting = gc.isenabled()
            gc.disable()
            try:
                _through_interrupts(iter(consumer), batches, seen, interrupts, arm)
            finally:
                if collecting:
                    gc.enable()
            assert len(interrupts) == 2, f"sent with batches {sent}; only printed: {printed}"
            assert seen == list(range(batches))
    assert errors == []


class _RaisingOnce(set):
    """The consumer's set of held seqs, whose ``discard`` raises KeyboardInterrupt (or
    ``kind``) once armed, after discarding: where Ctrl-C lands when its signal came as
    discard() ran in a batch's finalizer (Python raises it as the call returns)."""

    armed = False
    kind: Any = KeyboardInterrupt

    def discard(self, seq: Any) -> None:
        super().discard(seq)
        if self.armed:
            type(self).armed = False
            raise self.kind


def _one_interrupt(consumer: Any, batches: int, arm: Any, kind: Any = KeyboardInterrupt) -> None:
    """Iterate ``consumer`` to its end through the one Ctrl-C ``arm`` sets up (a trace function
    it sets is cleared after): it reaches the loop once, and every batch comes once, in order."""
    seen: list[int] = []
    interrupts: list[int] = []
    try:
        _through_interrupts(iter(consumer), batches, seen, interrupts, arm, kind)
    finally:
        sys.settrace(None)
    assert len(interrupts) == 1 and seen == list(range(batches))


def _interrupt_on_entering(code: Any, armed: list[bool], kind: Any = KeyboardInterrupt) -> Any:
    """A trace function raising KeyboardInterrupt as a function of ``code`` is entered once
    ``armed``: the exception leaves the function before its first line, with its frame in the
    traceback, as Ctrl-C does when Python checks for it at a function's first instruction (for
    :meth:`Releases.fired`, 2 of 36 soak runs sending real SIGINTs)."""

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and armed[0] and frame.f_code is code:
            armed[0] = False
            raise kind

    return trace


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["at-the-start", "before-the-release", "after-the-release"])
def test_ctrl_c_in_a_batchs_finalizer_reaches_the_caller_and_loses_no_release(name, monkeypatch, where, kind):
    """A batch's finalizer runs where its last view is dropped: in a ``for`` loop, as the loop
    variable takes the next batch, in the main thread, where Ctrl-C lands. Python only prints
    an exception raised in a weak reference's callback. Before: the user's Ctrl-C did nothing
    (printed "Exception ignored"), and one that landed before the release was queued (as
    ``id()`` returned, or as ``fired`` began) lost the release: the consumer and the producer
    counted that batch as held for ever. After: the release goes, and the KeyboardInterrupt
    reaches the loop. So does what another signal's handler raises there: SystemExit from a
    SIGTERM handler calling sys.exit() (before, only Ctrl-C's was: this one was printed, the
    program went on, and the release was lost)."""
    batches = 12
    armed = [False]
    if where == "before-the-release":

        def interrupted_id(obj: Any) -> int:
            if armed[0] and sys._getframe(1).f_code.co_name == "fired":  # (build() asks it too)
                armed[0] = False
                raise kind
            return id(obj)

        monkeypatch.setattr(delivery, "id", interrupted_id, raising=False)
    monkeypatch.setattr(_RaisingOnce, "kind", kind)
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, label="c", timeout=30) as consumer:
            live = consumer._shared.live = consumer._batches.turns.inbox.releases.live = _RaisingOnce()

            def arm(count: int) -> None:
                if count == 4:  # batch 3's finalizer runs as the loop takes batch 4
                    armed[0] = where in ("at-the-start", "before-the-release")
                    if where == "at-the-start":
                        sys.settrace(_interrupt_on_entering(delivery.Releases.fired.__code__, armed, kind))
                    _RaisingOnce.armed = where == "after-the-release"

            _one_interrupt(consumer, batches, arm, kind)
            assert not live, live  # every batch dropped was released (queued for the producer)
            assert not [w for w, _ in delivery._WATCHING.values() if w() is None]
    assert errors == []


@pytest.mark.parametrize("where", ["at-the-start", "after-the-release"])
def test_a_bug_in_a_batchs_release_is_printed_and_the_release_goes(name, monkeypatch, where):
    """What is not a stop (an Exception: a bug) in a batch's release callback is printed as
    Python prints it, as before, not raised in the caller's next() (it may come from another
    thread's release, and would stop the training), and the batch is released all the same."""
    batches = 12
    armed = [False]
    monkeypatch.setattr(_RaisingOnce, "kind", RuntimeError)
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, label="c", timeout=30) as consumer:
            live = consumer._shared.live = consumer._batches.turns.inbox.releases.live = _RaisingOnce()
            printed: list[Any] = []
            monkeypatch.setattr(sys.unraisablehook, "previous", lambda u: printed.append(u.exc_type))
            seen: list[int] = []
            try:
                for batch in consumer:
                    assert same(batch, expected_batch(len(seen), batches))
                    seen.append(len(seen))
                    if len(seen) == 4:  # batch 3's release runs as the loop takes batch 4
                        armed[0] = where == "at-the-start"
                        if armed[0]:
                            sys.settrace(
                                _interrupt_on_entering(delivery.Releases.fired.__code__, armed, RuntimeError)
                            )
                        _RaisingOnce.armed = where == "after-the-release"
                    elif len(seen) == 5:
                        sys.settrace(None)
            finally:
                sys.settrace(None)
            del batch
            assert seen == list(range(batches)) and printed == [RuntimeError]
            assert not live and not consumer._shared.interrupted
    assert errors == []


@pytest.mark.parametrize("where", ["as-retire-begins", "after-retire"])
def test_ctrl_c_in_a_gpu_batchs_finalizer_releases_it_once(name, monkeypatch, where):
    """On the GPU path the finalizer hands the batch to its reader's retire(), which releases
    it once the work queued on it ran (here the CPU stand-in's). Before: Ctrl-C landing as
    retire() began lost the release (the entry was taken, nothing queued). Now the rescue
    retires it again, and a batch retired twice (the interrupt came after retire() queued it)
    is still released once."""
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    released: list[int] = []
    ready = delivery.Releases.ready
    monkeypatch.setattr(
        delivery.Releases, "ready", lambda self, item: (released.append(item[0]), ready(self, item))
    )
    batches, armed = 12, [False]
    producer = Producer(NestedLoader(batches), name=name, device="cuda:0", slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, label="c", timeout=30, device="cuda:0") as consumer:
            reader = consumer._batches.turns.inbox.reader
            live = consumer._shared.live = consumer._batches.turns.inbox.releases.live = _RaisingOnce()

            def arm(count: int) -> None:
                if count == 4:  # batch 3's finalizer runs as the loop takes batch 4
                    if where == "as-retire-begins":
                        armed[0] = True
                        sys.settrace(_interrupt_on_entering(type(reader).retire.__code__, armed))
                    _RaisingOnce.armed = where == "after-retire"

            _one_interrupt(consumer, batches, arm)
            assert not live, live
            wait_until(lambda: len(released) >= batches, 10, lambda: f"releases of {sorted(released)}")
            assert sorted(released) == sorted(set(released)), released  # each once
    assert errors == []


def test_the_unraisable_hook_passes_on_what_is_not_an_interrupted_release(monkeypatch):
    """The hook a consumer puts in front of ``sys.unraisablehook`` takes only a stop (Ctrl-C's
    KeyboardInterrupt, ``sys.exit()``'s SystemExit) that left a batch's release callback; any
    other exception a callback or ``__del__`` raised (a KeyboardInterrupt too) reaches the
    hook that was there, as before."""
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))
    delivery.rescue_interrupted_releases()
    delivery.rescue_interrupted_releases()  # (once: not wrapped twice)
    assert isinstance(sys.unraisablehook, delivery._Rescuer)
    assert not isinstance(sys.unraisablehook.previous, delivery._Rescuer)

    class Owner:
        pass

    def failing(exc: type[BaseException]) -> Any:
        def callback(ref: Any) -> None:
            raise exc

        return callback

    for exc in (ValueError, KeyboardInterrupt):
        owner = Owner()
        ref = weakref.ref(owner, failing(exc))
        del owner
        assert ref() is None
    assert seen == [ValueError, KeyboardInterrupt]


def test_ctrl_c_as_the_last_batch_is_let_go_is_raised_by_close(name):
    """A Ctrl-C that lands in a batch's release is raised by the next next(): for the last
    batch, none may come (the loop ended; the program drops the batch and closes). Before,
    it was then never raised; now close() raises it, once closed."""
    batches = 4
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        consumer = Consumer(name=name, timeout=30)
        batch = None
        for batch in consumer:  # noqa: B007 (the last one stays bound after the loop, as it does)
            pass
        armed = [True]
        sys.settrace(_interrupt_on_entering(delivery.Releases.fired.__code__, armed))
        try:
            del batch  # its release callback: the KeyboardInterrupt goes to the consumer's hook
        finally:
            sys.settrace(None)
        assert not armed[0] and not consumer._shared.live
        with pytest.raises(KeyboardInterrupt):
            consumer.close()
        assert not consumer._io.is_alive()
        consumer.close()  # (raised once)
    assert errors == []


@pytest.mark.parametrize("when", ["while-it-waits", "as-it-joined"])
def test_ctrl_c_as_a_consumer_joins_leaves_no_consumer_joined(name, monkeypatch, when):
    """Before: the KeyboardInterrupt left Consumer() with its I/O thread going on: it joined
    (or had), heartbeated and read ahead, and never let go, a consumer no one could close
    (there was no Consumer object); under ``stall`` the other consumer got 2 batches and waited
    for ever. After: the thread is stopped (it leaves), and the other gets every batch."""
    batches = 20
    outcome = handshake.outcome

    def interrupted(results: Any, shared: Any, timeout: float, endpoint: str) -> Any:
        if when == "as-it-joined":
            outcome(results, shared, timeout, endpoint)
        raise KeyboardInterrupt  # (Ctrl-C as the wait for the join returns, or in it)

    # (the default replay budget: the epoch may have begun for the interrupted consumer, and
    # the other, a late joiner then, replays it from its first batch)
    producer = Producer(NestedLoader(batches), name=name, slots=2)
    with serving(producer, epochs=1) as (thread, errors):
        monkeypatch.setattr(handshake, "outcome", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Consumer(name=name, label="interrupted", timeout=3)
        monkeypatch.setattr(handshake, "outcome", outcome)
        assert _consumer_io_threads() == []
        _takes_every_batch(name, batches)
        thread.join(timeout=30)
    assert errors == []


def test_a_second_ctrl_c_in_the_constructors_clean_up_leaves_no_consumer_joined(name, monkeypatch):
    """Before: a second Ctrl-C as Consumer() stopped its I/O thread after the first (here as
    that stop began) left the thread going on: it joined and stayed joined, a consumer nobody
    could close, and under ``stall`` the other consumers waited for ever. Now the clean-up is
    done whole and the first Ctrl-C is raised."""
    batches = 6

    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    # (the default replay budget: the epoch may have begun for the interrupted consumer, and
    # the other, a late joiner then, replays it from its first batch)
    producer = Producer(NestedLoader(batches), name=name, slots=2)
    with serving(producer, epochs=1) as (thread, errors):
        monkeypatch.setattr(handshake, "outcome", interrupted)
        armed = [True]
        sys.settrace(_interrupt_on_entering(wakeup.stop_loop.__code__, armed))
        try:
            with pytest.raises(KeyboardInterrupt):
                Consumer(name=name, label="interrupted", timeout=3)
        finally:
            sys.settrace(None)
        monkeypatch.undo()
        assert not armed[0] and _consumer_io_threads() == []
        _takes_every_batch(name, batches)
        thread.join(timeout=30)
    assert errors == []


def test_a_consumer_thread_stopped_before_it_began_never_joins(name, monkeypatch):
    """Ctrl-C can cut Thread.start() short after the new thread exists but before it runs: it
    has no ident yet, so Consumer()'s clean-up cannot join it, and it ran later. Before, it then
    connected and joined the producer, unseen. Now one that begins after the stop does nothing."""
    run, connect, connected = io_loop.run, handshake.connect, []

    def late(shared: Any, *args: Any) -> None:  # scheduled only once Consumer() stopped it
        deadline = time.monotonic() + 10
        while not shared.stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        run(shared, *args)

    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    def counted(*args: Any) -> Any:
        connected.append(args)
        return connect(*args)

    producer = Producer(NestedLoader(4), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        monkeypatch.setattr(io_loop, "run", late)
        monkeypatch.setattr(handshake, "outcome", interrupted)
        monkeypatch.setattr(handshake, "connect", counted)
        with pytest.raises(KeyboardInterrupt):
            Consumer(name=name, label="interrupted", timeout=3)
        for io in _consumer_io_threads():
            io.join(timeout=10)
        monkeypatch.undo()
        assert connected == [] and _consumer_io_threads() == []
        assert producer.status()["consumers"] == []
        _takes_every_batch(name, 4)
        thread.join(timeout=30)
    assert errors == []


def test_ctrl_c_in_close_leaves_it_to_the_next_close(name):
    """Before: close() marked the consumer closed first, so one cut short by Ctrl-C (here as
    it set the I/O thread's stop) left it joined, and every later close() did nothing: under
    ``stall`` the other consumer waited for ever. Now the next close() does it whole."""
    batches = 20
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0, min_consumers=2)
    with serving(producer, epochs=1) as (thread, errors):
        first = Consumer(name=name, label="first", timeout=3)
        other = threading.Thread(target=_takes_every_batch, args=(name, batches), daemon=True)
        other.start()
        wait_until(lambda: len(producer.status()["consumers"]) == 2, 10, "both consumers to join")
        armed = [True]
        sys.settrace(_interrupt_on_entering(threading.Event.set.__code__, armed))
        try:
            with pytest.raises(KeyboardInterrupt):
                first.close()
        finally:
            sys.settrace(None)
        assert not armed[0] and first._io.is_alive()  # (cut short before it stopped the thread)
        first.close()
        assert not first._io.is_alive()
        other.join(timeout=30)
        assert not other.is_alive(), "the other consumer waited on the closed one"
        thread.join(timeout=30)
    assert errors == []


def test_ctrl_c_as_next_ends_its_wait_leaves_the_iterator_free_for_another_thread(name, monkeypatch):
    """next() notes which thread is in it, to refuse a second one at once. Before, a Ctrl-C
    raised as the wait's last clock reading returned left that note, so every next() from
    another thread raised RuntimeError ("in another thread") for good."""
    batches = 6
    armed = [False]
    real = iteration.time.monotonic

    def monotonic() -> float:
        now = real()
        if armed[0] and sys._getframe(1).f_code.co_name == "_waited":
            armed[0] = False
            raise KeyboardInterrupt
        return now

    monkeypatch.setattr(iteration.time, "monotonic", monotonic)
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, epochs=1) as (thread, errors):
        with Consumer(name=name, timeout=30) as consumer:
            it = iter(consumer)
            assert same(next(it), expected_batch(0, batches))
            armed[0] = True
            with pytest.raises(KeyboardInterrupt):
                next(it)  # (batch 1, taken: the next next() returns it)
            assert not armed[0]
            taken: list[bool] = []

            def take_the_rest() -> None:
                for batch in it:
                    taken.append(same(batch, expected_batch(len(taken) + 1, batches)))

            other = threading.Thread(target=take_the_rest, daemon=True)
            other.start()
            other.join(timeout=30)
            assert taken == [True] * (batches - 1)
    assert errors == []


def _consumer_io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tensorsocket-consumer-io"]


def _takes_every_batch(name: str, batches: int) -> None:
    """A consumer of ``name`` in this thread gets every batch of the epoch, in order."""
    got = []
    with Consumer(name=name, label="other", timeout=3) as consumer:
        for batch in consumer:
            got.append(same(batch, expected_batch(len(got), batches)))
    assert got == [True] * batches


def test_a_loop_whose_start_was_cut_short_is_stopped_all_the_same():
    """Ctrl-C can cut Thread.start() short before the new thread runs: Consumer() then stops it
    as it stops a started one (joining it raised RuntimeError, so it was skipped, and the thread
    began later and joined the producer). Its stop is set, so it ends as it begins."""
    from tensorsocket.wakeup import Wakeup, stop_loop

    stop, wakeup, ran = threading.Event(), Wakeup(), []
    thread = threading.Thread(target=lambda: ran.append(stop.is_set()), daemon=True)
    stop_loop(stop, wakeup, thread)  # (not started: no join, no error)
    thread.start()
    thread.join(timeout=10)
    wakeup.close()
    assert ran == [True]
