"""What the consumer's caller's thread and its I/O thread share: one record, each field with
one writer (or a thread-safe container), as listed here.

* ``queue`` (SimpleQueue): the I/O thread puts built batches, epoch and stream markers and
  errors, in the order they arrived; the caller's thread takes them.
* ``released`` (deque): release callbacks append (any thread: a batch's last view can die
  anywhere, and a GPU reader calls back from its waiter thread); the I/O thread pops.
* ``live`` (set of seqs handed out and not yet dropped): the caller's thread adds at
  hand-out; finalizers discard, in any thread (set.add / discard / len are atomic under the GIL).
* ``violations`` (deque): the I/O thread appends a message when a batch changed while held;
  the caller's thread pops it and raises BatchModified.
* ``interrupted`` (deque): a batch's finalizer appends the exception that landed in it
  (Ctrl-C's, or another signal handler's: Python only prints an exception raised there); the
  caller's next ``next()``, or ``close()``, raises it before it takes anything.
* ``cut_off``, ``cut_until``, ``stream_over``, ``missed``: whichever thread handles the producer's messages,
  under ``link_lock`` (the I/O thread, or the caller's thread reading for itself); ``io_tick``:
  the I/O thread only. The caller's thread reads them.
* ``synced`` (Event): the I/O thread clears it after a freeze and sets it at the answer.
* ``starts_with``: the I/O thread, from each WELCOME: the consumers the producer waited for
  before its first batch when this one joined (None: it had started).
* ``ready``: a group member's READY to send (its restored position or None, in a list), set
  once by the caller's thread when it begins iterating; the I/O thread sends it once.
* ``taken_batches``, ``taken_samples``, ``waiting``, ``wait_started``: the caller's thread
  only; the I/O thread reads them for its STATS reports. ``epoch_done``: the caller's thread;
  every BYE says it (:meth:`Shared.bye`).
* ``stop`` (Event): close() sets it; ``wakeup``: any thread pokes it.
* ``link_lock``: held by whichever thread uses the link and the state the producer's messages
  change (:class:`~tensorsocket.consumer.inbox.Inbox`): the I/O thread for each turn, the
  caller's thread while it reads for itself (:mod:`~tensorsocket.consumer.caller_turn`).
* ``caller_inside``: the caller's thread only: whether it is in next().
* ``io_sleeping``: the I/O thread only: whether it sleeps in its poll and reads the link itself,
  and the producer's window (a release it must send wakes it: :meth:`Sleeping.wants`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import protocol
from ..errors import BatchModified
from ..protocol import Kind
from ..wakeup import Wakeup

TICK = 0.05  # seconds: the longest any wait goes without re-checking why it waits

# Queue item kinds
BATCH, SKIPPED, EPOCH_END, END, ERROR = "batch", "skipped", "epoch_end", "end", "error"
RESTARTED = "restarted"  # a rejoined producer starts our epoch again: (new stream, batches again)


@dataclass(frozen=True)
class Settings:
    """A consumer's settings, fixed at construction; read by both threads."""

    endpoint: str
    label: str
    timeout: float
    prefetch: int
    late_join: str
    batch_size: int | None
    device: Any
    stream: Any
    copy: bool
    check_writes: bool = False
    group: tuple[str, int, int, str] | None = None  # (name, rank, world size, tail)
    resume: tuple[str, int, int] | None = None  # a restored position: (stream, epoch, index)
    reconnect: float = 0.0  # seconds to wait for a successor when the producer is lost
    key_folder: Path | None = None  # CURVE keys (tensorsocket.keys): an endpoint beyond loopback
    curve_keys: tuple[bytes, bytes, bytes] | None = None  # read from key_folder (keys.client_keys)


