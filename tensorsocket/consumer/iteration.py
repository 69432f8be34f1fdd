"""The consumer's caller's thread: take the next batch the I/O thread built, in this
consumer's batch size; epoch ends, skips, eviction, hoarding and in-place writes.

Every wait is bounded: a tick re-checks that the I/O thread is alive and that this consumer
is not waiting for a batch it can never get.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ProducerLost
from ..rebatch import Rebatcher, batch_length
from . import resume, siblings, wait_checks
from .caller_turn import CallerTurns
from .inbox import Inbox
from .resume import Position
from .shared import BATCH, END, EPOCH_END, RESTARTED, SKIPPED, Settings, Shared

log = logging.getLogger("tensorsocket")


class Batches:
    """What ``for batch in consumer`` runs on; used by the caller's thread only."""

    def __init__(
        self,
        shared: Shared,
        settings: Settings,
        io: threading.Thread,
        inbox: Inbox,
        slots: int,
        rebatcher: Rebatcher | None,
        stream: str = "",
        restored: Position | None = None,
        batches_per_epoch: int | None = None,
        stall: bool = True,
    ) -> None:
        self.shared, self.settings, self.io = shared, settings, io
        # For siblings: the producer waits for the slowest (stragglers="stall"), the thread that
        # made this consumer and the last to iterate it, its last batch's seq, and a warning given
        self.stall, self.made_in, self.thread = stall, threading.get_ident(), None
        self.inside: int | None = None  # the thread in next() now (one at a time)
        self.taken_seq, self.warned = -1, False
        siblings.register(self)
        self.turns = CallerTurns(shared, inbox, io, settings.endpoint)
        self.slots, self.rebatcher = slots, rebatcher
        self.group_size = 1 if settings.group is None else settings.group[2]  # 1: not in a group
        # Where this consumer is (see consumer/resume.py): the next producer batch of the epoch
        # in progress; with a re-cut, the producer batches of the epoch pushed (index, first
        # sample's number, samples) and the samples handed out
        self.stream, self.epoch, self.next_index = stream, None if restored is None else restored.epoch, 0
        self.pushed: collections.deque[tuple[int, int, int]] = collections.deque()
        self.pushed_epoch, self.handed, self.last = 0, 0, (0, 0)
        # (where an epoch ends in this consumer's positions: for what a restore missed)
        self.restored, self.epoch_span = restored, resume.epoch_span(batches_per_epoch, settings.group)
        if restored is not None:
            self.next_index = restored.index
        self.missed: int | None = None  # batches a restored consumer lost (None: none or not known)
        self.repeated: int | None = None  # batches sent again: a successor restarted the epoch
        self.resume_checked = False
        self.taken_any = False  # a batch or an epoch's end was taken
        self.ended = False
        self.mid_epoch = False
        self.error: Exception | None = None
        self.ready: collections.deque[Any] = collections.deque()  # re-cut batches not yet yielded
        self.stop_pending = False  # the epoch ended after the batches in ready
        self.skipped = 0  # batches the producer moved this consumer past (stragglers="skip")
        self.skipped_epoch = 0
        self.first_batch = True
        # of the last batch returned: a producer batch (the I/O thread counts) or a re-cut one
        self.samples: int | None = None

    def start_epoch(self) -> None:
        """A new epoch: if the previous one's loop was left early, skip the rest of it (as a new
        DataLoader iterator does). Not the thread: an iterator may be handed on (see next())."""
        if self.mid_epoch:
            self._waited(self._skip_rest)  # (a wait for data, as in next(): STATS count it)
        if self.settings.group is not None and self.shared.ready is None:
            # Its group may start now (all ranks ready): from the restored position, if any.
            restored = self.restored
            where = None if restored is None else [restored.stream, restored.epoch, restored.index]
            self.shared.ready = [where]
            self.shared.wakeup.wake()
        self.ready.clear()
        self.stop_pending = False
        if self.rebatcher is not None:
            self.rebatcher.flush()  # drop a remainder left behind by a loop that broke early
            self._forget_pushed()

    def next_for_user(self) -> Any:
        """The next batch in this consumer's batch size; StopIteration at the epoch's end."""
        shared, me = self.shared, threading.get_ident()
        if self.inside is not None and self.inside != me:  # (two at once: batches split, or poll() fails)
            raise _in_another_thread(self.settings.label)
        self.thread = self.inside = me  # (siblings: the thread that iterates, once it does)
        try:
            batch = self._waited(self.next_batch if self.rebatcher is None else self._next_rebatched)
        except StopIteration:
            if not self.ended and self.epoch is not None:  # (an epoch's end: its BYE says so)
                shared.epoch_done = self.epoch - 1
            raise
        finally:  # (first: a Ctrl-C raised as a call in here returns must not leave it set)
            self.inside = None
        shared.epoch_done = None
        shared.taken_batches += 1
        shared.taken_samples += self.samples or 0
        return batch

    def _waited(self, get: Callable[[], Any]) -> Any:
        """``get()``, its time counted as waiting for data (STATS, ``status``; a wait in
        progress counts: the producer sees consumers that all wait, see producer/stuck.py)."""
        shared = self.shared
        t0 = shared.wait_started = time.monotonic()
        try:
            return get()
        finally:  # (cleared first: a Ctrl-C raised as monotonic() returns loses only the sum)
            shared.wait_started = None
            shared.waiting += time.monotonic() - t0

    def _skip_rest(self) -> None:
        """The rest of an epoch whose loop was left early: received and let go."""
        while self.mid_epoch:
            try:
                self.next_batch()
            except StopIteration:
                return

    def _next_rebatched(self) -> Any:
        assert self.rebatcher is not None
        while not self.ready:
            if self.stop_pending:
                self.stop_pending = False
                self._forget_pushed()
                raise StopIteration
            try:
                batch = self.next_batch()
            except StopIteration:
                tail = self.rebatcher.flush()
                if tail is None:
                    self._forget_pushed()
                    raise
                self.ready.append(tail)
                self.stop_pending = True
                continue
            n, first = self.samples or 0, 0  # (counted by the I/O thread)
            if self.restored is not None and self.last == (self.restored.epoch, self.restored.index):
                first, self.restored = resume.offset_into(self.restored, n), None
            if not self.pushed:
                self.pushed_epoch = self.last[0]
            start = self.pushed[-1][1] + self.pushed[-1][2] if self.pushed else -first
            self.pushed.append((self.last[1], start, n))
            self.ready.extend(self.rebatcher.push(batch, first))
            batch = None  # the rebatcher's pending views alone hold it while we wait for the next
        out = self.ready.popleft()
        self.samples = batch_length(out)  # of the batch handed out, as next_batch() sets it
        self.handed += self.samples or 0
        while len(self.pushed) > 1 and self.pushed[0][1] + self.pushed[0][2] <= self.handed:
            self.pushed.popleft()  # all handed out: no position lies in it any more
        return out

    def _forget_pushed(self) -> None:
        """The re-cut epoch is over: no position lies in its producer batches any more."""
        self.pushed.clear()
        self.handed = 0

    def restore(self, position: Position | None) -> None:
        """Start from ``position`` (a group member's, sent with its READY)."""
        self.restored = position
        if position is not None:
            self.epoch, self.next_index = position.epoch, position.index

    def position(self) -> Position | None:
        """Where this consumer is: what a restored one continues from (None: nothing yet)."""
        if self.epoch is None:
            return None
        cut = resume.recut_position(
            self.stream, self.pushed_epoch, self.pushed, self.handed, self.stop_pending
        )
        return cut or Position(self.stream, self.epoch, self.next_index)

    def _note_position(self, kind: str, epoch: int, index: int) -> None:
        """After taking a batch (``index`` of ``epoch``) or an epoch's end; on the first one
        after a restore, say what was missed."""
        if self.restored is not None and not self.resume_checked:
            self.resume_checked = True
            first = index - index % self.group_size if kind == BATCH else self.epoch_span or index
            self._report_resume(epoch, first)  # a rank's first batch is its round's start + rank
        self.last, self.taken_any = (epoch, index), True
        if kind == EPOCH_END:
            self.epoch, self.next_index = epoch + 1, 0
            return
        size = self.group_size  # a group resumes at a round's start
        self.epoch, self.next_index = epoch, (index // size + 1) * size

    def _report_resume(self, epoch: int, index: int, ended: bool = False) -> None:
        """What a restored consumer missed, its first entry batch ``index`` of ``epoch`` (or the end)."""
        restored = self.restored
        assert restored is not None
        label, policy = self.settings.label, self.settings.late_join
        if restored.stream != self.stream:
            self.restored = None
            log.warning(
                "consumer %r was restored from a state saved on another stream (its producer has been "
                "restarted since): it starts as a late joiner (late_join=%r), at batch %d of epoch %d",
                label, policy, index, epoch,
            )  # fmt: skip
            return
        self.missed = resume.missed(restored, epoch, index, self.epoch_span)
        if self.missed or (self.missed is None and (epoch, index) != (restored.epoch, restored.index)):
            self.restored = None  # its offset is in a batch it will not get
            where = f"it goes on at batch {index} of epoch {epoch}"
            where = f"the stream ended before epoch {epoch}" if ended else where
            log.warning(
                "consumer %r was restored at batch %d of epoch %d, which the producer no longer has: "
                "%s (late_join=%r), %s batches missed",
                label, restored.index, restored.epoch, where, policy, "?" if self.missed is None else self.missed,
            )  # fmt: skip

    def next_batch(self) -> Any:
        """The next producer batch of the current epoch, or StopIteration at its end."""
        if self.ended:
            raise StopIteration
        if self.error is not None:
            raise self.error
        shared = self.shared
        if shared.violations or shared.interrupted:  # (asked here: a call costs a few us)
            shared.raise_noted()
        kind, payload = self.turns.take(self._check_waiting)
        while kind in (SKIPPED, RESTARTED):
            if kind == SKIPPED:
                self._note_skipped(payload)
            else:  # positions from here are on the successor's stream
                self.stream, again = payload
                if again:
                    self.repeated = (self.repeated or 0) + again
            kind, payload = self.turns.take(self._check_waiting)
        if kind == BATCH:
            if time.monotonic() - shared.io_tick > self.settings.timeout / 2 or not shared.synced.is_set():
                wait_checks.catch_up_after_freeze(self)
            if self.settings.group is not None and not self.settings.copy:  # (a copy costs ms: not here)
                self.turns.read_waiting()  # (a recv a batch, for a group member only)
        if kind in (BATCH, EPOCH_END):
            epoch, index = (payload[1], payload[2]) if kind == BATCH else (payload, 0)
            if shared.cut_off is not None and epoch > shared.cut_until:
                self.error = shared.cut_off  # evicted, or its group broke, while this was queued
                raise self.error
            self._note_position(kind, epoch, index)
        if kind == BATCH:
            self.mid_epoch = True
            batch, _, _, seq, token, release, self.samples, reader = payload
            self.taken_seq = seq
            # Counted as held from here (not when built): the hoarding check must not count a
            # batch the I/O thread is still building or queueing. A batch delivered as a copy
            # dropped its views in the I/O thread already: it holds nothing.
            if release() is not None:  # (its owner is alive)
                shared.live.add(seq)
                if not reader.at_once:  # (host memory: nothing to note)
                    reader.handed_out(token)
            if self.first_batch:
                self.first_batch = False
                if index >= self.group_size and not self.resume_checked:  # (a restored one said where it is)
                    log.warning(
                        "consumer %r joined epoch %d at its batch %d (late_join=%r): this first epoch is partial",
                        self.settings.label,
                        epoch,
                        index,
                        self.settings.late_join,
                    )
            return batch
        self.mid_epoch = False
        if kind == EPOCH_END:
            if self.skipped_epoch:
                log.warning(
                    "consumer %r skipped %d batches of epoch %d: it fell more than max_lag batches behind the fastest",
                    self.settings.label,
                    self.skipped_epoch,
                    payload,
                )
                self.skipped_epoch = 0
            raise StopIteration
        if kind == END:
            self.ended = True
            reason, end_epoch = payload
            if self.restored is not None and not self.resume_checked:  # (nothing came before it)
                self.resume_checked = True
                self._report_resume(end_epoch, 0, ended=True)
            if reason:
                raise ProducerLost(f"the producer at {self.settings.endpoint} ended the stream: {reason}")
            raise StopIteration
        self.error = payload
        raise payload

    def _note_skipped(self, count: int) -> None:
        if not self.skipped:
            log.warning(
                "consumer %r fell more than max_lag batches behind the fastest consumer (stragglers='skip'): "
                "it skips batches from now on; Consumer.skipped counts them",
                self.settings.label,
            )
        self.skipped += count
        self.skipped_epoch += count

    def _check_waiting(self) -> None:
        """Each TICK of a wait in next(): raise rather than wait for a batch that cannot come."""
        wait_checks.check_hoarding(self)
        siblings.check(self)
        wait_checks.warn_slow_start(self)


def _in_another_thread(label: str) -> RuntimeError:
    return RuntimeError(
        f"consumer {label!r} is in next() in another thread: a consumer is iterated by one thread "
        "at a time, as a DataLoader iterator is; give each thread a Consumer of its own"
    )


class EpochIterator:
    """One epoch of ``for batch in consumer``; a class so no generator frame pins a batch."""

    def __init__(self, batches: Batches, owner: object) -> None:
        self._batches = batches
        self._owner = owner  # the Consumer: `for b in Consumer(...)` keeps it alive for the epoch
        self._done = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._batches.next_for_user()
        except StopIteration:
            self._done = True
            raise
