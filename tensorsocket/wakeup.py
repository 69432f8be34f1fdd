"""A self-pipe that any thread (or a finalizer) can poke to wake a zmq poll loop at once."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Wakeup:
    """``wake()`` is safe from any thread, never blocks and never raises after ``close()``;
    the loop thread polls ``fd`` with its zmq.Poller and calls ``drain()``.

    The pipe is closed by ``close()`` or, at the latest, when the last reference to this
    object goes: batch finalizers hold one, so a pipe is never closed under a late ``wake()``.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.fd = self._r
        self._finalizer = weakref.finalize(self, _close_fds, self._r, self._w)

    def wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake-up is already pending) or closed

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._r = self._w = -1
        self._finalizer()  # closes the pipe once


def stop_loop(
    stop: threading.Event,
    wakeup: Wakeup,
    thread: threading.Thread,
    timeout: float = 2.0,
    gate: threading.Lock | None = None,
) -> None:
    """Stop a poll loop thread: set its stop event, wake it, and join it (never from itself).
    Also run at interpreter exit, so zmq is not torn down under a daemon thread still using a
    socket (that aborts the process). ``gate``: the lock the thread checks the stop under as it
    begins (:func:`begins`), for a stop that may come before it did."""
    with gate if gate is not None else contextlib.nullcontext():
        stop.set()
    wakeup.wake()
    # (a thread not started yet, its start() cut short by Ctrl-C, stops as it begins)
    if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(timeout=timeout)


def begins(stop: threading.Event, gate: threading.Lock) -> bool:
    """A loop thread's first step: False if it was stopped (under ``gate``) before it began.
    One whose ``start()`` a Ctrl-C cut short may begin after its stop, unjoined (it had no
    ident yet): it must not bind or connect then, with nobody left to close what it opens."""
    with gate:
        return not stop.is_set()


def done_whole(step: Callable[[], None]) -> None:
    """Run ``step`` (a stop and free, idempotent) to its end, again whenever a Ctrl-C cuts it
    short: for a constructor's clean-up after its own failure, which nothing can finish later
    (there is no object to close), so a second Ctrl-C must not leave a thread serving unseen."""
    while True:
        try:
            step()
            return
        except KeyboardInterrupt:
            continue
