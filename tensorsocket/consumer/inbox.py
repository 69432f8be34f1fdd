"""What a consumer makes of its producer's messages: each frame read from the link becomes
a queued batch, epoch end, skip or error, and each dropped batch a RELEASE.

Both of the consumer's threads run it, one at a time (under ``Shared.link_lock``): the I/O
thread, and the caller's thread while it waits in next() for a batch of host shared memory
(see :mod:`tensorsocket.consumer.caller_turn`). So nothing here waits for the other thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import protocol
from ..errors import Evicted, GroupBroken, ProducerLost, ProtocolError
from ..layout_table import Recipes
from ..protocol import Kind
from ..transport import Reader
from ..transport.shm import KIND as HOST_MEMORY
from . import delivery, resume
from .link import Link
from .shared import BATCH, END, EPOCH_END, ERROR, SKIPPED, Settings, Shared

log = logging.getLogger("tensorsocket")


class Inbox:
    """The link, the reader, the layouts and where the stream is: the state the messages
    change. Only the thread holding ``shared.link_lock`` touches it."""

    def __init__(self, shared: Shared, settings: Settings, link: Link, stream: str) -> None:
        self.shared, self.settings, self.link = shared, settings, link
        self.releases = delivery.Releases(shared)  # what each batch's finalizer needs
        delivery.rescue_interrupted_releases()
        self.endpoint = settings.endpoint
        self.reader: Reader
        self.recipes: Recipes
        # For a rejoin: the stream and the last entry received (its seq and where the next
        # batch is), so a successor resumes right after it and what came again is dropped.
        self.stream = stream
        self.last_seq = -1
        # we switched to a stream that starts our epoch again and got nothing of it yet: a
        # successor of that stream is rejoined at next_at all the same (last_seq is -1)
        self.rejoins_fresh = False
        self.next_at: tuple[int, int] | None = None if settings.resume is None else settings.resume[1:]
        self.drop_through = -1  # after a rejoin: entries up to this seq came before
        # after a switch to a stream that starts an epoch before ours again: its epochs before ours
        self.drop_before_epoch = -1
        self.rejoined_at: tuple[int, int] | None = None  # after a rejoin: where the next batch should be
        # The epoch of the last batch received and where in it the first batch received was (a
        # late joiner's first epoch starts part-way): what it had comes again after a restart.
        # Restored: its epoch, from its start (what its checkpoint had of it).
        self.began: tuple[int, int] = (-1, 0) if settings.resume is None else (settings.resume[1], 0)
        self.size = 1 if settings.group is None else settings.group[2]
        self.batches_per_epoch: int | None = None
        self.last_seen = time.monotonic()  # the last message from the producer, read by either thread
        self.over = False  # the caller's thread read the end of this consumer's stream (EVICTED, say)
        self.freed: str | None = None  # a batch lost: its arena was gone before we mapped it (why)
        # (last_seq, next_at, began) before it: a frozen consumer may read on past it
        self.before_freed: tuple[int, tuple[int, int], tuple[int, int]] | None = None

    def caller_may_read(self) -> bool:
        """Whether the caller's thread may read the link now: a session (no ZeroMQ socket to
        share), open, whose batches are views of host memory (built where they are read: a
        GPU reader keeps its work on the I/O thread)."""
        link = self.link
        return (
            link.switched
            and not link.closed
            and not self.shared.stop.is_set()
            and self.reader.kind == HOST_MEMORY
            and self.reader.delivery == "views"
        )

    def _send(self, frame: bytes) -> None:
        self.link.send(frame)

    def receive(self) -> bool:
        """Handle every waiting message; False when the stream is over for this consumer."""
        while True:
            frame = self.link.recv()
            if frame is None:
                return True
            if not self.handle(frame):
                return False

    def handle(self, frame: bytes) -> bool:
        """Handle one message; False when the stream is over for this consumer.

        A BATCH in its compact form (nearly every message) takes the shortest way: decoded
        into a tuple, built and queued here, each step one call. Every call on this path
        costs a few us from cold caches, several times its cost in a hot loop: the rest of a
        consumer's step (or the producer) ran in between."""
        shared = self.shared
        self.last_seen = time.monotonic()
        try:
            if frame[:2] == protocol.BATCH_HEAD:
                fields = protocol.decode_batch(frame)
            else:
                kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
                if kind is not Kind.BATCH:
                    return self._other(kind, msg)
                fields = tuple(msg[name] for name in protocol.BATCH_FIELDS)  # (a layout sent inline)
            seq, epoch, index, _, layout, _ = fields
            if seq <= self.drop_through or self.rejoined_at is not None or epoch < self.drop_before_epoch:
                if not self._new(Kind.BATCH, seq, epoch, index):
                    return True
            else:  # (what _new notes, inline)
                self.last_seq = seq
                self.next_at = (epoch, (index // self.size + 1) * self.size)
                if epoch != self.began[0]:
                    self.began = (epoch, index // self.size * self.size)
            if self.freed is not None:  # a batch before it was lost: yield none after it
                self._send(protocol.encode_release([seq]))
                return True
            recipe = self.recipes.get(layout)
            try:
                batch, token, release = delivery.build(
                    fields, recipe, self.reader, self.releases, self.settings.copy
                )
            except FileNotFoundError as exc:
                return self._unmapped(seq, epoch, index, exc)
            # the samples counted here, off the training thread (the same for every batch of a layout)
            samples = recipe.samples if recipe.counted else recipe.count(batch)
            shared.queue.put((BATCH, (batch, epoch, index, seq, token, release, samples, self.reader)))
        except (ProtocolError, KeyError, ValueError) as exc:
            shared.fail(ProtocolError(f"bad message from the producer at {self.endpoint}: {exc}"))
            return False
        return True

    def _other(self, kind: Kind, msg: dict[str, Any]) -> bool:
        """Handle a message other than BATCH (ProtocolError, KeyError or ValueError for a bad
        one, as :meth:`handle` says); False when the stream is over for this consumer."""
        shared = self.shared
        if kind is Kind.EPOCH_END and not self._new(kind, msg["seq"], msg["epoch"], 0):
            return True
        if self.freed is not None and kind is Kind.EPOCH_END:
            return True  # (a straggler skipped ahead is sent epoch ends before its eviction)
        if self.freed is not None and kind is Kind.END:
            # Not evicted (that would have come first): the producer closed without us.
            shared.fail(ProducerLost(f"the producer at {self.endpoint} is gone: {self.freed}"))
            return False
        if kind is Kind.SKIPPED:
            shared.queue.put((SKIPPED, msg["count"]))
        elif kind is Kind.ARENA:
            self.reader.announce(msg["arena"])
        elif kind is Kind.LAYOUT:
            self.recipes.define(msg["number"], msg["layout"])
        elif kind is Kind.EPOCH_END:
            shared.queue.put((EPOCH_END, msg["epoch"]))
        elif kind is Kind.END:
            if self.rejoined_at is not None:  # placed past the stream's end: its epoch ends
                self._after_rejoin(kind, msg["epoch"], 0)
            # Every earlier BATCH is built (so its arena mapped): tell the producer
            # it may now free its arenas.
            shared.stream_over = True
            shared.queue.put((END, (msg["reason"], msg["epoch"])))
            self._send(shared.bye())
        elif kind is Kind.EVICTED and shared.stream_over:
            # We said BYE at END, so a later RELEASE or MODIFIED draws this; after END
            # no place is reused, so the queued batches stay valid.
            return True
        elif kind is Kind.EVICTED:
            # Mid-stream (after END the branch above applies): our queued batches'
            # places get reused, so never yield them.
            shared.cut_until = -1
            shared.cut_off = Evicted(
                f"the producer at {self.endpoint} evicted this consumer: {msg['reason']}"
            )
            shared.fail(shared.cut_off)
            return False
        elif kind is Kind.GROUP_BROKEN:
            # Nothing more comes, but what we hold stays ours until released: this thread
            # goes on heartbeating (not shared.fail: a silent consumer is evicted, and its
            # places reused under the batches it still holds) and releasing.
            broken = GroupBroken(f"the producer at {self.endpoint} reports: {msg['reason']}")
            log.error("%s", broken)
            # Queued batches of a later epoch than the one the lost rank finished (all of them
            # if it left mid-epoch) are of no use to DDP: raised instead of yielded.
            shared.cut_until = -1 if msg["until"] is None else msg["until"]
            shared.cut_off = broken
            shared.queue.put((ERROR, broken))
        elif kind is Kind.PLACED and self.settings.group is not None:
            self._placed(msg["epoch"], msg["index"], msg["skipped"])
        elif kind is Kind.ERROR:
            log.error("the producer at %s reports: %s", self.endpoint, msg["reason"])
        elif kind is Kind.STATUS:
            shared.synced.set()
        elif kind is not Kind.HEARTBEAT:
            raise ProtocolError(f"unexpected {kind.value} message from the producer")
        return True

    def _unmapped(self, seq: int, epoch: int, index: int, exc: FileNotFoundError) -> bool:
        """A batch whose arena was unlinked before this consumer first mapped it: the producer
        let go of the place, which it does only after it evicted this consumer (stopped past
        its timeout, say; the producer may even have finished and closed since), or when it
        closed without waiting for it. The batch is lost: release it, yield nothing after it
        (no batch, no epoch end), and let what follows say which: EVICTED raises Evicted, END
        ProducerLost. Or the producer died and a successor unlinked what it left: the batch was
        not received, and a rejoin goes on from it (``before_freed``)."""
        self.before_freed = (seq - 1, (epoch, index // self.size * self.size), self.began)
        self.freed = (
            f"batch {index} of epoch {epoch} was freed before this consumer read it "
            f"({exc.strerror}: {exc.filename})"
        )
        self._send(protocol.encode_release([seq]))
        return True

    def rejoin_from_freed(self) -> None:
        """A batch was lost because a successor unlinked it (:meth:`_unmapped`): we never had it,
        nor what came after it, so we rejoin from it, as if we had read nothing since (what
        the rejoin counts as had of the epoch too: found by chaos trials, a rank frozen with
        the next epoch's batches queued counted none of its epoch as had)."""
        assert self.before_freed is not None
        (self.last_seq, self.next_at, self.began), self.freed, self.before_freed = (
            self.before_freed,
            None,
            None,
        )

    def _new(self, kind: Kind, seq: int, epoch: int, index: int) -> bool:
        """Note where the stream is for a rejoin; False for an entry received before it (a
        successor publishes again from its restart point), or of an epoch before ours on a
        stream that starts an earlier epoch again: released at once, not yielded. (``index``: a
        BATCH's; 0 for an EPOCH_END.)"""
        if seq <= self.drop_through or epoch < self.drop_before_epoch:
            if kind is Kind.BATCH:
                self._send(protocol.encode_release([seq]))
            return False
        if self.rejoined_at is not None:
            self._after_rejoin(kind, epoch, index)
        self.last_seq = seq
        if kind is Kind.EPOCH_END:
            self.next_at = (epoch + 1, 0)
        else:
            self.next_at = (epoch, (index // self.size + 1) * self.size)
            if epoch != self.began[0]:
                self.began = (epoch, index // self.size * self.size)
        return True

    def _after_rejoin(self, kind: Kind, at_epoch: int, at_index: int) -> None:
        """The first entry after a rejoin (an epoch's end or the stream's: ``at_index`` 0). An
        epoch end it jumps over is ended here. Batches
        between where we rejoined and it were lost (the successor no longer had them: say, a
        consumer joined with a replay just before the crash, before the state file said so):
        said, and counted in ``missed``."""
        epoch, index = self.rejoined_at  # type: ignore[misc]
        self.rejoined_at, span = None, resume.epoch_span(self.batches_per_epoch, self.settings.group)
        for ended in range(epoch, at_epoch):
            # An epoch's end marker is not held, so it may have been in flight when the producer
            # died while the successor starts after it: end that epoch here, as it would have.
            self.shared.queue.put((EPOCH_END, ended))
        if kind is Kind.BATCH:
            first = (at_epoch, at_index - at_index % self.size)
        elif kind is Kind.END:  # the stream's end (``at_epoch``: the next, never begun)
            first = (at_epoch, 0)
        elif span is not None:  # an epoch's end: past its last batch (a group rank's: its last round)
            first = (at_epoch, span)
        else:
            return  # (how many came before that end cannot be told)
        if first == (epoch, index):
            return
        lost = resume.missed(resume.Position(self.stream, epoch, index), *first, span)
        if lost is not None and lost > 0:
            self.shared.missed += lost
            log.warning(
                "rejoined at batch %d of epoch %d, which the producer no longer had: %d batches missed",
                index, epoch, lost,
            )  # fmt: skip

    def _placed(self, epoch: int, index: int, skipped: int) -> None:
        """Our group rejoined a producer that starts our epoch again in a new order, and we had
        more of the old one than another rank: we go on at batch ``index`` of it (a rejoin after
        another crash too), and the ``skipped`` batches before it that we are not sent count in
        ``missed``, so ``repeated`` less ``missed`` is the same for every rank."""
        self.next_at = (epoch, index)
        self.shared.missed += skipped
        log.warning(
            "rank %d of group %r had more of epoch %d's old order than another rank: it skips its first %d "
            "batch(es) of the new order (counted in missed), so every rank ends the epoch after as many batches",
            self.settings.group[1], self.settings.group[0], epoch, skipped,  # type: ignore[index]
        )  # fmt: skip

    def send_releases(self) -> bool:
        """Release every retired batch (checking it was not changed while held); True if any."""
        shared, seqs = self.shared, []
        while shared.released:
            seq, token, nbytes, fingerprint, epoch, index, reader = shared.released.popleft()
            if reader is not self.reader:
                continue  # from a producer that died: nothing to release to
            if (
                fingerprint is not None
                and self.reader.checks_writes
                and self.reader.fingerprint(token, nbytes) != fingerprint
            ):
                self._report_modified(seq, epoch, index)
            seqs.append(seq)
        if not seqs:
            return False
        step = protocol.MAX_RELEASE_SEQS
        for start in range(0, len(seqs), step):
            self._send(protocol.encode_release(seqs[start : start + step]))
        return True

    def _report_modified(self, seq: int, epoch: int, index: int) -> None:
        message = delivery.modified(self.settings.label, epoch, index)
        log.error("%s", message)
        self.shared.violations.append(message)
        self._send(protocol.encode(Kind.MODIFIED, seq=seq, epoch=epoch, index=index))
