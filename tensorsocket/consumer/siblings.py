"""Consumers of one stream in one process: the deadlock that taking them in turn in one thread
makes of a lockstep stream, found and raised instead of waited on forever.

With ``stragglers="stall"`` the producer reuses a place only once every consumer has let its
batch go. Take two consumers of one stream in one thread, one after the other (a whole epoch
of the first, then of the second), and the first soon waits for a batch the producer cannot
publish until the second takes the one it holds a place for, while the second is not iterated
until the first is done. Both are alive and send heartbeats, so no timeout fires: the first
consumer's wait asks here (each TICK, once it has lasted its ``timeout``) whether another
consumer of the stream, used by this very thread and not inside next() now, has not taken,
or still holds, the batch whose place the producer needs next. Then it raises. One this
thread made and no thread has iterated yet only gets a warning: a thread that is still
setting up may be about to take it, and a program that is right must not be stopped.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from ..errors import Hoarding

log = logging.getLogger("tensorsocket")

#: Every consumer's Batches in this process (dropped with it)
_ALL: weakref.WeakSet[Any] = weakref.WeakSet()


def register(batches: Any) -> None:
    _ALL.add(batches)


def holding_back(waiting: Any) -> tuple[Any, bool] | None:
    """Another consumer's Batches that the producer must wait for before it can send
    ``waiting`` (a Batches whose next() waits in this thread) its next batch, and whether
    only this thread could move it on: True if this thread iterated it last, False if no
    thread has iterated it yet and this one made it (another thread may be about to); None
    if there is none (or the producer does not wait: its stragglers skip ahead, or these
    consumers are group ranks, which take turns)."""
    # the batch whose place the next one needs: every consumer must have let it go
    needed = waiting.taken_seq + 1 - waiting.slots
    if needed < 0:
        return None
    for other, mine in _siblings(waiting):
        shared = other.shared
        if other.taken_seq < needed or min(shared.live, default=needed + 1) <= needed:
            return other, mine
    return None


def _siblings(waiting: Any) -> list[tuple[Any, bool]]:
    """The other consumers of ``waiting``'s stream that this thread iterated last (True) or
    made and no thread iterated yet (False), not inside next() now nor done; none if the
    producer does not wait for them (its stragglers skip ahead, or these are group ranks,
    which take turns)."""
    if not waiting.stall or waiting.group_size != 1:
        return []
    me, endpoint = threading.get_ident(), waiting.settings.endpoint
    try:
        others = list(_ALL)
    except RuntimeError:  # another thread made or dropped a consumer meanwhile: ask next TICK
        return []
    found = []
    for other in others:
        if other is waiting or other.settings.endpoint != endpoint or other.group_size != 1:
            continue
        shared = other.shared
        mine = other.thread == me
        if not (mine or (other.thread is None and other.made_in == me)):
            continue
        if not (shared.caller_inside or shared.stop.is_set() or other.ended):
            found.append((other, mine))
    return found


def _holding_before_first(waiting: Any) -> Any:
    """For ``waiting`` that has taken no batch yet (one that joins at the next epoch waits for
    the producer to get there): a consumer of its stream this thread iterated last that holds
    batches, or has some queued, which the producer may be waiting for (not certain: it does
    not say where it is, and it may only be slow); None if there is none."""
    if waiting.taken_seq >= 0:
        return None
    for other, mine in _siblings(waiting):
        if mine and (other.shared.live or not other.shared.queue.empty()):
            return other
    return None


def check(waiting: Any) -> None:
    """Asked each TICK of ``waiting``'s wait in next(): once it has lasted the consumer's
    ``timeout``, raise Hoarding if this thread holds the wait up (warn once if it may)."""
    started, settings = waiting.shared.wait_started, waiting.settings
    if started is None or time.monotonic() - started < settings.timeout:
        return
    found = holding_back(waiting)
    if found is None:
        holder = _holding_before_first(waiting)
        if holder is not None and not waiting.warned:
            waiting.warned = True
            log.warning(
                "consumer %r has waited %g s for its first batch while consumer %r of the same stream, "
                "which this thread iterated last, holds batches it was sent: if the producer waits for "
                "it to take them (stragglers='stall'), that will never happen while this thread waits "
                "here (iterate them together, from separate threads, or in separate processes)",
                settings.label, settings.timeout, holder.settings.label,
            )  # fmt: skip
        return
    other, certain = found
    if certain:
        raise Hoarding(
            f"this consumer waited {settings.timeout:g} s for a batch the producer cannot send before "
            f"consumer {other.settings.label!r} of the same stream takes (or drops) one it sent it, and "
            "this thread, which iterates both, waits here (the slowest consumer sets the pace). Iterate "
            "them together (zip), from separate threads, or in separate processes"
        )
    if not waiting.warned:
        waiting.warned = True
        log.warning(
            "consumer %r has waited %g s for a batch the producer cannot send before consumer %r of the "
            "same stream, made in this thread and not iterated yet, takes one it holds: if this thread "
            "is to iterate it after this one, that will never happen (iterate them together, from "
            "separate threads, or in separate processes)",
            settings.label, settings.timeout, other.settings.label,
        )  # fmt: skip
