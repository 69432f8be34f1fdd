"""The exceptions tensorsocket raises: one base class, one subclass per thing a caller can act on."""

from __future__ import annotations


class TensorSocketError(Exception):
    """Base class of every error tensorsocket raises on purpose."""


class ProtocolError(TensorSocketError):
    """A message was malformed, of an unknown kind, or spoke another protocol version."""


class ProducerLost(TensorSocketError):
    """The producer stopped answering, died, or closed before the stream ended.

    Raised by a consumer instead of blocking: within its ``timeout`` when the producer goes
    silent, sooner when it is on the same host and its process is gone.
    """


class Evicted(TensorSocketError):
    """The producer dropped this consumer (it was silent for longer than its ``timeout``).

    The producer has already released everything this consumer held and moved on; create a
    new ``Consumer`` to join again.
    """


class BatchModified(TensorSocketError):
    """A shared batch changed in memory while this consumer held it.

    Shared batches are read-only: every trainer reads the same memory, so an in-place op
    (``x.sub_(mean)``, ``x /= 255``) corrupts the others' data.
    """
