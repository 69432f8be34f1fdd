"""The interface every transport implements: the producer's store of places and the
consumer's reader of them. Nothing above this layer knows which transport runs.

A *place* is an arena index (window places plus replay places); a batch is written into one
place and read in place by every consumer. Arena descriptors travel on the wire as lists
tagged by the transport (``["shm", place, ...]``, ``["cuda", place, ...]``) and only that
transport decodes them, strictly.

Producer side, :class:`Store`: :meth:`~Store.prepare` a place's arena (slow: outside the
producer's lock), :meth:`~Store.install` it (under the lock; the descriptor to announce),
:meth:`~Store.write` a batch and get a :class:`Receipt` (``wait()`` returns once the bytes are
where consumers read them, with the batch's fingerprint), :meth:`~Store.describe` the arenas
to a joining consumer, :meth:`~Store.admit` or refuse a consumer's HELLO (and say which
transport it reads: a GPU store serves a consumer that cannot open CUDA IPC handles from a
host-memory mirror of its places), :meth:`~Store.close`.

Consumer side, :class:`Reader`: :meth:`~Reader.announce` an arena, :meth:`~Reader.lease` a
place's region (the owner object behind the views: it is collected when the last view dies),
:meth:`~Reader.deliver` the rebuilt views as the user's batch (views, or copies on another
device), :meth:`~Reader.retire` a region whose views died (calls back once it may be
released: at once on the host, after the consumer's GPU work on it on a GPU),
:meth:`~Reader.fingerprint` it, :meth:`~Reader.close`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ProtocolError
from ..layout import Plan


class Receipt:
    """A write that may still be in flight. ``wait()`` blocks until it completed where
    consumers read it and returns the batch's fingerprint (None: not checked)."""

    def __init__(self, fingerprint: int | None) -> None:
        self._fingerprint = fingerprint

    def wait(self) -> int | None:
        return self._fingerprint


@dataclass
class Lease:
    """A batch's region in a place, as this consumer reads it.

    ``region`` is a flat uint8 tensor over the batch's bytes (on the host, a NumPy array:
    views are made from it in fewer, quicker steps); every view is made from it.
    ``owner`` is the object that owns the region's memory: it is collected exactly when the
    last view (or anything derived from one) dies, so the release finalizer hangs on it.
    ``token`` is what the reader needs afterwards (fingerprint, retire); it must not
    reference ``owner``."""

    region: torch.Tensor | np.ndarray
    owner: object
    token: Any


@dataclass(frozen=True)
class Room:
    """Arenas of one size that fit in the memory a store allocates from."""

    fits: int  # how many
    arena_bytes: int  # what one takes
    free_bytes: int  # what is free
    where: str  # the memory, as a user knows it ("/dev/shm")
    remedy: str  # how to get more of it, for the error or warning that says it ran short


