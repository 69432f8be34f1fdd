"""The caller's thread reads its own batches while it waits in next() for one.

Why: on the I/O thread, a batch costs three wake-ups: that thread's for the message, the
caller's for the hand-off through the queue, and that thread's again for the release. On a
2-core VM, each is tens of microseconds of CPU, more than the Python that builds the batch
(``python3 -m benchmarks.wakeup_floor``: a thread blocked on a Unix socket pays 6 us per
message, a poll loop handing each message to another thread and woken back for its release
57 us). So while the caller waits in next() for a batch of host memory over a session, it
reads the session itself, under ``Shared.link_lock``, and sends what it released before it
sleeps: one wake-up per batch. The I/O thread only ticks (every TICK: heartbeats, STATS,
liveness), and at each tick while the caller is away from next() (a training step) it reads
ahead what came meanwhile (the next batches, an eviction), so next() after a step finds its
batch built. It is not woken per message: after a 20 ms step each wake-up of a thread cost
~250 us of CPU here, more than the batch itself, and three of them (the message, the release,
the end of a hand-over) made a consumer ~1 ms of CPU a batch. A release wakes it only when the
producer may be waiting for it (:meth:`~tensorsocket.consumer.shared.Sleeping.wants`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import yielding
from ..errors import Closed, ProducerLost
from .inbox import Inbox
from .shared import TICK, Shared

log = logging.getLogger("tensorsocket")

_TICK_MS = int(TICK * 1000)
#: Releases held back: sent four to a message, or sooner when the producer may be waiting for
#: them (Sleeping.wants), and always before a wait for the next message; while batches come
#: back to back (the last wait for one took under _QUICK) that wait first holds them _HELD_MS
#: for the next message. (The producer's I/O thread reads each message: four to a message
#: instead of two gave its CPU per batch 0.87x with 1 consumer and 0.83x with 4,
#: protocol_cost-vm-2026-11-24-caller-turns.json.) The hold only while batches come quickly:
#: after a training step it was a timer wake-up of the caller's thread per batch.
_HOLD_RELEASES = 3
_HELD_MS = 1
#: (a wait as SCHED_BATCH, yielding.poll, on a machine with no idle CPU can take a tick, 4 ms: not quick)
_QUICK = 0.002  # seconds


class CallerTurns:
    """The caller's side of the link; used by the caller's thread only."""

    def __init__(self, shared: Shared, inbox: Inbox, io: threading.Thread, endpoint: str) -> None:
        self.shared, self.inbox, self.io, self.endpoint = shared, inbox, io, endpoint
        self._fd = -1
        self._poll = select.poll()
        self._quick = False  # the last wait for a message took under _QUICK
        # Queue items are taken into ``held`` by C code alone (see _pull), whence this thread
        # takes them without a call: Ctrl-C is raised as a call returns, so one raised as
        # queue.get() returned a batch dropped it, and the next next() gave the batch after it.
        self.held: collections.deque[tuple[str, Any]] = collections.deque()
        self._now = iter(shared.queue.get_nowait, None)  # (an item is never None)
        self._tick = iter(functools.partial(shared.queue.get, timeout=TICK), None)

    def take(self, check: Callable[[], None]) -> tuple[str, Any]:
        """Block for the next queue item (reading the link for it when this thread may), with
        the checks that make a wait finite: every TICK, that the I/O thread is alive, and
        ``check()`` (that this consumer is not waiting for a batch it can never get)."""
        shared = self.shared
        item = None if not self.held and shared.queue.empty() else self._queued()  # (a call less)
        if item is not None:  # read ahead: if the I/O thread went to sleep long, it reads on
            sleeping = shared.io_sleeping
            if sleeping.long and sleeping.now and not sleeping.reading:
                shared.wakeup.wake()
            return item
        shared.caller_inside = True
        try:
            return self._wait(check)
        finally:
            shared.caller_inside = False

    def _wait(self, check: Callable[[], None]) -> tuple[str, Any]:
        shared, checked = self.shared, time.monotonic()
        while True:  # (take() found the queue empty: a turn comes first)
            turned = self.turn()
            item = self._queued()
            if item is not None:
                return item
            if turned is None:
                item = self._pull(self._tick)
                if item is not None:
                    return item
            elif turned and time.monotonic() - checked < TICK:
                continue
            checked = time.monotonic()
            if not self.io.is_alive():
                item = self._pull(self._now)  # what it queued just before it stopped (the reason) first
                if item is not None:
                    return item
                if shared.stop.is_set():
                    raise Closed(f"consumer of {self.endpoint} is closed")
                raise ProducerLost(f"the consumer's I/O thread for {self.endpoint} stopped")
            check()

    def _queued(self) -> tuple[str, Any] | None:
        """The next queue item, None if there is none (an item is never None). The queue is
        asked first: raising queue.Empty for every batch cost more than asking."""
        if not self.held and self.shared.queue.empty():
            return None
        return self._pull(self._now)

    def _pull(self, source: Any) -> tuple[str, Any] | None:
        """The next item (``source``: ``_now`` or ``_tick``, which waits a TICK), None if none
        came. deque.extend() runs the get in C, so an interrupt is raised only once the item is
        in ``held``: the next call returns it."""
        held = self.held
        if not held:
            try:
                held.extend(itertools.islice(source, 1))
            except queue.Empty:  # (or close() from another thread took it meanwhile)
                return None
        item = held[0]
        del held[0]  # (no call: nothing can be raised between taking it and returning it)
        return item

    def read_waiting(self) -> None:
        """Read what the producer sent after the batch about to be yielded (a group member's):
        a GroupBroken that came during the training step is then raised now, before that
        batch, which was read ahead or sent before it; else it came one batch late, and a DDP
        rank ran a step its lost peer never began."""
        shared, inbox = self.shared, self.inbox
        if not inbox.caller_may_read():
            return  # (read unlocked: it may change, and is asked again) the I/O thread reads them
        if not _lock(shared.link_lock, 0):
            return  # the I/O thread is reading them (building a batch, say: a copy takes ms)
        try:
            if inbox.caller_may_read() and not self._guarded(inbox.receive):
                inbox.over = True  # (EVICTED, say: the I/O thread stops at its next turn)
        finally:
            shared.link_lock.release()

    def turn(self) -> bool | None:
        """Wait at most about TICK for the producer's next message, reading it in this thread.
        None: this thread may not read now (the I/O thread reads; wait on the queue instead).
        True: a message was read or is waiting (look at the queue again). False: TICK passed."""
        shared, inbox = self.shared, self.inbox
        if not _lock(shared.link_lock):
            return None  # the I/O thread is busy for a while (joining a successor, say)
        try:
            if not inbox.caller_may_read():
                return None
            if not shared.queue.empty():
                return True  # the I/O thread read it
            released = shared.released
            if released and (
                len(released) > _HOLD_RELEASES or shared.io_sleeping.wants(shared.live, released)
            ):
                self._guarded(inbox.send_releases)
            try:  # (what _guarded does, a call less a batch; the read too: Ctrl-C as the
                # datagram came, raised as recv() returned, lost that batch without a word)
                frame = inbox.link.recv()
                handled = frame is None or inbox.handle(frame)
            except BaseException as exc:
                frame, handled = b"", self._failed(exc)
            if frame is not None:
                if not handled:
                    inbox.over = True  # (EVICTED, say: the I/O thread stops at its next turn)
                return True
            if inbox.link.closed:
                shared.wakeup.wake()  # (it may sleep long): it finds out why
                return None
            fd = inbox.link.conn.fd  # type: ignore[union-attr]
        finally:
            shared.link_lock.release()
        self._watch(fd)
        if shared.released:  # none may wait with us: a group's ranks each hold other places
            if self._quick and yielding.poll(self._poll, _HELD_MS):
                return True  # batches come back to back: these go with the next ones
            if not _lock(shared.link_lock):
                return None
            try:
                if inbox.caller_may_read():
                    self._guarded(inbox.send_releases)
            finally:
                shared.link_lock.release()
        if not shared.queue.empty():
            return True
        started = time.monotonic()
        ready = bool(yielding.poll(self._poll, _TICK_MS))
        self._quick = time.monotonic() - started < _QUICK
        return ready

    def _watch(self, fd: int) -> None:
        if fd != self._fd:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)
            self._fd = fd

    def _guarded(self, step: Callable[..., Any], *args: Any) -> Any:
        """Run a step that reads or releases for the I/O thread. Failed or interrupted half-way
        (Ctrl-C lands in this thread; an OSError mapping an arena), a message was read and not
        handled or releases taken and not sent: this consumer can no longer be exact, so its
        stream ends here (next() raises ProducerLost; leaving gives the producer its places
        back). An interrupt goes on up; an error is logged, as the I/O thread's were."""
        try:
            return step(*args)
        except BaseException as exc:
            return self._failed(exc)

    def _failed(self, exc: BaseException) -> bool:
        """A step failed with ``exc`` (see :meth:`_guarded`): end the stream, leave, say so."""
        self.inbox.over = True
        why = f"consumer of {self.endpoint} failed while it read: {type(exc).__name__}: {exc}"
        self.shared.fail(ProducerLost(why))
        # Leave at once: the producer takes back the places we held (link_lock is ours; a
        # link's send never raises, a gone producer's message is dropped).
        self.inbox.link.send(self.shared.bye())
        if not isinstance(exc, Exception):
            raise exc
        log.error("%s", why, exc_info=exc)
        return False


def _lock(lock: threading.RLock, timeout: float = TICK) -> bool:
    """``lock.acquire(timeout=timeout)``, never left held by an interrupt. Ctrl-C lands in this
    thread, and Python raises it as a call returns: right after acquire() took the lock, before
    the caller's ``try`` began, it left the lock held for ever (the I/O thread then waited for it,
    so the producer evicted us, and next() waited past every timeout). Hence an RLock: it knows
    whether this thread holds it."""
    try:
        return lock.acquire(timeout=timeout)
    except BaseException:
        if lock._is_owned():  # type: ignore[attr-defined]
            lock.release()
        raise
