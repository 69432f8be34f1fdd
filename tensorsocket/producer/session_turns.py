"""The caller's (publishing) thread reads its consumers' sessions itself while it publishes.

Why: each message a consumer sends wakes the I/O thread, which reads it and hands the place
it frees to the publishing thread through the condition: with tiny batches on the 2-core VM
that thread cost 26 us of the producer's 97 us per batch with 1 consumer, and 54 of 170 with
4; the one-thread prototype of ``benchmarks.lean_path``, which reads releases only when it
needs a place, cost 0.81x and 0.71x the producer's CPU (``lean_path-vm-2026-11-24.json``).

So in its turn, the publishing thread reads the sessions under the lock: before it asks for
each batch's place, and while it waits for one (asleep in ``poll()`` on the connections and
on ``Shared.publisher_wakeup``, which the I/O thread pokes for what it applied itself: a
release over ZeroMQ, a consumer that left). Its turn lasts while it waits, and ``HANDOVER``
after it last read; meanwhile the I/O thread polls no connection for its messages. The
publishing thread applies only RELEASE, STATS and HEARTBEAT; anything else (a BYE, a bad
message, the connection's end) it leaves, and what follows on that connection, to the I/O
thread, which reads what was left first, and it takes no place until that is applied. Every
read is made and applied under the lock, so a consumer's messages are applied in order
whichever thread reads them. Once the publishing thread is away longer than ``HANDOVER`` (in
the loader), the I/O thread reads again from its next poll (at most its TICK later; sooner
after it left a message to the publishing thread's turn), so liveness and late messages are
as before; the publisher's other waits hand the sessions back when they begin to wait. The
I/O thread also reads every session before a ZeroMQ message in the turn, so what a consumer
sent before another's HELLO (a BYE) is applied first.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable

from .. import protocol
from ..errors import ProtocolError
from .sessions import Sessions
from .shared import TICK_MS, Shared

HANDOVER = 0.005  # seconds after the publishing thread last read that its turn lasts
_MOST_ROUNDS = 1000  # polls of the sessions in one drain (each reads a message from each ready one)


def publisher_turn(shared: Shared) -> bool:
    """Is it the publishing thread's turn at the sessions? (Read without the lock: a stale
    answer costs the I/O thread one needless wake-up, or a read one poll later.)"""
    return shared.publisher_polling or time.monotonic() - shared.publisher_at < HANDOVER


class SessionTurns:
    """The publishing thread's reads; used by that thread only, :meth:`drain` under the lock."""

    def __init__(self, shared: Shared, sessions: Sessions) -> None:
        self.shared, self.sessions = shared, sessions
        self._poll = select.poll()
        self._version = -1  # the sessions' version _poll was made for

    def drain(self) -> bool:
        """Apply what the consumers sent over their sessions (lock held); begins or extends
        the turn. A release that lets a batch go to a consumer on ZeroMQ wakes the I/O thread.
        False while a message left to the I/O thread waits for it (the caller waits too).

        One message per session at a time, polling again until none has one: reading a
        session until ``recv()`` failed raised an exception for every message (releases
        come four to one), ~2.3 us in a hot loop against ~0.6 us for a poll."""
        shared, sessions = self.shared, self.sessions
        shared.publisher_at = time.monotonic()
        if self._version != sessions.version:
            self._watch()
        if not sessions.cid_of:
            return True
        for _ in range(_MOST_ROUNDS):  # (under a flood, the rest at the next look: ticks still run)
            if self._version != sessions.version:
                self._watch()  # (a message was left to the I/O thread: its connection is not polled)
            ready = [fd for fd, _ in self._poll.poll(0) if fd in sessions.cid_of]
            if not ready:
                break
            for fd in ready:  # (reading one leaves the others as they were: only it may be stashed)
                self._read(fd)
        if shared.io_wanted:
            shared.wakeup.wake()
        return not sessions.stashed

    def _watch(self) -> None:
        """Poll the connections the I/O thread has not been left a message on, and the poke."""
        shared, sessions = self.shared, self.sessions
        self._poll = select.poll()
        self._poll.register(shared.publisher_wakeup.fd, select.POLLIN)
        for fd in sessions.cid_of:
            if fd not in sessions.stashed:  # (the I/O thread reads that one now)
                self._poll.register(fd, select.POLLIN)
        self._version = sessions.version

    def _read(self, fd: int) -> None:
        """Apply ``fd``'s messages up to the first that is not routine; leave that one, and all
        after it (the connection's end too), to the I/O thread."""
        shared, sessions = self.shared, self.sessions
        cid = sessions.cid_of[fd]
        frames, closed = sessions.read(fd, 1)  # (none stashed: a stashed fd is not polled here)
        now, applied = time.monotonic(), 0
        for frame in frames:
            try:
                kind, msg = protocol.decode(frame)
            except ProtocolError:
                break
            if not shared.apply_routine(cid, kind, msg, now):
                break
            applied += 1
        if applied == len(frames) and not closed:
            return
        sessions.stashed[fd] = frames[applied:] + ([b""] if closed else [])  # the I/O thread's
        sessions.version += 1
        shared.wakeup.wake()

    def wait(self, reserved: Callable[[], bool], check: Callable[[], None]) -> None:
        """Wait until ``reserved()`` got a batch its place, reading the sessions meanwhile;
        ``check()`` each TICK (it raises to end the wait: the producer closed, say)."""
        shared = self.shared
        try:
            while True:
                with shared.lock:
                    shared.publisher_polling = False
                    # (not while a message left to the I/O thread waits: a BYE changes who is sent what)
                    if self.drain() and reserved():
                        return
                    check()
                    shared.publisher_polling = True  # (under the lock: no poke after it is missed)
                self._poll.poll(TICK_MS)  # a consumer's message, a poke, or a tick
                shared.publisher_wakeup.drain()
        finally:  # (a signal's exception too: the I/O thread must read the sessions again)
            shared.publisher_polling = False
