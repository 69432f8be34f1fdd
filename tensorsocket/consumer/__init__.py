"""The consumer, split along its two threads: ``facade`` (the public Consumer),
``iteration`` (the caller's thread: the next batch, epochs, skips, hoarding), ``io_loop``
(the I/O thread: handshake, socket, releases), ``delivery`` (a BATCH into a user batch and
its release) and ``shared`` (the one record the threads share, and who writes what)."""

from .facade import Consumer

__all__ = ["Consumer"]
