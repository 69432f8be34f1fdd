"""The replay half of the flow state machine (:class:`tensorsocket.flow.Flow` inherits it):
which published batches the producer keeps beyond their places, and giving a consumer that
is to be sent a kept batch no longer in a place that batch again, through a place
(:meth:`Replaying.restage`, :meth:`Replaying.restaged`). Pure like the rest of the flow, and
tested with it; only :class:`~tensorsocket.flow.Flow` makes one."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .flow_types import Action, ConsumerState, Entry, EntryKind, Place, PlaceState


class Replaying:
    """Flow's methods for kept batches and re-staging; the state is the flow's own."""

    # (set by Flow.__init__; listed for readers)
    _places: list[Place]
    _free: list[int]
    _log: dict[int, Entry]
    consumers: dict[Hashable, ConsumerState]
    next_seq: int
    ended: bool
    _epoch_start: int
    _replay_from: int
    _replay_open: bool
    _kept: Any  # collections.deque[int]: kept seqs, oldest first (a suffix of the batches)
    _kept_set: set[int]
    _restaging: dict[int, int]  # place -> the kept seq being written into it again
    blocked: bool = False  # see restage()

    def _keep(self, seq: int, keep: int) -> None:
        """Batch ``seq`` was just published: keep the newest ``keep`` batches; one still owed
        to a consumer and in no place stays kept past that."""
        if keep:
            self._kept.append(seq)
            self._kept_set.add(seq)
        if len(self._kept) <= keep:
            return
        owed_from = self._owed_from()
        while len(self._kept) > keep:
            oldest = self._kept[0]
            if oldest >= owed_from and not self._resident(oldest):
                break  # a consumer is still owed it, and only the producer has it
            self._kept.popleft()
            self._kept_set.discard(oldest)
            if not self._resident(oldest):
                self._lose(oldest)

    def restage(self, grow: bool = False) -> tuple[int, int] | None:
        """A kept batch some consumer waits for (it is in no place now: a joiner replaying it)
        and a place to write it into again, or None while there is none or no place is free.
        The producer writes it there and calls :meth:`restaged`. Ignores the window: only the
        batch's own consumers are sent it.

        The place: a never-used one, else the oldest batch nobody holds or is owed, else, of
        the kept batches nobody holds and only waiting consumers are owed, the newest (the one
        its waiters need last). A batch owed to a consumer that is not waiting is never taken:
        it would make that one wait for a re-stage too. Else, with ``grow`` and every place
        held, a new place: a trainer in a ``for`` loop holds the batch it last got while it
        waits for the next, so with as many such batches as places nothing could ever move
        again (the others wait for the joiner, the joiner for a place). The producer asks
        for one once a joiner has waited a while (holders that are only slow let go), so
        the places grow rarely, by one, and never past what the consumers may hold (their
        ``prefetch``) plus one. ``blocked``: a consumer waits for a re-stage, and no place
        could take its batch just now."""
        wanted = [c.wants for c in self.consumers.values() if c.wants is not None]
        if wanted:  # (none, nearly always: asked before every batch's place)
            busy = set(self._restaging.values())
            wanted = [seq for seq in wanted if seq not in busy]
        self.blocked = False
        if not wanted:
            return None
        seq = min(wanted)  # type: ignore[type-var]
        place = self._spare()
        if place is None:
            streaming_from = min(  # owed from here on to a consumer that is not waiting
                (c.cursor for c in self.consumers.values() if c.cursor is not None and c.wants is None),
                default=self.next_seq,
            )
            kept = [
                i
                for i in self._unheld()
                if self._places[i].seq in self._kept_set and self._places[i].seq < streaming_from  # type: ignore[operator]
            ]
            if kept:
                place = max(kept, key=lambda i: self._places[i].seq)  # type: ignore[arg-type, return-value]
            elif grow and self._all_held():
                place = self._one_more_place()
            else:
                self.blocked = True
                return None
        self._fill(place)
        self._restaging[place] = seq
        return seq, place

    def every_place_held(self) -> bool:
        """The window is open, yet every place holds a batch some consumer holds."""
        return not self.ended and self._window_open() and self._all_held()

    def _all_held(self) -> bool:
        """Every place holds a published batch that some consumer holds: none could be reused."""
        return all(s.state is PlaceState.PUBLISHED and s.holders for s in self._places)

    def grow_for_next(self) -> int | None:
        """One more place, reserved for the next batch, if the window is open and every place
        holds a batch some consumer holds; else None. Consumers that each keep a few batches (a
        loop left early, gradient accumulation) can hold every place between them, none of them
        all it may hold, and then none of them could ever be sent another batch. The producer
        asks only once every consumer has waited a while for one (``producer/stuck.py``; under
        skip, one consumer: stragglers' held batches must not pace it): a consumer that is
        merely slow lets go. The places so grow rarely, by one, and never past
        what the consumers may hold (their ``prefetch``) plus one."""
        if not self.every_place_held():
            return None
        return self._fill(self._one_more_place())

    def _one_more_place(self) -> int:
        """A new place, free (every place was held: it is the only free one)."""
        self.add_places(1)
        return self._free.pop()

    def restaged(self, place: int, payload: Any) -> list[Action]:
        """The place :meth:`restage` gave holds its batch again (``payload``: the message that
        names this place); send it to the consumers waiting for it."""
        seq = self._restaging.pop(place, None)
        s = self._places[place]
        if seq is None or s.state is not PlaceState.FILLING:
            raise RuntimeError(f"place {place} is not being filled again")
        s.state, s.seq = PlaceState.PUBLISHED, seq
        entry = self._log.get(seq)
        if entry is None:  # nobody can still be sent it (its waiters left): it stays, unwanted
            return []
        self._log[seq] = Entry(seq, entry.kind, place, payload, entry.epoch, entry.index)
        out: list[Action] = []
        for cid, state in self.consumers.items():
            if state.wants == seq:
                out.extend(self._deliver(cid, state))
        out.extend(self._settle())
        self._trim()
        return out

    def kept_from(self) -> int:
        """The oldest seq the producer must still keep (``next_seq`` if none): it may let go of
        every batch before it."""
        return self._kept[0] if self._kept else self.next_seq

    def place_of(self, seq: int) -> int | None:
        """The place batch ``seq`` is in, or None if it is in none."""
        entry = self._log.get(seq)
        return (
            entry.place
            if entry is not None and entry.kind is EntryKind.BATCH and self._resident(seq)
            else None
        )

    def kept(self) -> int:
        """Batches the producer keeps for replay (in a place or not)."""
        return len(self._kept)

    def _fill(self, place: int) -> int:
        """Reserve ``place`` (FREE, or PUBLISHED with nobody holding it): its batch, unless
        kept, is lost to joiners from now on."""
        s = self._places[place]
        if s.seq is not None and s.seq not in self._kept_set:
            self._lose(s.seq)
        s.state, s.seq = PlaceState.FILLING, None
        return place

    def _lose(self, seq: int) -> None:
        """Batch ``seq`` is in no place and not kept: nobody can be sent it, or anything before it."""
        self._replay_from = max(self._replay_from, seq + 1)
        if seq >= self._epoch_start:
            self._replay_open = False

    def _spare(self) -> int | None:
        """A never-used place (taken off the free list), else the one holding the oldest batch
        nobody holds or is owed; None if there is neither."""
        if self._free:
            return self._free.pop()
        spare, oldest = None, self._owed_from()  # (one pass: this runs for every batch)
        published = PlaceState.PUBLISHED
        for i, s in enumerate(self._places):  # (``s.unheld`` spelled out: a call a place)
            if s.state is published and not s.holders and s.seq < oldest:  # type: ignore[operator]
                spare, oldest = i, s.seq
        return spare

    def _unheld(self) -> list[int]:
        return [i for i, s in enumerate(self._places) if s.unheld]

    def _owed_from(self) -> int:
        """Batches from here on are still owed to some consumer."""
        owed = None  # (a loop, not min() over a generator: a call a consumer, every batch)
        for c in self.consumers.values():
            cursor = c.cursor
            if cursor is not None and (owed is None or cursor < owed):
                owed = cursor
        return self.next_seq if owed is None else owed

    def _available(self, seq: int) -> bool:
        """Can entry ``seq`` be sent: in its place, or kept (and so written there again)?"""
        return self._resident(seq) or seq in self._kept_set

    # Flow's own, used here
    def add_places(self, n: int) -> None:
        raise NotImplementedError

    def _window_open(self) -> bool:
        raise NotImplementedError

    def _resident(self, seq: int) -> bool:
        raise NotImplementedError

    def _deliver(self, cid: Hashable, state: ConsumerState) -> list[Action]:
        raise NotImplementedError

    def _settle(self) -> list[Action]:
        raise NotImplementedError

    def _trim(self) -> None:
        raise NotImplementedError
