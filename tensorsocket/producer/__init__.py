"""The producer, split along its two threads: ``facade`` (the public Producer), ``publisher``
(the caller's thread: pull, write, publish), ``io_loop`` (the I/O thread and its socket) and
``shared`` (the one record they share, and who writes what)."""

from ..options import STRAGGLERS
from .facade import Producer, default_replay_bytes

__all__ = ["STRAGGLERS", "Producer", "default_replay_bytes"]
