"""A self-pipe that any thread (or a finalizer) can poke to wake a zmq poll loop at once."""

from __future__ import annotations

import os


class Wakeup:
    """``wake()`` is safe from any thread, never blocks and never raises after ``close()``;
    the loop thread polls ``fd`` with its zmq.Poller and calls ``drain()``."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.fd = self._r

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
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1
