"""Delivery: a BATCH message becomes the user's batch, and the batch's death its release.

Lifetime: each batch's views hang off one owner object from the transport (a NumPy array
over shared memory, or a CUDA array interface over a GPU mapping) with a finalizer. When
the last view (or anything derived from one) dies, the finalizer asks the reader to retire
the region; the reader calls back once it may be released (at once on the host; on a GPU
after the work queued on the batch ran), and the I/O thread then re-checks the batch's
fingerprint and sends RELEASE. Only then may the producer reuse the place.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ..layout_table import Recipe
from ..transport import Reader
from .shared import Shared

#: The weak references whose callbacks release batches, by id (a weak reference hashes as
#: its referent, and arrays do not hash), with what their release says, kept alive until they
#: fire: as weakref.finalize keeps its own, at ~4 us more per batch than a bare reference
#: with a callback.
_WATCHING: dict[int, tuple[weakref.ref[Any], tuple[Any, ...]]] = {}


class Releases:
    """What a batch's finalizer needs of the consumer: a box of its own, as the finalizer must
    not hold the shared record (which holds the queued batches) or the Consumer, so a dropped
    Consumer is collected. Each batch's weak reference calls :meth:`fired` (a bound method:
    cheaper per batch than a partial binding all of these)."""

    __slots__ = ("live", "released", "wakeup", "sleeping", "interrupted", "stop")

    def __init__(self, shared: Shared) -> None:
        self.live, self.released, self.wakeup, self.sleeping, self.interrupted, self.stop = (
            shared.live, shared.released, shared.wakeup, shared.io_sleeping, shared.interrupted, shared.stop
        )  # fmt: skip

    def fired(self, watch: weakref.ref[Any]) -> None:
        """A batch's finalizer: runs in whichever thread dropped its last view. It must not
        touch the link. It wakes the I/O thread only for a release that must go now
        (:meth:`Sleeping.wants`): the rest go with the caller's thread's next read, or at the
        I/O thread's next tick.

        Ctrl-C lands in the main thread, often here (a loop's ``batch = ...`` drops the last
        one), and Python raises it as a call returns; so does what another signal's handler
        raises (a SIGTERM handler's ``sys.exit()``). An exception in a weak reference's
        callback is only printed, so the user's Ctrl-C would do nothing, and one raised before
        the release was queued would have lost it (its place held for ever). So the entry is
        taken and the release queued with no call between them, and an exception finishes the
        release if it is not queued yet; a stop (see :meth:`rescue`) is noted, and the next
        ``next()``, or ``close()``, raises it (raised here again, it would be dropped again)."""
        item = done = None  # (not taken while it is in _WATCHING; not yet retired)
        try:
            key = id(watch)
            item = _WATCHING[key][1]
            if not item[6].at_once:
                done = _ReleaseOnce(self, item)
                del _WATCHING[key]
                item[6].retire(item[1], done)
                self.live.discard(item[0])
                return
            del _WATCHING[key]  # (no call from here to the release queued: nothing raises)
            # (what ready() does, without the calls: host memory is released at once, and each
            # call on the per-batch path costs a few us from cold caches)
            self.released.append(item)
            self.live.discard(item[0])
            if self.sleeping.now and self.sleeping.wants(self.live, self.released):
                self.wakeup.wake()
        except BaseException as exc:
            if not self.rescue(watch, item, done, exc):
                raise  # (printed, as before; the hook below leaves it alone: ``item`` is set)

    def rescue(
        self,
        watch: weakref.ref[Any],
        item: tuple[Any, ...] | None,
        done: _ReleaseOnce | None,
        exc: BaseException,
    ) -> bool:
        """Finish the release of ``watch``'s batch that ``exc`` cut short (``item``: its
        entry, if it was taken; ``done``: what retire() was to call, if it was made). Note
        ``exc`` for the next ``next()`` if it is a stop (not an ``Exception``: Ctrl-C's
        KeyboardInterrupt, ``sys.exit()``'s SystemExit) and the consumer is open; say whether
        it was noted. Anything else is a bug, which Python prints, as it did: raised in the
        caller's next(), perhaps from another thread's release, it would stop training."""
        entry = _WATCHING.pop(id(watch), None)
        if entry is not None:  # (not taken yet: nothing was done)
            item = entry[1]
            if item[6].at_once:
                self.ready(item)
            else:
                item[6].retire(item[1], _ReleaseOnce(self, item))
        elif done is not None:  # retire() may or may not have queued it: again (it releases once)
            done.item[6].retire(done.item[1], done)
        if item is not None:
            self.live.discard(item[0])
        if isinstance(exc, Exception) or self.stop.is_set():
            return False
        self.interrupted.append(exc)
        return True

    def ready(self, item: tuple[Any, ...]) -> None:
        """The reader says a retired batch's region may be released (in any thread)."""
        self.released.append(item)
        if self.sleeping.now and self.sleeping.wants(self.live, self.released):
            self.wakeup.wake()


class _ReleaseOnce:
    """What a reader that releases later (a GPU's, once the work queued on the batch ran) calls
    when a batch may be released: it releases it once, however often it is called. An
    interrupt landing in retire() leaves it unknown whether retire() queued the release, so
    the rescue retires the batch again, and whichever wait ends first releases it."""

    __slots__ = ("releases", "item", "called")

    def __init__(self, releases: Releases, item: tuple[Any, ...]) -> None:
        self.releases, self.item, self.called = releases, item, False

    def __call__(self) -> None:
        if not self.called:  # (called from one thread: the reader's waiter, or the caller's)
            self.called = True
            self.releases.ready(self.item)


class _Rescuer:
    """``sys.unraisablehook`` once a consumer exists, wrapping the one before. Ctrl-C (or what
    another signal's handler raises) can land at the very start of :meth:`Releases.fired`,
    before its first line: Python then only hands the exception here, and the batch's release
    was lost (its place held until close; 2 of 36 soak runs). Here the release is finished and
    a stop noted, as ``fired`` itself does: the next ``next()`` raises it. The batch is known
    from the traceback's outermost frame, ``fired``'s own (the callback is called from C),
    which holds its arguments (and no ``item`` yet: with one, ``fired`` saw it already).
    Anything else goes to the hook before."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        tb = unraisable.exc_traceback
        if tb is not None and tb.tb_frame.f_code is _FIRED and "item" not in tb.tb_frame.f_locals:
            local = tb.tb_frame.f_locals
            if local["self"].rescue(local["watch"], None, None, unraisable.exc_value):
                return
        self.previous(unraisable)


_FIRED = Releases.fired.__code__


def rescue_interrupted_releases() -> None:
    """Put a :class:`_Rescuer` in front of ``sys.unraisablehook`` (once; a consumer is made)."""
    if not isinstance(sys.unraisablehook, _Rescuer):
        sys.unraisablehook = _Rescuer(sys.unraisablehook)


def build(
    fields: tuple[int, int, int, int, Any, int | None],
    recipe: Recipe,
    reader: Reader,
    releases: Releases,
    copy: bool,
) -> tuple[Any, Any, weakref.ref[Any]]:
    """The user's batch from a BATCH message's fields (as :func:`protocol.decode_batch` gives
    them) and its (checked) layout, its lease's token and a weak reference to the lease's
    owner, whose death releases the batch. Raises ProtocolError / KeyError / ValueError for a
    batch that does not fit its place."""
    seq, epoch, index, place, _, fingerprint = fields
    nbytes = recipe.nbytes  # (the reader checks it fits the place)
    lease = reader.lease(place, nbytes)
    item = (seq, lease.token, nbytes, fingerprint, epoch, index, reader)
    watch = weakref.ref(lease.owner, releases.fired)
    _WATCHING[id(watch)] = (watch, item)
    batch = recipe.build(lease.region)
    if copy or reader.delivery != "views":  # (views and no copy: deliver() gives the views back)
        batch = reader.deliver(batch, copy)
    return batch, lease.token, watch


def modified(label: str, epoch: int, index: int) -> str:
    """What a consumer says when a batch it held changed in shared memory (``check_writes``)."""
    return (
        f"batch {index} of epoch {epoch} changed in shared memory while consumer "
        f"{label!r} held it. Shared batches are read-only: every trainer reads the same "
        "memory, so an in-place op (x.sub_(mean), x /= 255, x[...] = ...) corrupts the others' "
        "data. Use an out-of-place op (x = x - mean) or Consumer(copy=True). If this process "
        "wrote nothing, another consumer holding the batch did: see the producer's log."
    )
