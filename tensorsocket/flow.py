"""The pure state machine of slots, consumers, cursors and epochs: events in, deliveries out.

No sockets, clocks or threads: the producer's I/O loop feeds it events (a consumer joined,
released, left; the producer reserved a slot, published a batch, ended an epoch or the
stream) and sends the :class:`Deliver` actions it returns. Everything about correctness
lives here and is property-tested.

The stream is a log of entries numbered by a global sequence ``seq``: BATCH entries (each
in a slot), EPOCH_END markers and one final END. Each consumer has a ``cursor`` (the next
seq it will be sent, or ``None`` while it waits for the next epoch boundary) and the set of
batches it ``held`` (sent and not yet released), at most ``prefetch`` of them.

Invariants (checked by :meth:`Flow.check`):

* every slot is FREE (never written), FILLING (reserved by the producer, no holders) or
  PUBLISHED (holds batch ``seq``; its holders are exactly the consumers holding ``seq``);
* a slot is reserved only when no consumer holds its batch and every consumer's cursor is
  past it, so held or not-yet-sent batches are never overwritten;
* each consumer receives a contiguous run of entries, each once, in seq order, starting
  at an epoch's first entry (the whole epoch) - never in the middle of one;
* progress: when every consumer releases what it holds, a slot becomes reservable.

Joining: a consumer that arrives while every batch of the current epoch is still resident
in a slot starts at the epoch's first batch (the others simply wait for it); otherwise it
waits for the next epoch boundary. After END, a joiner is sent END at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any


class EntryKind(Enum):
    BATCH = "batch"
    EPOCH_END = "epoch_end"
    END = "end"


@dataclass(frozen=True)
class Entry:
    """One position of the stream; ``payload`` is opaque here (the encoded message)."""

    seq: int
    kind: EntryKind
    slot: int | None
    payload: Any


@dataclass(frozen=True)
class Deliver:
    """Action: send ``entry`` to ``consumer``."""

    consumer: Hashable
    entry: Entry


class SlotState(IntEnum):
    """FREE -> FILLING (reserve) -> PUBLISHED (publish) -> FILLING (reserve again) ...;
    FILLING -> FREE on cancel."""

    FREE = 0
    FILLING = 1
    PUBLISHED = 2


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    seq: int | None = None
    holders: set[Hashable] = field(default_factory=set)


@dataclass
class ConsumerState:
    """What the flow knows of one consumer. Read-only for callers."""

    prefetch: int
    cursor: int | None
    held: dict[int, int] = field(default_factory=dict)  # seq -> slot
    received: int = 0  # batches sent, for status
    finished: bool = False  # END was sent


class Flow:
    """Slots, consumers and the stream log. See the module docstring for the rules."""

    def __init__(self, slots: int) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        self._slots = [_Slot() for _ in range(slots)]
        self._log: dict[int, Entry] = {}
        self._consumers: dict[Hashable, ConsumerState] = {}
        self.next_seq = 0
        self.epoch = 0  # the epoch being published
        self._epoch_start = 0  # seq of the current epoch's first entry
        # True while no batch of the current epoch has been overwritten, i.e. while a
        # joiner can still be sent the whole epoch from its first batch.
        self._replay_open = True
        self.ended = False

    # ------------------------------------------------------------------ queries

    @property
    def consumers(self) -> dict[Hashable, ConsumerState]:
        return self._consumers

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def finished(self) -> bool:
        """True once END is published and every remaining consumer has been sent it."""
        return self.ended and all(c.finished for c in self._consumers.values())

    def holders(self, slot: int) -> frozenset[Hashable]:
        return frozenset(self._slots[slot].holders)

    # ------------------------------------------------------------------ membership

    def join(self, cid: Hashable, prefetch: int) -> list[Deliver]:
        if cid in self._consumers:
            raise ValueError(f"consumer {cid!r} already joined")
        if type(prefetch) is not int or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        if self.ended:
            cursor: int | None = self.next_seq - 1  # the END entry, always kept
        elif self._replay_open:
            cursor = self._epoch_start
        else:
            cursor = None
        state = self._consumers[cid] = ConsumerState(prefetch=prefetch, cursor=cursor)
        return self._deliver(cid, state)

    def leave(self, cid: Hashable) -> None:
        """A consumer left or was evicted: drop it and everything it held. Idempotent."""
        state = self._consumers.pop(cid, None)
        if state is None:
            return
        for slot in state.held.values():
            self._slots[slot].holders.discard(cid)
        self._trim()

    def release(self, cid: Hashable, seqs: Iterable[int]) -> list[Deliver]:
        """A consumer is done with these batches. Unknown or repeated seqs are ignored."""
        state = self._consumers.get(cid)
        if state is None:
            return []
        for seq in seqs:
            slot = state.held.pop(seq, None)
            if slot is not None:
                self._slots[slot].holders.discard(cid)
        out = self._deliver(cid, state)
        self._trim()
        return out

    # ------------------------------------------------------------------ producer side

    def reserve(self) -> int | None:
        """Pick a slot to write the next batch into, or None if every slot is still needed.

        Prefers a never-used slot, then the one holding the oldest batch (so the batches that
        stay resident, and so replayable, are the most recent ones).
        """
        if self.ended:
            raise RuntimeError("the stream has ended; nothing more can be published")
        best: int | None = None
        for i, s in enumerate(self._slots):
            if s.state is SlotState.FREE:
                best = i
                break
            if s.state is SlotState.PUBLISHED and self._reusable(s):
                if best is None or s.seq < self._slots[best].seq:  # type: ignore[operator]
                    best = i
        if best is not None:
            slot = self._slots[best]
            if slot.seq is not None and slot.seq >= self._epoch_start:
                self._replay_open = False
            slot.state, slot.seq = SlotState.FILLING, None
        return best

    def cancel(self, slot: int) -> None:
        """Give back a reserved slot that was not published (the write failed)."""
        s = self._slots[slot]
        if s.state is not SlotState.FILLING:
            raise RuntimeError(f"slot {slot} is not being filled")
        s.state = SlotState.FREE

    def publish(self, slot: int, payload: Any) -> list[Deliver]:
        """The reserved ``slot`` now holds batch ``next_seq``; send it to whoever may take it."""
        s = self._slots[slot]
        if s.state is not SlotState.FILLING:
            raise RuntimeError(f"slot {slot} was not reserved")
        s.state, s.seq = SlotState.PUBLISHED, self.next_seq
        return self._append(EntryKind.BATCH, slot, payload)

    def end_epoch(self, payload: Any) -> list[Deliver]:
        """Append an EPOCH_END marker; consumers waiting for a boundary start after it."""
        out = self._append(EntryKind.EPOCH_END, None, payload)
        self.epoch += 1
        self._epoch_start = self.next_seq
        self._replay_open = True
        for state in self._consumers.values():
            if state.cursor is None:
                state.cursor = self.next_seq
        return out

    def end_stream(self, payload: Any) -> list[Deliver]:
        """Append END; every consumer, including waiting ones, is sent it after its batches."""
        end_seq = self.next_seq
        for state in self._consumers.values():
            if state.cursor is None:
                state.cursor = end_seq
        out = self._append(EntryKind.END, None, payload)
        self.ended = True
        return out

    # ------------------------------------------------------------------ internals

    def _append(self, kind: EntryKind, slot: int | None, payload: Any) -> list[Deliver]:
        if self.ended:
            raise RuntimeError("the stream has ended; nothing more can be published")
        entry = Entry(self.next_seq, kind, slot, payload)
        self._log[entry.seq] = entry
        self.next_seq += 1
        out: list[Deliver] = []
        for cid, state in self._consumers.items():
            out.extend(self._deliver(cid, state))
        self._trim()
        return out

    def _deliver(self, cid: Hashable, state: ConsumerState) -> list[Deliver]:
        out = []
        while state.cursor is not None and state.cursor < self.next_seq:
            entry = self._log[state.cursor]
            if entry.kind is EntryKind.BATCH:
                if len(state.held) >= state.prefetch:
                    break
                state.held[entry.seq] = entry.slot  # type: ignore[assignment]
                self._slots[entry.slot].holders.add(cid)  # type: ignore[index]
                state.received += 1
            elif entry.kind is EntryKind.END:
                state.finished = True
            out.append(Deliver(cid, entry))
            state.cursor += 1
        return out

    def _resident(self, seq: int) -> bool:
        entry = self._log.get(seq)
        if entry is None or entry.kind is not EntryKind.BATCH:
            return entry is not None
        slot = self._slots[entry.slot]  # type: ignore[index]
        return slot.state is SlotState.PUBLISHED and slot.seq == seq

    def _reusable(self, slot: _Slot) -> bool:
        return not slot.holders and all(
            c.cursor is None or c.cursor > slot.seq  # type: ignore[operator]
            for c in self._consumers.values()
        )

    def _trim(self) -> None:
        """Forget log entries no consumer can still be sent and no joiner can replay.

        The log stays short: entries at or past the slowest cursor are unsent batches, which
        are resident (at most one per slot), and replayable ones are resident too.
        """
        cursors = [c.cursor for c in self._consumers.values() if c.cursor is not None]
        keep_from = min(cursors, default=self.next_seq)
        if self._replay_open:
            keep_from = min(keep_from, self._epoch_start)
        keep_from = min(keep_from, self.next_seq - 1)  # END stays for late joiners
        while self._log:
            seq = next(iter(self._log))
            if seq >= keep_from:
                break
            del self._log[seq]

    def check(self) -> None:
        """Assert every invariant of the module docstring; for tests."""
        for i, s in enumerate(self._slots):
            if s.state is not SlotState.PUBLISHED:
                assert s.seq is None and not s.holders, (i, s)
            for cid in s.holders:
                assert self._consumers[cid].held.get(s.seq) == i, (i, s, cid)  # type: ignore[arg-type]
        for cid, c in self._consumers.items():
            for seq, slot in c.held.items():
                assert self._slots[slot].seq == seq and cid in self._slots[slot].holders
                assert c.cursor is not None and seq < c.cursor
            assert len(c.held) <= c.prefetch
            if c.cursor is not None:
                for seq in range(c.cursor, self.next_seq):
                    assert seq in self._log, (cid, seq)
                    assert self._resident(seq), (cid, seq)
        if self._replay_open and not self.ended:
            for seq in range(self._epoch_start, self.next_seq):
                assert self._resident(seq), ("replay window lost", seq)
        batches = sum(e.kind is EntryKind.BATCH for e in self._log.values())
        assert batches <= len(self._slots), ("log holds non-resident batches", batches)
