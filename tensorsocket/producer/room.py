"""Whether the producer's places fit the memory its store allocates them from (``/dev/shm``,
a GPU's memory), checked whenever places are to be added, so that running short is an error
naming the numbers and the remedies, never an ``ENOSPC`` that ends the stream for everyone.

Places get their memory when first written, so a check counts every place the flow has,
with its memory or not yet. Three moments add places:

* the first batch (its size is known from then on): the window's places; the producer
  refuses to start (:func:`check_window_fits`);
* a group member's join, for the places its group takes once it starts
  (:data:`~tensorsocket.flow_groups.GROUP_PLACES_PER_RANK` a rank): that member is refused,
  the stream goes on (:func:`check_group_fits`); and the group's start, when its last rank
  is ready (its ranks may have joined before the first batch, unchecked): its ranks are
  evicted, the stream goes on (:func:`evict_group_that_does_not_fit`);
* a joiner that waits for a place every consumer holds (see :meth:`Flow.restage`): without
  room for one more, it is evicted, the stream goes on (:func:`room_to_grow`).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Hashable

from ..flow_groups import GROUP_PLACES_PER_RANK, Membership
from ..flow_types import LateJoin
from ..transport.base import Room
from .shared import Shared

log = logging.getLogger("tensorsocket")

MIB = 1 << 20


def check_window_fits(shared: Shared, nbytes: int) -> Room | None:
    """At the first batch, when its size is known: refuse now, with the numbers and the
    remedies, if the window's places do not fit the store's memory (rather than fail some
    batches later); how much room there is, or None where the store knows no limit."""
    shared.batch_bytes = nbytes
    room = shared.store.room(nbytes)
    window = shared.flow.place_count
    if room is not None and room.fits < window:
        slots, size = shared.config.slots, room.arena_bytes
        groups = [g for g in shared.flow.groups() if g.started]  # (formed before the first batch)
        why = f"slots={slots}" + (
            f" and the {window - slots} places of group(s) {', '.join(repr(g.name) for g in groups)}"
            if groups
            else ""
        )
        # Slots that would fit beside the groups' places; a group needs at least its size.
        fit = room.fits - (window - slots)
        least = max((g.size for g in groups), default=1)
        lower = f"lower slots= (at most {fit} fit), " if fit >= least else ""
        fewer = "run fewer ranks, " if groups else ""
        raise OSError(
            errno.ENOSPC,
            f"batches of {nbytes} bytes need {window} x {size / MIB:.1f} MiB = {window * size / MIB:.0f} MiB "
            f"for {why}, but {room.where} has {room.free_bytes / MIB:.0f} MiB free: {lower}"
            f"make batches smaller, {fewer}or {room.remedy}",
        )
    return room


def places_that_fit(shared: Shared) -> tuple[int, Room] | None:
    """How many more places the store's memory holds now, each the size of the largest arena
    so far (batches may grow), beside the places that have none yet; and the room it has (lock
    held). None before the first batch, or where the store knows no limit."""
    if shared.batch_bytes is None:
        return None
    backed, largest = shared.store.held()
    room = shared.store.room(max(shared.batch_bytes, largest))
    if room is None:
        return None
    return room.fits - (shared.flow.place_count - backed), room


def check_group_fits(shared: Shared, member: Membership | None, policy: LateJoin) -> None:
    """ValueError naming the numbers, before a group member joins, if its group's start would
    add more places than the memory holds (lock held). Refusing it then costs nobody else
    anything; an ``ENOSPC`` at the group's start would end the stream for every consumer. A
    member the flow would refuse anyway is refused for that (its error names the real fault)."""
    fit = None if member is None else places_that_fit(shared)
    if member is None or fit is None:
        return
    short = _group_short(member, shared.flow.places_to_start(member, policy), fit)
    if short is not None:
        raise ValueError(short)


def evict_group_that_does_not_fit(shared: Shared, cid: Hashable, drop: Callable[..., None]) -> bool:
    """Before ``cid``'s READY is applied (lock held): if it is the last of its group's ranks to
    be ready, so starting the group, and the places the group adds do not fit, evict its ranks
    (``drop``: :meth:`IoLoop.drop`), saying why; True if it did. Its ranks may have joined
    before the first batch, when no batch size was known to check them by. (Before the first
    batch nothing is checked here: that batch's check counts the groups started by then.)"""
    flow = shared.flow
    state = flow.consumers.get(cid)
    group = None if state is None else state.group
    if group is None or state.ready or flow.ended:  # type: ignore[union-attr]
        return False  # (said again, or after END: it starts nothing)
    if not group.starts_when(lambda other: other == cid or flow.consumers[other].ready):
        return False
    member, fit = Membership(group.name, 0, group.size, group.tail), places_that_fit(shared)
    short = None if fit is None else _group_short(member, flow.places_to_start(member, None), fit)
    if short is None:
        return False
    log.error("%s: its ranks are evicted", short)
    for rank in list(group.members.values()):
        drop(rank, "evicted: its group's places do not fit", evicted=short)
    return True


def _group_short(member: Membership, more: int, fit: tuple[int, Room]) -> str | None:
    fits, room = fit
    if more <= fits:
        return None
    size = room.arena_bytes / MIB
    return (
        f"group {member.group!r}: its {member.size} ranks need {more} more places of {size:.1f} MiB "
        f"({GROUP_PLACES_PER_RANK} a rank): {more * size:.0f} MiB, but {room.where} has "
        f"{room.free_bytes / MIB:.0f} MiB free (room for {max(fits, 0)}): make batches smaller, run "
        f"fewer ranks, or {room.remedy}"
    )


def room_to_grow(shared: Shared) -> str | None:
    """Why one more place does not fit (lock held); None if it does, or the store knows no limit."""
    fit = places_that_fit(shared)
    if fit is None or fit[0] >= 1:
        return None
    room = fit[1]
    return (
        f"one more place of {room.arena_bytes / MIB:.1f} MiB does not fit: {room.where} has "
        f"{room.free_bytes / MIB:.0f} MiB free. Join with late_join='next_epoch', or {room.remedy}"
    )
