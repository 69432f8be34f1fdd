"""What a consumer's wait in ``next()`` checks at each tick besides its siblings
(:mod:`.siblings`): that it is not waiting for a batch it can never get (it holds all it may:
Hoarding), and, once, why a first batch is slow to come when others are waited for; and,
before a batch is yielded after this process was frozen, that it was not evicted meanwhile.
Each takes the consumer's :class:`~.iteration.Batches` (typed ``Any``: no import cycle)."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from ..errors import Hoarding, ProducerLost

log = logging.getLogger("tensorsocket")


def check_hoarding(batches: Any) -> None:
    """Raise Hoarding if this consumer holds all the batches it may and waits for another."""
    limit, slots = min(batches.settings.prefetch, batches.slots), batches.slots
    live = batches.shared.live
    if len(live) < limit:
        return
    # The samples a re-cut holds for its next batch are copied out (the batch they join
    # is assembled anyway): with the loop variable's batch (the last epoch's tail, say)
    # that was all it may hold, and the loop raised here.
    if batches.rebatcher is not None:
        batches.rebatcher.own_pending()
    gc.collect()  # batches kept alive only by reference cycles
    if len(live) >= limit:
        bound = f"prefetch={limit}" if limit < slots else f"the producer's slots={slots}"
        raise Hoarding(
            f"this consumer holds {len(live)} batches, all it may hold ({bound}), "
            "and waits for another: that can never arrive. "
            "Drop references to old batches, use Consumer(copy=True), or give the producer "
            "more slots"
        )


def warn_slow_start(batches: Any) -> None:
    """A wait for the first batch has lasted the consumer's ``timeout``: say once why, when the
    producer told us it waits for others (they are alive, so nothing else says it). A group
    starts only with all its ranks; a producer only once ``min_consumers`` joined."""
    started, settings, starts_with = batches.shared.wait_started, batches.settings, batches.shared.starts_with
    if batches.taken_any or batches.warned or started is None:
        return
    if time.monotonic() - started < settings.timeout:
        return
    if settings.group is not None:
        batches.warned = True
        group, rank, size, _ = settings.group
        log.warning(
            "consumer %r, rank %d of group %r, has waited %g s for its first batch: the group starts once "
            "all its %d ranks joined and iterate (a rank that never does, or joins under another group "
            "name, keeps it waiting; `tensorsocket status --endpoint %s` lists the ranks joined)",
            settings.label, rank, group, settings.timeout, size, settings.endpoint,
        )  # fmt: skip
    elif starts_with is not None and starts_with > 1:
        batches.warned = True
        log.warning(
            "consumer %r has waited %g s for its first batch: the producer at %s starts its stream once "
            "%d consumers joined (min_consumers, or after a restart its predecessor's consumers that rejoin); "
            "`tensorsocket status --endpoint %s` "
            "lists those joined",
            settings.label, settings.timeout, settings.endpoint, starts_with, settings.endpoint,
        )  # fmt: skip


def catch_up_after_freeze(batches: Any) -> None:
    """After this process was frozen (SIGSTOP, a debugger) for longer than the producer
    waits, it was evicted and its queued batches' places may hold other data by now, but
    the EVICTED message may not be read yet. The I/O thread notices the freeze at its next
    turn (a gap over ``timeout / 2``; eviction needs more than ``timeout``) and asks the
    producer something; its answer comes after EVICTED. So: if the I/O thread has not
    turned since the freeze, wait for it to; then wait for the answer. (next_batch calls
    it only when one of the two may be so.)"""
    shared, timeout = batches.shared, batches.settings.timeout
    seen = shared.io_tick
    if time.monotonic() - seen > timeout / 2:
        # It turns at least every timeout / 4, and at once after a freeze: a deadline shorter
        # than that (1 s, before) could run out on a loaded machine before its turn, and hand
        # out a batch whose place was reused while we were frozen.
        deadline = time.monotonic() + timeout
        while shared.io_tick == seen and batches.io.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
    if shared.synced.is_set():
        return
    deadline = time.monotonic() + timeout
    while not shared.synced.wait(0.01):
        if not batches.io.is_alive():
            return  # it stopped: next_batch raises the error it left
        if time.monotonic() > deadline:
            raise ProducerLost(
                f"the producer at {batches.settings.endpoint} did not answer after this process was frozen"
            )