class Store(abc.ABC):
    """Producer side: the places batches are written into. Every method but :meth:`write`
    is called under the producer's lock or from its I/O thread; :meth:`write` and
    :meth:`prepare` run on the caller's thread outside the lock."""

    #: the tag of this transport's arena descriptors on the wire
    kind: str
    #: bytes of arena memory held (reported in status)
    bytes: int
    #: where the arenas live, as the producer names it ("cpu", "cuda:0")
    device: str = "cpu"
    #: the UUID of the GPU holding the arenas (None on the host)
    gpu: str | None = None

    @abc.abstractmethod
    def prepare(self, place: int, nbytes: int) -> Any | None:
        """A new arena for ``place`` if its current one cannot hold ``nbytes`` (else None)."""

    @abc.abstractmethod
    def install(self, prepared: Any) -> list[list[Any]]:
        """Put a prepared arena in its place (freeing the one it replaces); its descriptors,
        one per transport this store serves (each tagged: a consumer gets its own kind's)."""

    @abc.abstractmethod
    def write(self, place: int, plan: Plan, fingerprint: bool = True) -> Receipt:
        """Start writing ``plan``'s leaves into ``place`` (already prepared). ``fingerprint``:
        whether a consumer will check one (a store may compute it anyway)."""

    @abc.abstractmethod
    def region(self, place: int) -> torch.Tensor:
        """``place``'s whole arena, flat uint8, where it lives (host or device)."""

    @abc.abstractmethod
    def describe(self) -> list[list[Any]]:
        """The descriptors of every installed arena, of every transport served (tagged)."""

    @abc.abstractmethod
    def admit(self, hello: dict[str, Any], local: bool) -> str:
        """The transport this consumer reads batches through (``local``: same host and pid
        namespace): this store's kind, or another it serves the same places through. Raise
        ProtocolError naming the cause and the remedy if it can read none."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free every arena; idempotent."""

    def fingerprint(self, place: int, nbytes: int) -> int | None:
        """The fingerprint of a written place, taken now (for a batch written without one
        when a consumer that checks them joined meanwhile); None where ``write`` always
        takes one."""
        return None

    def room(self, nbytes: int) -> Room | None:
        """How many arenas for ``nbytes`` fit in the memory still free, or None where the
        transport knows no such limit."""
        return None

    @abc.abstractmethod
    def held(self) -> tuple[int, int]:
        """(how many places have an arena, the largest arena's bytes): what a check of the room
        for more places counts (places get theirs when first written, and grow)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Reader(abc.ABC):
    """Consumer side: opens each announced arena once and leases batch regions from it."""

    kind: str
    #: "views" when batches are handed out as views of the shared memory, "copy" when they
    #: are copied to the consumer's device (another GPU, or the host from a GPU)
    delivery: str
    #: whether a batch's fingerprint is checked when it is released: False where the memory
    #: is mapped read-only, so that a write faults in the writer instead
    checks_writes: bool = True
    #: True where a region may be released as soon as its last view dies: :meth:`retire`
    #: calls back at once and :meth:`handed_out` does nothing, so the consumer skips both
    #: calls (host memory: the CPU read it synchronously; each call costs a few us a batch)
    at_once: bool = False

    @abc.abstractmethod
    def announce(self, descriptor: list[Any]) -> None:
        """Take note of an arena (decoded strictly: ProtocolError if malformed)."""

    @abc.abstractmethod
    def size(self, place: int) -> int:
        """The announced size of ``place``'s arena; KeyError if none was announced."""

    @abc.abstractmethod
    def lease(self, place: int, nbytes: int) -> Lease:
        """The first ``nbytes`` of ``place``'s arena (opened on first use)."""

    @abc.abstractmethod
    def deliver(self, views: Any, copy: bool) -> Any:
        """The user's batch from ``views`` (built over a lease's region): the views themselves
        when they are already on the consumer's device, else copies there. With ``delivery``
        "views" and no ``copy`` the views themselves, always: the consumer skips the call."""

    def handed_out(self, token: Any) -> None:  # noqa: B027 - a hook: most transports need nothing
        """The batch was handed to the user, in the user's thread (a GPU reader notes the
        stream its work on the batch will be queued on)."""

    @abc.abstractmethod
    def retire(self, token: Any, then: Callable[[], None]) -> None:
        """The region's last view died (in any thread): call ``then`` once the region may be
        released. Must be cheap and must not block."""

    @abc.abstractmethod
    def fingerprint(self, token: Any, nbytes: int) -> int:
        """The fingerprint of the region's bytes as they are now (I/O thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Forget the arenas; live views keep what they need. Idempotent."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def grown_size(current: int | None, nbytes: int) -> int:
    """The size of a new arena for ``nbytes``: with 25% headroom over the one it replaces, so
    shapes that creep upwards do not reallocate every batch."""
    return max(nbytes, int(current * 1.25) if current else 0, 1)


def descriptor_kind(descriptor: Any) -> str:
    """The transport tag of a descriptor received on the wire (ProtocolError if none)."""
    if not (isinstance(descriptor, list) and len(descriptor) >= 2 and isinstance(descriptor[0], str)):
        raise ProtocolError(f"arena descriptor {descriptor!r:.80} is not [transport, place, ...]")
    return descriptor[0]


def check_descriptor(descriptor: Any, kind: str, types: tuple[type, ...]) -> list[Any]:
    """``descriptor`` if it is ``[kind, place, *fields]`` with fields of exactly ``types``."""
    if (
        descriptor_kind(descriptor) != kind
        or len(descriptor) != 2 + len(types)
        or type(descriptor[1]) is not int
        or not 0 <= descriptor[1] < 1 << 16
        or any(type(v) is not t for v, t in zip(descriptor[2:], types, strict=True))
    ):
        raise ProtocolError(f"bad {kind} arena descriptor {descriptor!r:.120}")
    return descriptor