class Sleeping:
    """Whether the I/O thread sleeps in its poll, whether it reads the link itself, and the
    producer's window: a box of its own, as a batch's finalizer must not hold the shared
    record (which holds the queued batches)."""

    __slots__ = ("now", "reading", "long", "window")

    def __init__(self) -> None:
        self.now = self.reading = self.long = False  # long: past its next TICK
        self.window = 1

    def wants(self, live: set[int], released: collections.deque[Any]) -> bool:
        """Whether a release must reach the producer now, not at the I/O thread's next tick
        or the caller's next read: when the I/O thread reads the link (the caller's thread
        sends nothing), or when this consumer holds nearly the whole window (the producer may
        wait for that place to publish the batch we want next; the window is the producer's
        slots, or this consumer's prefetch if smaller). Otherwise the wake-up would
        cost more CPU than the batch (~250 us on a 2-core VM after a 20 ms step)."""
        return self.reading or len(live) + len(released) >= self.window - 1


@dataclass
class Shared:
    """The record both threads share (see the module docstring for who writes what)."""

    queue: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    released: collections.deque[tuple[Any, ...]] = field(default_factory=collections.deque)
    live: set[int] = field(default_factory=set)
    interrupted: collections.deque[BaseException] = field(default_factory=collections.deque)
    violations: collections.deque[str] = field(default_factory=collections.deque)
    wakeup: Wakeup = field(default_factory=Wakeup)
    stop: threading.Event = field(default_factory=threading.Event)
    synced: threading.Event = field(default_factory=threading.Event)
    # Evicted, or a GroupBroken: raised instead of yielding any batch still queued of an epoch
    # after ``cut_until`` (a GroupBroken's: the epoch its lost rank finished; else -1, none)
    cut_off: Exception | None = None
    cut_until: int = -1
    stream_over: bool = False  # END or an error arrived: the producer may now go away
    io_tick: float = field(default_factory=time.monotonic)  # when the I/O thread's poll last returned
    taken_batches: int = 0
    taken_samples: int = 0
    waiting: float = 0.0
    wait_started: float | None = None  # inside next() since then: a wait in progress counts
    epoch_done: int | None = None  # the epoch whose end the trainer took, nothing taken since
    ready: list[Any] | None = None
    starts_with: int | None = None
    join_deadline: float | None = None  # the handshake's, once a preparing successor's heartbeats moved it
    missed: int = 0  # batches lost at rejoins (the I/O thread counts; Consumer.missed adds them)
    link_lock: threading.RLock = field(default_factory=threading.RLock)  # (an RLock: see caller_turn._lock)
    caller_inside: bool = False
    io_sleeping: Sleeping = field(default_factory=Sleeping)

    def __post_init__(self) -> None:
        self.synced.set()

    def raise_noted(self) -> None:
        """The caller's thread, in next(): raise the exception a batch's finalizer caught, or
        BatchModified for the first batch found changed (each logged as found)."""
        self.raise_interrupted()
        violations, first, more = self.violations, None, 0
        while violations:
            message = violations.popleft()
            first, more = (message, more) if first is None else (first, more + 1)
        if first is not None:
            raise BatchModified(first if not more else f"{first} ({more} more changed since: see the log)")

    def raise_interrupted(self) -> None:
        """Raise the exception a batch's finalizer caught (the first, if more came), if any."""
        interrupted = self.interrupted
        if interrupted:  # (no name for it here: this frame, in its traceback, would hold it,
            # a cycle keeping the caller's frames, and the batches in them, until a collection)
            while len(interrupted) > 1:
                interrupted.pop()
            raise interrupted.popleft().with_traceback(None)  # (the finalizer's frames: no use)

    def bye(self) -> bytes:
        """The BYE that leaves the producer, saying whether the trainer stopped at an epoch's
        end: if it did, the other ranks of its group may still finish that epoch."""
        return protocol.encode(Kind.BYE, epoch_done=self.epoch_done)

    def fail(self, exc: Exception) -> None:
        """The I/O thread ends this consumer's stream with ``exc`` (raised by next())."""
        self.stream_over = True
        self.queue.put((ERROR, exc))
