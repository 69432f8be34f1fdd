"""The producer's caller's thread: pull a batch from the loader, wait for a free place,
write the batch there, and publish it once written; end epochs and the stream.

Every wait re-checks, each tick, that the producer was not closed and that its I/O thread
is alive, so no wait here outlives the producer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import layout, layout_table, pooled_collate, protocol
from ..errors import Closed, IoThreadDied
from ..protocol import Kind
from . import successor
from .io_loop import IoLoop
from .restart import Resumed, Tracker, content_fingerprint, rejoined
from .retention import Kept, Replay
from .room import check_window_fits
from .session_turns import SessionTurns
from .shared import TICK, Shared
from .stuck import Stuck

log = logging.getLogger("tensorsocket")

_REJOIN_GRACE = 10.0  # seconds a successor waits for all its predecessor's consumers


class Publisher:
    """Publishes the loader's batches; lives in (and is used only by) the caller's thread,
    except :meth:`end_stream` and :meth:`wait`, which close() may call from another."""

    def __init__(
        self,
        shared: Shared,
        io: IoLoop,
        pool: pooled_collate.LoaderPool,
        min_consumers: int,
        grace: float | None,
        tracker: Tracker | None = None,
        resumed: Resumed | None = None,
    ) -> None:
        self.shared, self.io = shared, io
        self.turns = SessionTurns(shared, io.sessions)
        self.min_consumers, self.grace = min_consumers, grace
        self.closing = False  # close() has begun: waits in the caller's thread end quietly
        self.started = False  # the first batch was pulled
        self.epoch_open = False
        self.index = 0
        self.epoch = self.first_seq = 0  # the open epoch and its first entry (only we move the flow's epoch)
        self.loader_iter: Iterator[Any] | None = None
        self.pending: list[Any] = []  # pulled already (a resume's checked batch): published first
        self.last_layout = layout_table.LastLayout()  # the last batch's layout, planned and encoded
        self.replay = Replay(shared, io)  # the batches kept for late joiners (sized at the first batch)
        self.stuck = Stuck(shared)  # one more place when waiting consumers hold them all
        # the loader's workers collating into buffers we hand back (made before us: a restart's
        # rerun opens its iterator through it too)
        self.pool = pool
        # resume=True: where to restart from, and the state file; a successor's first epoch
        self.tracker, self.resumed = tracker, resumed
        self.expected: dict[tuple[int, int], int] = {}  # a successor's batches published before
        self.rejoiners = 0  # a successor: its predecessor's consumers it waits for to rejoin
        if resumed is not None:
            self.expected = resumed.fingerprints
            # wait for its consumers to rejoin (not forever), also if the epoch starts again (groups)
            self.rejoiners = resumed.consumers
            self.grace = _REJOIN_GRACE if grace is None else grace
        shared.starts_with, shared.awaited = max(self.min_consumers, self.rejoiners), self.rejoiners

    def next_batch(self) -> Any:
        """Publish the loader's next batch and return it; StopIteration at the epoch's end."""
        shared = self.shared
        endpoint = shared.config.endpoint
        if self.started:
            with shared.lock:  # (asked here first: wait() and its predicate are calls each batch)
                serving = shared.flow.serving()
            if not serving:
                self.wait(lambda: shared.flow.serving() >= 1, None, "a consumer to join")
        else:
            self.wait(self._may_start, None, self._awaited())
            successor.give_up_groups(shared, self.rejoiners)
        t0 = time.perf_counter()
        assert self.loader_iter is not None
        self.pool.before_pull()  # (the batch before is written, and maybe dropped by our caller)
        try:
            batch = self.pending.pop() if self.pending else next(self.loader_iter)
        except StopIteration:
            self.end_epoch()
            raise
        t1 = time.perf_counter()
        plan = self.last_layout.plan(batch)  # (a batch laid out as the last one: not walked)
        self.pool.pulled(plan.sources)
        content = self._check_content(plan)
        if not self.started:
            with shared.lock:  # (a group starting meanwhile adds places: counted, or after this)
                room = check_window_fits(shared, plan.nbytes)
            self.replay.size(plan, room)
            self.pool.keep(shared.replay_batches)  # (the batches kept hold their buffers)
            shared.starts_with = None
        self.started = True
        if self.replay.kept.budget:
            self.replay.check_newest()
        encoded, key = self.last_layout.encode(plan)  # (outside the lock: a large layout packs slowly)
        t_place = shared.place_wait_since = time.perf_counter()
        try:
            place, check = self._reserve()
        finally:
            shared.place_wait_since = None
        place_wait = time.perf_counter() - t_place
        try:
            fingerprint = shared.write(place, plan, check)
            kept = self.replay.to_keep(place, plan)
        except BaseException:
            with shared.changed:
                shared.flow.cancel(place)
            if self.closing:  # close() from another thread closed the store under us
                raise Closed(f"producer on {endpoint} was closed") from None
            raise
        with shared.lock:
            if shared.flow.ended:  # closed while we wrote
                shared.flow.cancel(place)  # (a joiner's replay may still need a place)
                raise Closed(f"producer on {endpoint} was closed")
            if fingerprint is None and shared.fingerprints_wanted():  # one joined while we wrote
                fingerprint = shared.store.fingerprint(place, plan.nbytes)
            ref, new = shared.layouts.number(encoded, key)
            if new is not None:  # announced before any BATCH names it (a later joiner: in WELCOME)
                shared.broadcast(protocol.encode(Kind.LAYOUT, number=new[0], layout=new[1]))
            seq = shared.flow.next_seq
            frame = protocol.encode_batch(seq, shared.flow.epoch, self.index, place, ref, fingerprint)
            if len(frame) > protocol.MAX_REPLY_BYTES:
                shared.flow.cancel(place)
                raise TypeError(
                    f"batch {self.index} of epoch {shared.flow.epoch} describes itself in {len(frame)} bytes "
                    f"(limit {protocol.MAX_REPLY_BYTES}): its str / bytes / scalar leaves travel in the "
                    "message; put large data in tensors or NumPy arrays"
                )
            keep = 0
            if kept is not None:
                keep = self.replay.kept.add(
                    Kept(seq, kept[0], shared.flow.epoch, self.index, ref, kept[1], kept[2])
                )
            if self.tracker is not None and content is not None:
                self.tracker.fingerprinted(seq, self.epoch, self.index, content)
            shared.send_all(shared.flow.publish(place, frame, keep))
            self.replay.kept.prune(shared.flow.kept_from())
            self.index += 1
            where = shared.restart_where() if self.tracker is not None else None
            stats = shared.stats
            stats["published"] += 1
            stats["loader_wait"] += t1 - t0
            stats["publish_time"] += time.perf_counter() - t1
            stats["slot_wait"] += place_wait
            wake = shared.io_wanted  # (sent straight over sessions: the I/O thread need not wake)
        if wake:
            shared.wakeup.wake()
        if self.tracker is not None and where is not None and content is not None:
            # (the loader's state_dict() may take a while: not under the lock)
            self.tracker.published(seq, self.epoch, self.first_seq, self.index - 1)
            self.tracker.save(*where)
        return batch

    def _reserve(self) -> tuple[int, bool]:
        """Wait for a place for the next batch (and whether a consumer checks fingerprints),
        writing the kept batches joiners wait for meanwhile."""
        shared = self.shared
        jobs: list[tuple[int, int]] = []  # (kept seq, place) to write for a joiner first
        places: list[tuple[int, bool]] = []

        def reserved() -> bool:
            if shared.flow.ended:
                raise Closed(f"producer on {shared.config.endpoint} was closed")
            job = self.replay.job()
            if job is not None:
                jobs.append(job)
                return True
            place = self.stuck.reserve()
            if place is not None:
                places.append((place, shared.fingerprints_wanted()))
            return place is not None

        while True:
            self.turns.wait(reserved, lambda: self._check_waiting("a free place", None))
            if places:
                return places.pop()
            self._restage(*jobs.pop())

    def _restage(self, seq: int, place: int) -> None:
        try:
            self.replay.restage(seq, place)
        except Exception:
            if self.closing:  # close() from another thread closed the store under us
                raise Closed(f"producer on {self.shared.config.endpoint} was closed") from None
            raise

    def _check_content(self, plan: layout.Plan) -> int | None:
        """With resume=True, the batch's content fingerprint (recorded, so a successor can
        check it repeats the stream); a successor checks each batch its predecessor published
        is the same, so no consumer ever gets a batch under another's numbers."""
        if self.tracker is None:
            return None
        content = content_fingerprint(plan)
        expected = self.expected.pop((self.epoch, self.index), None)
        if expected is not None and expected != content:
            raise RuntimeError(
                f"batch {self.index} of epoch {self.epoch} differs from the one published under that number "
                "before the restart: the loader does not repeat its stream; remove the state file "
                f"{self.tracker.path} to begin a fresh stream"
            )
        return content

    def _may_start(self) -> bool:
        """Before the first batch: enough consumers, or the grace period is over (lock held).
        A successor counts its predecessor's consumers by their rejoins: a new consumer joining
        meanwhile is not one of them, and starting without one that is slow to rejoin could
        publish its batches past it."""
        shared = self.shared
        serving = shared.flow.serving()  # a group counts once all its ranks joined
        if serving >= self.min_consumers and rejoined(shared.flow) >= self.rejoiners:
            return True
        return (
            self.grace is not None
            and (serving > 0 or self.rejoiners > 0)  # (a successor: a group a rank did not rejoin is told)
            and shared.first_join is not None
            and time.monotonic() - shared.first_join >= self.grace
        )

    def _awaited(self) -> str:
        """What the first batch waits for, in words."""
        joined = f"{self.min_consumers} consumer(s) to join"
        if not self.rejoiners:
            return joined
        also = f", and {joined}" if self.min_consumers > 1 else ""
        return f"its predecessor's {self.rejoiners} consumer(s) to rejoin{also}"

    def start_epoch(self) -> None:
        """Open the loader's next epoch (through the pool: an iterable, or a function returning
        one): tell its epoch-seeded parts the epoch, as a training loop would, then iterate it."""
        if self.epoch_open:  # the previous epoch's loop was left early: end it where it is
            self.end_epoch()
        with self.shared.changed:
            epoch = self.epoch = self.shared.flow.epoch  # the epoch its batches and EPOCH_END will carry
            self.first_seq = self.shared.flow.next_seq
        resumed, self.resumed = self.resumed, None
        self.epoch_open = True
        if resumed is not None and (resumed.iterator is not None or resumed.at_end):
            # A successor's first epoch: its predecessor's, continued where it restarts.
            self.first_seq, self.index = resumed.first_seq, resumed.index
            self.loader_iter = resumed.iterator or iter(())
            self.pending = resumed.pending
            return
        if self.tracker is not None:  # its point, written now: the stream id lasts from here on
            self.tracker.epoch_started(epoch, self.first_seq)
            with self.shared.changed:
                where = self.shared.restart_where()
            self.tracker.save(*where, force=True)
        if not self.started:  # (nothing pulled, no loader worker started, before they come)
            self.wait(self._may_start, None, self._awaited())
        self.loader_iter = self.pool.open(epoch)
        self.index = 0

    def end_epoch(self) -> None:
        shared = self.shared
        with shared.changed:
            if not self.epoch_open:  # already ended (close() raced the caller's thread)
                return
            self.epoch_open = False
            if shared.flow.ended:
                raise Closed(f"producer on {shared.config.endpoint} was closed")
            seq, epoch = shared.flow.next_seq, shared.flow.epoch
            frame = protocol.encode(Kind.EPOCH_END, seq=seq, epoch=epoch)
            shared.send_all(shared.flow.end_epoch(frame))
            where = shared.restart_where() if self.tracker is not None else None
        shared.wakeup.wake()
        if self.tracker is not None and where is not None:
            self.tracker.epoch_ended(seq, epoch, self.first_seq, self.index)
            self.tracker.save(*where, force=True)

    def end_stream(self, reason: str | None) -> None:
        shared = self.shared
        with shared.changed:
            if shared.flow.ended:
                return
            frame = protocol.encode(
                Kind.END, seq=shared.flow.next_seq, epoch=shared.flow.epoch, reason=reason
            )
            shared.send_all(shared.flow.end_stream(frame))
            shared.notify()  # (close() from another thread: the publishing thread stops waiting)
            if self.tracker is not None and reason is None:  # a clean end: nothing to resume
                self.tracker.ended()  # (after an error the file stays: a restart may go on)
        shared.wakeup.wake()

    def wait(self, predicate: Callable[[], bool], deadline: float | None, what: str) -> None:
        """Wait under the lock until ``predicate()``; re-check every tick so close() and a
        dead I/O thread are noticed. Raises TimeoutError at ``deadline``. Once it waits, the
        I/O thread is handed the sessions (what this waits for comes from there)."""
        shared = self.shared
        while True:
            with shared.changed:
                if predicate():
                    return
                if shared.publisher_at:  # hand the sessions back to the I/O thread at once
                    shared.publisher_at = 0.0
                    shared.wakeup.wake()
                job = self.replay.job()
                if job is None:
                    self._check_waiting(what, deadline)
                    shared.changed.wait(TICK)
                    continue
            self._restage(*job)  # a joiner waits for a kept batch (after END too: it is owed)

    def _check_waiting(self, what: str, deadline: float | None) -> None:
        """A wait's checks, each tick (lock held): the producer stopped, its I/O thread died,
        the deadline passed."""
        shared = self.shared
        if shared.stop.is_set():
            raise Closed(f"producer on {shared.config.endpoint} stopped while waiting for {what}")
        if not self.io.thread.is_alive():
            raise IoThreadDied(
                f"the I/O thread of the producer on {shared.config.endpoint} stopped while "
                f"waiting for {what} (its error is logged above)"
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"gave up waiting for {what}")

    def all_left(self) -> bool:
        """After END: every consumer said BYE (it has mapped every arena it was sent, so the
        arenas may be freed), left, or died."""
        return self.shared.flow.ended and not self.shared.peers
