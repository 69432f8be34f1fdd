"""Consumers that between them hold every place while each of them waits for a batch: one
more place, so that none of them waits for ever.

Each consumer may keep batches past its next ``next()`` (the lifetime rule), and none is told
off while it holds fewer than all it may hold. But a few consumers can together hold every
place: one kept two batches when it left its loop early and now runs through the rest of the
epoch, another keeps its previous batch besides the one its loop holds. The window is open,
yet the producer has no place for the next batch, and each of them waits for that batch:
nobody would ever let go. The producer cannot see what a consumer's code holds on to, but it
does see each consumer's STATS (every second, with the time it has spent waiting in
``next()``): once every consumer has waited the whole while, the producer adds a place
(:meth:`tensorsocket.flow.Flow.grow_for_next`). A consumer that is only slow (a training step
holding its batches) is not waiting, and the producer waits for it as before, under ``stall``;
under ``skip`` one waiting consumer is enough (:meth:`Stuck._all_waiting`).
"""

from __future__ import annotations

import logging
import time

from .retention import GROW_AFTER
from .room import room_to_grow
from .shared import Peer, Shared

log = logging.getLogger("tensorsocket")

#: A consumer waited all along if its STATS say it waited this share of the time between them.
WAITED_SHARE = 0.9
#: The STATS that show it span at least this long (they come every second).
SPAN = 0.9


class Stuck:
    """When the places ran out under waiting consumers (used under the producer's lock)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.since: float | None = None  # every place held, the window open, from then on
        self.said = False  # the memory was short for one more place: logged once a stretch

    def reserve(self) -> int | None:
        """A place for the next batch (:meth:`Flow.reserve`); if the flow has none, a new one,
        reserved, once every place has been held for :data:`GROW_AFTER` seconds while every
        consumer (under ``skip``, one) waited for a batch and the memory holds one more; else
        None (the producer waits on)."""
        shared = self.shared
        place = shared.flow.reserve()  # (every batch: nothing else here runs then)
        if place is not None or not shared.flow.every_place_held():
            self.since, self.said = None, False
            return place
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since < GROW_AFTER or not self._all_waiting(now):
            return None
        if shared.flow.max_lag is None:
            held = "by consumers all waiting for the next batch (they keep references to earlier ones)"
        else:  # (skip)
            held = "with a consumer waiting for the next batch (stragglers=skip: what the others hold must not pace it)"
        short = room_to_grow(shared)
        if short is not None:
            if not self.said:
                self.said = True
                log.error("every place is held %s, and %s; it waits until a place is let go", held, short)
            return None
        place = shared.flow.grow_for_next()
        if place is not None:
            log.info(
                "every place was held for %.1f s %s: one place more, %d now",
                now - self.since, held, shared.flow.place_count,
            )  # fmt: skip
            self.since = None
        return place

    def _all_waiting(self, now: float) -> bool:
        """Under ``stall``: every consumer not finished waited in ``next()`` all along since the
        places ran out. Under ``skip``: one of them did. What others hold must not pace it there
        (several stragglers, each holding all it may at its own point, can hold every place),
        so the places grow while it waits, never past what the consumers may hold, plus one.
        A consumer that waited has nothing unsent: the window is open, so it needs a place."""
        waited = (self._waited(peer, now) for cid, peer in self.shared.peers.items() if self._unfinished(cid))
        return any(waited) if self.shared.flow.max_lag is not None else all(waited)

    def _unfinished(self, cid: object) -> bool:
        state = self.shared.flow.consumers.get(cid)
        return state is not None and not state.finished

    def _waited(self, peer: Peer, now: float) -> bool:
        """Did ``peer`` wait all along since :attr:`since`, by its STATS (the newest recent, none
        older than a second before that)?"""
        assert self.since is not None
        reports = [r for r in peer.stats if r[0] >= self.since - 1.0]
        if len(reports) < 2:
            return False
        (t0, _, _, w0), (t1, _, _, w1) = reports[0], reports[-1]
        return not (
            now - t1 > 2.0
            or t1 - self.since < SPAN / 2
            or t1 - t0 < SPAN
            or w1 - w0 < WAITED_SHARE * (t1 - t0)
        )
