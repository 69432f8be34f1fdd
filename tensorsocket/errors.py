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


class Closed(TensorSocketError):
    """The producer or consumer was closed (possibly from another thread) and cannot be used.

    A producer's ``serve()`` or ``for batch in producer`` loop ends quietly when ``close()``
    was asked for; this is raised to a caller that goes on using a closed object.
    """


class Hoarding(TensorSocketError):
    """The consumer holds every batch it may hold and asks for another, which can never come.

    Drop references to old batches, use ``Consumer(copy=True)``, or give the producer more
    slots.
    """


class Refused(TensorSocketError):
    """The producer answered the consumer's HELLO with a refusal; the message says why
    (another transport, another machine, a protocol mismatch)."""


class GroupBroken(TensorSocketError):
    """Another member of this consumer's group (a rank of the same distributed job) left or
    died: the group's shares can no longer be equal, so nothing more is sent to it.

    Raised at the next ``next()`` (after the epoch end, if the lost rank had finished that
    epoch). A job restarted as a whole (torchrun's elastic restart) joins again as a new group.
    """


class IoThreadDied(TensorSocketError):
    """A side's background I/O thread stopped on an unexpected error (logged with its
    traceback); the producer or consumer can no longer send or receive."""


class StateFileError(TensorSocketError, ValueError):
    """``Producer(resume=True)``: the name's state file is damaged, or was saved over another
    loader; the message says which and names the file (remove it to begin a fresh stream)."""


class KeysError(TensorSocketError, ValueError):
    """An endpoint beyond loopback needs CURVE keys (:mod:`tensorsocket.keys`) that are missing
    or damaged; the message names the file and how to get the folder."""


class GpuPathError(TensorSocketError):
    """No way exists to get the producer's GPU batches to this consumer; says why and what to do."""
