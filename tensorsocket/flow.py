"""The pure state machine of places, consumers, cursors and epochs: events in, actions out.

No sockets, clocks or threads: the producer's I/O loop feeds it events (a consumer joined,
released, left; the producer reserved a place, published a batch, ended an epoch or the
stream) and carries out the :class:`Deliver` and :class:`Skipped` actions it returns.
Everything about correctness lives here and is property-tested.

The stream is a log of entries numbered by a global sequence ``seq``: BATCH entries (each
in a *place*: an arena index, below the window or a replay place), EPOCH_END markers and one final END. Each consumer
has a ``cursor`` (the next seq it will be sent, or ``None`` while it waits for the next
epoch boundary) and the batches it ``held`` (sent and not yet released), at most
``prefetch`` of them. A consumer's *lag* is the number of published batches it has not
been sent yet.

Flow control: the producer publishes only while every consumer's lag is below ``window``
(so it runs at most ``window`` batches ahead of the slowest: the slowest sets the pace),
into a place nobody holds or still needs (``places >= window``; groups add some), oldest
overwritten first. Replay: the producer also *keeps* its newest batches where the loader put
them (``publish(..., keep=)``: no copy, no place). A consumer to be sent a kept batch whose
place was reused waits while the producer writes it into a place again (:meth:`Flow.restage`,
:meth:`Flow.restaged`), so a late joiner can be sent the epoch again. The loader is never
re-run.

Stragglers, with ``max_lag`` set (policy ``skip``): the window then bounds the lag of the
*leading* consumer (the one with the least lag) instead of the slowest, and a consumer more
than ``max_lag`` batches behind the leader is moved ahead past its oldest unsent batches,
which it never receives; a :class:`Skipped` action tells it how many, right where the gap
is. Epoch markers are never skipped. A joiner that starts behind the leader (a replay) is
exempt until it has caught up with the leader; meanwhile the others wait for it, as in
``stall``.

Joining (per consumer, :class:`LateJoin`): at an epoch's start, or after END, every policy
starts right there. Otherwise ``replay`` starts at the current epoch's first batch if every
batch of the epoch is still resident (the others wait for it), else at the next boundary;
``next_epoch`` waits for the boundary; ``now`` starts at the oldest batch from which the
stream is resident without a gap (its first epoch is partial).

Groups (:mod:`tensorsocket.flow_groups` has their rules): the members of a group are
consumers whose cursors pass over the batches that are not theirs; a member is sent its
batch once its round is decided. A group starts complete, as a unit; a member leaving breaks
it, and the others are sent nothing more (they stay, holding what they hold, until they go).

Invariants (checked by :func:`tensorsocket.flow_invariants.check_invariants`):

* every place is FREE (never written), FILLING (reserved by the producer, no holders) or
  PUBLISHED (holds batch ``seq``; its holders are exactly the consumers holding ``seq``);
* a place is reserved only when no consumer holds its batch and every consumer's cursor is
  past it or the batch is kept (a re-stage), so held batches are never overwritten, and
  every not-yet-sent batch is in its place or kept;
* each consumer receives a contiguous run of entries (gaps only where a Skipped says so,
  and only of batches), each once, in seq order, starting where its policy says;
* progress: when every consumer releases what it holds, a place becomes reservable, or a
  kept batch a consumer waits for can be re-staged.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import Any

from .flow_group_start import GroupStarts
from .flow_groups import (
    UNSAID,
    Forming,
    Group,
    GroupBroken,
    Membership,
    Said,
    Tail,
    nearer,
    past_end_of,
    sent_before,
    share,
    until_epoch,
)
from .flow_replay import Replaying
from .flow_types import (
    Action,
    ConsumerState,
    Deliver,
    Entry,
    EntryKind,
    LateJoin,
    Place,
    Placed,
    PlaceState,
    Skipped,
)

__all__ = [  # the values it works with, in flow_types; group rules, in flow_groups
    "Action", "ConsumerState", "Deliver", "Entry", "EntryKind", "Flow", "GroupBroken", "LateJoin",
    "Membership", "PlaceState", "Placed", "Said", "Skipped", "Tail", "UNSAID",
]  # fmt: skip


def _checked_places(window: Any, places: Any, max_lag: Any) -> int:
    """The number of places (default: the window); ValueError naming a bad argument."""
    if type(window) is not int or window < 1:
        raise ValueError(f"window (slots) must be a positive int, got {window!r}")
    places = window if places is None else places
    if type(places) is not int or places < window:
        raise ValueError(f"places must be an int >= window ({window}), got {places!r}")
    if max_lag is not None and (type(max_lag) is not int or not 1 <= max_lag < window):
        raise ValueError(
            f"max_lag must be an int from 1 to slots - 1 = {window - 1}, got {max_lag!r}: a consumer "
            "can only lag behind by batches the producer still keeps"
        )
    return places


class Flow(Replaying, GroupStarts):
    """Places, consumers and the stream log. See the module docstring for the rules."""

    def __init__(self, window: int, places: int | None = None, max_lag: int | None = None) -> None:
        places = _checked_places(window, places, max_lag)
        self.window = window
        self.max_lag = max_lag
        self._places = [Place() for _ in range(places)]
        self._free = list(range(places - 1, -1, -1))  # never used (or cancelled): lowest index first
        # The newest published batches the producer keeps (a suffix of the stream's batches),
        # and the places being filled again with one of them (place -> seq).
        self._kept: collections.deque[int] = collections.deque()
        self._kept_set: set[int] = set()
        self._restaging: dict[int, int] = {}
        self._replay_from = 0  # the first seq after every batch lost (in no place, not kept)
        self._log: dict[int, Entry] = {}
        self._before: dict[int, int] = {}  # seq -> batches published before it
        self.consumers: dict[Hashable, ConsumerState] = {}
        self.next_seq = 0
        self.published = 0  # batches
        self.epoch = 0  # the epoch being published
        self._epoch_start = 0  # seq of the current epoch's first entry
        self._epoch_starts: dict[int, int] = {0: 0}  # epoch -> its first seq, while in the log
        self._epoch_index = 0  # batches published in the current epoch
        self._epoch_batches: dict[int, int] = {}  # epoch -> its batches, once it ended (groups)
        self._forming = Forming()
        self._replay_open = True  # no batch of this epoch overwritten: a joiner can get all of it
        self.ended = False

    # ------------------------------------------------------------------ queries

    @property
    def place_count(self) -> int:
        return len(self._places)

    def finished(self) -> bool:
        """True once END is published and every remaining consumer has been sent it."""
        return self.ended and all(c.finished for c in self.consumers.values())

    def holders(self, place: int) -> frozenset[Hashable]:
        return frozenset(self._places[place].holders)

    def lag(self, cid: Hashable) -> int:
        """Published batches ``cid`` has not been sent yet (0 while it waits for a boundary)."""
        return self._lag(self.consumers[cid])

    def resident(self) -> int:
        """Published batches still in a place (in flight or kept for replay)."""
        return sum(s.state is PlaceState.PUBLISHED for s in self._places)

    def serving(self) -> int:
        """Consumers the stream is for: not waiting for the rest of their group, not cut off."""
        return len([c for c in self.consumers.values() if not (c.broken or c.forming)])  # (no generator)

    def places_to_start(self, member: Membership, policy: LateJoin | None = LateJoin.REPLAY) -> int:
        """Places ``member``'s group's start would add (ValueError if :meth:`join` would refuse
        it; ``policy`` None: it joined already, and its group forms)."""
        if policy is not None:
            self._forming.check(member, LateJoin(policy).value, self.window, self.max_lag is None)
        return self._forming.places_to_start(member, self.groups())

    def groups(self) -> list[Group]:
        """Every group with a member here (forming, started or broken), oldest first."""
        groups = (state.group for state in self.consumers.values() if state.group is not None)
        return list({id(group): group for group in groups}.values())

    # ------------------------------------------------------------------ membership

    def join(
        self,
        cid: Hashable,
        prefetch: int,
        policy: LateJoin = LateJoin.REPLAY,
        member: Membership | None = None,
        at: tuple[int, int] | None = None,
        ready: bool = True,
        rejoined: bool = False,
        had: int | None = None,
    ) -> list[Action]:
        """Add a consumer; ``prefetch`` is capped at the window. A ``member`` of a group
        starts with the group, once all its ranks joined and are ``ready`` (else they say so
        with :meth:`ready`); ValueError naming a conflict with the members already here (its
        rank taken, another size, tail or policy). ``at`` (epoch, index): a restored
        consumer's position, where it starts if that batch is still resident or not yet
        published (else its policy applies); ``rejoined``: ``at`` is the batch after the last
        one it received from a producer that died (see :meth:`ready`); ``had``: a member
        rejoining from a stream whose epoch this one starts again, the rounds of that epoch
        it had received there (see :func:`~tensorsocket.flow_groups.level_restarted`)."""
        if cid in self.consumers:
            raise ValueError(f"consumer {cid!r} already joined")
        if type(prefetch) is not int or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        policy = LateJoin(policy)
        state = ConsumerState(min(prefetch, self.window), None, policy, rejoined=rejoined, had=had)
        if member is not None:
            return self._join_group(cid, state, member, at, ready)
        self.consumers[cid] = state
        self._place(state, policy, at)
        return self._begin([cid])

    def _place(self, state: ConsumerState, policy: LateJoin, at: tuple[int, int] | None) -> bool:
        """Set a starting consumer's cursor: at its position ``at`` if it can be sent from
        there (True), else where its policy says."""
        state.cursor, state.resume_index = self._start(policy), 0
        if at is None or self.ended:
            return False
        epoch, index = at
        if epoch == self.epoch + 1:  # it finished this epoch, or resumes past its start
            state.cursor, state.resume_index = None, index
            return True
        if epoch in self._epoch_starts:
            total = self._epoch_batches.get(epoch)  # an ended epoch: past its end is at its end
            seq = self._epoch_starts[epoch] + (index if total is None else min(index, total))
            if seq >= self._oldest_replayable():
                state.cursor = seq  # resident from there on, or (this epoch) not yet published
                return True
        return False

    def _start(self, policy: LateJoin) -> int | None:
        """Where a consumer joining now starts (None: at the next epoch boundary)."""
        if self.ended:
            return self.next_seq - 1  # the END entry, always kept
        if self.next_seq == self._epoch_start:
            return self.next_seq  # at a boundary: everyone starts with the next epoch
        if policy is LateJoin.REPLAY:
            return self._epoch_start if self._replay_open else None
        if policy is LateJoin.NOW:
            return self._oldest_replayable()
        return None

    def _begin(self, cids: list[Hashable]) -> list[Action]:
        """Send newly started consumers what they may take; each is catching up (the others
        wait for it) until :meth:`_settle`, after the skips it makes, finds it caught up."""
        out: list[Action] = []
        for cid in cids:
            state = self.consumers[cid]
            out.extend(self._deliver(cid, state))
            state.catching_up = True
        return out + self._settle()

    def _join_group(
        self, cid: Hashable, state: ConsumerState, member: Membership, at: tuple[int, int] | None, ready: bool
    ) -> list[Action]:
        group = self._forming.add(
            cid, member, state.policy.value, self.window, self.max_lag is None, state.rejoined
        )
        # (the stream ended: it gets END, nothing to wait for)
        state.cursor = self.next_seq - 1 if self.ended else None
        state.group, state.rank, state.at, state.ready = group, member.rank, at, ready
        self.consumers[cid] = state
        return self._deliver(cid, state) + self._start_group(group)

    def ready(self, cid: Hashable, at: tuple[int, int] | None = None, rejoined: bool = False) -> list[Action]:
        """A group member is ready to be sent batches (its trainer began iterating), from
        ``at`` if it was restored (``rejoined``: it rejoins a restarted producer, and ``at``
        follows what it received); the group starts once all its ranks are. Ignored for
        anyone else, and when said again."""
        state = self.consumers.get(cid)
        if state is None or state.group is None or state.ready:
            return []
        state.ready, state.at, state.rejoined = True, at, rejoined
        return self._start_group(state.group)

    def leave(self, cid: Hashable, said: Said = UNSAID) -> list[Action]:
        """A consumer left or was evicted: drop it and all it held. Idempotent. A member breaks its
        group: the others are sent :class:`GroupBroken` (when: ``said``, by its BYE; until_epoch)."""
        state = self.consumers.pop(cid, None)
        if state is None:
            return []
        for place in state.held.values():
            self._places[place].holders.discard(cid)
        out = self._break_group(cid, state, said) if state.group is not None else []
        self._trim()
        # (_settle sends nothing here: the leader leaving only shortens the others' distance)
        return out + self._settle()

    def _break_group(self, cid: Hashable, state: ConsumerState, said: Said) -> list[Action]:
        group = state.group
        assert group is not None
        if not group.started:  # forming: just one rank fewer
            self._forming.forget(group, state.rank, cid)
            return []
        last = state.last_sent
        sent = sent_before(state.at) if last is None else (last.epoch, last.kind is EntryKind.EPOCH_END)
        until = until_epoch(said, sent)
        if state.finished or state.broken or (group.lost is not None and not nearer(until, group.until)):
            return []  # it was sent everything or told, or its group broke already, to end no later
        group.lost, group.until = (state.rank, cid), until
        out: list[Action] = []
        for other_cid in group.members.values():
            other = self.consumers.get(other_cid)
            if other is None or other is state or other.finished or other.broken:
                continue
            if until is None or past_end_of(until, other.cursor, self._epoch_starts, self.epoch):
                out.extend(self._cut(other_cid, other))
            else:  # sent the rest of that epoch: _deliver cuts it after the epoch's end
                out.extend(self._deliver(other_cid, other))
        return out

    def break_unrejoined(self) -> list[Action]:
        """A successor starts: a group still waiting for a rank that did not rejoin breaks, as if
        that rank left mid-epoch (:meth:`Forming.give_up`), rather than wait to the stream's end."""
        gone = self._forming.give_up(lambda cid: self.consumers[cid].rejoined)
        return [a for g in gone for c in g.members.values() for a in self._cut(c, self.consumers[c])]

    def _cut(self, cid: Hashable, state: ConsumerState) -> list[Action]:
        """``cid``'s group broke: it is sent nothing more and no longer paces the producer."""
        group = state.group
        assert group is not None and group.lost is not None
        state.broken, state.cursor, state.catching_up, state.wants = True, None, False, None
        return [GroupBroken(cid, group.name, group.lost[0], group.lost[1], group.until)]

    def release(self, cid: Hashable, seqs: Iterable[int]) -> list[Action]:
        """A consumer is done with these batches. Unknown or repeated seqs are ignored."""
        state = self.consumers.get(cid)
        if state is None:
            return []
        for seq in seqs:
            place = state.held.pop(seq, None)
            if place is not None:
                self._places[place].holders.discard(cid)
        cursor = state.cursor
        out = self._deliver(cid, state)
        if state.cursor == cursor:
            # Sent nothing (a consumer caught up with the newest batch, most releases): no lag
            # changed, so there is nothing to settle, and no entry became unwanted.
            return out
        out += self._settle()
        self._trim()
        return out

    # ------------------------------------------------------------------ producer side

    def start_at(self, epoch: int, first_seq: int, index: int) -> None:
        """Continue a stream a producer that died published (before anyone joins): its batch
        ``index`` of ``epoch``, whose first entry was ``first_seq``, is published next, with
        the numbers it had. Nothing before it is resident."""
        if self.next_seq or self.consumers:
            raise RuntimeError("start_at() comes before anything is published or joins")
        for name, value in (("epoch", epoch), ("first_seq", first_seq), ("index", index)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.epoch, self._epoch_start, self._epoch_starts = epoch, first_seq, {epoch: first_seq}
        self.next_seq = self._replay_from = first_seq + index
        self._epoch_index = index
        self._replay_open = index == 0

    def restart_point(self) -> int:
        """The oldest entry some consumer may not have received: one it holds (sent, maybe
        still in flight when the producer dies) or was not sent yet. A restarted producer
        publishes again from here, so everyone can rejoin where it is."""
        needed = [self.next_seq]
        for c in self.consumers.values():
            if c.finished or c.broken:
                continue
            needed.extend(c.held)
            if c.cursor is not None:
                needed.append(c.cursor)
        return min(needed)

    def keep_from(self) -> int:
        """The oldest entry a consumer may still be sent, now or after joining: the restart
        point may move back to here, never further."""
        return min(self.restart_point(), self._oldest_replayable())

    def add_places(self, n: int) -> None:
        """More places (the producer sizes its replay buffer once it knows a batch's bytes)."""
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        first = len(self._places)
        self._places.extend(Place() for _ in range(n))
        self._free[:0] = range(first + n - 1, first - 1, -1)  # after the existing free ones

    def reserve(self) -> int | None:
        """Pick a place to write the next batch into, or None while the window is full or
        every place is still needed: a never-used place, else the one holding the oldest
        batch nobody holds or is still owed (the batches that stay are the most recent)."""
        if self.ended:
            raise RuntimeError("the stream has ended; nothing more can be published")
        if not self._window_open():
            return None
        place = self._spare()
        return None if place is None else self._fill(place)

    def cancel(self, place: int) -> None:
        """Give back a reserved place that was not written (the write failed)."""
        s = self._places[place]
        if s.state is not PlaceState.FILLING:
            raise RuntimeError(f"place {place} is not being filled")
        self._restaging.pop(place, None)  # (its waiters still want it: restage() offers it again)
        s.state = PlaceState.FREE
        self._free.append(place)

    def publish(self, place: int, payload: Any, keep: int = 0) -> list[Action]:
        """The reserved ``place`` now holds batch ``next_seq``; send it to whoever may take it,
        and (policy skip) move consumers lagging more than ``max_lag`` ahead. ``keep``: the
        producer keeps the newest ``keep`` batches (this one included) beyond their places,
        so a joiner can be sent them again (:meth:`restage`); one that is owed and in no place
        is kept past that until it is sent (see :meth:`kept_from`)."""
        s = self._places[place]
        if s.state is not PlaceState.FILLING or place in self._restaging:
            raise RuntimeError(f"place {place} was not reserved")
        if type(keep) is not int or keep < 0:
            raise ValueError(f"keep must be a non-negative int, got {keep!r}")
        s.state, s.seq = PlaceState.PUBLISHED, self.next_seq
        self._keep(self.next_seq, keep)
        return self._append(EntryKind.BATCH, place, payload)

    def end_epoch(self, payload: Any) -> list[Action]:
        """Append an EPOCH_END marker; consumers waiting for a boundary start after it."""
        self._epoch_batches[self.epoch] = self._epoch_index  # decides the groups' last round
        self._clamp_cursors(self.next_seq)  # resuming past the epoch's end: at its end
        out = self._append(EntryKind.EPOCH_END, None, payload)
        self.epoch += 1
        self._epoch_start = self._epoch_starts[self.epoch] = self.next_seq
        self._epoch_index = 0
        self._replay_open = True
        for state in self.consumers.values():
            if state.cursor is None and not (state.forming or state.broken):
                state.cursor, state.resume_index = self.next_seq + state.resume_index, 0
        return out + self._settle()  # the waiters are the leaders now

    def end_stream(self, payload: Any) -> list[Action]:
        """Append END; every consumer, including waiting ones, is sent it after its batches."""
        end_seq = self.next_seq
        if self._epoch_index:  # ended mid-epoch: its last round is decided by what was published
            self._epoch_batches[self.epoch] = self._epoch_index
        self._clamp_cursors(end_seq)
        for state in self.consumers.values():
            if state.cursor is None:  # a forming group will never start; a broken one's members go
                state.cursor = end_seq
        out = self._append(EntryKind.END, None, payload)
        self.ended = True
        return out

    # ------------------------------------------------------------------ internals

    def _clamp_cursors(self, seq: int) -> None:
        """Cursors of restored consumers past the entry about to be appended at ``seq`` (an
        epoch's end marker or END) point at it: the epoch ended before their position."""
        for state in self.consumers.values():
            if state.cursor is not None and state.cursor > seq:
                state.cursor = seq

    def _append(self, kind: EntryKind, place: int | None, payload: Any) -> list[Action]:
        if self.ended:
            raise RuntimeError("the stream has ended; nothing more can be published")
        index = self._epoch_index if kind is EntryKind.BATCH else 0
        entry = Entry(self.next_seq, kind, place, payload, self.epoch, index)
        self._log[entry.seq] = entry
        self._before[entry.seq] = self.published
        self.next_seq += 1
        if kind is EntryKind.BATCH:
            self.published += 1
            self._epoch_index += 1
        out: list[Action] = []
        for cid, state in self.consumers.items():
            out.extend(self._deliver(cid, state))
        out.extend(self._settle())
        self._trim()
        return out

    def _deliver(self, cid: Hashable, state: ConsumerState) -> list[Action]:
        # (for every consumer at every batch and release: what it reads is in locals)
        out: list[Action] = []
        state.wants = None
        cursor, held = state.cursor, state.held
        log, places = self._log, self._places
        while cursor is not None and cursor < self.next_seq:
            entry = log[cursor]
            if entry.kind is EntryKind.BATCH:
                if state.group is not None:
                    g = state.group
                    total = self._epoch_batches.get(entry.epoch)  # None: its epoch is being published
                    mine = share(state.rank, g.size, g.tail, entry.index, total, self._epoch_index)
                    if mine is None:
                        break  # its round is not decided yet
                    if not mine:
                        cursor += 1
                        continue
                if len(held) >= state.prefetch:
                    break
                place = places[entry.place]  # type: ignore[index]
                if place.state is not PlaceState.PUBLISHED or place.seq != cursor:  # (place.holds inline)
                    state.wants = cursor  # kept, in no place: restage() offers it
                    break
                held[cursor] = entry.place  # type: ignore[assignment]
                place.holders.add(cid)
                state.received += 1
            elif entry.kind is EntryKind.END:
                state.finished = True
            elif state.group is not None and state.group.ends_after(entry.epoch):  # (an epoch's end)
                state.last_sent = entry  # the last it is sent: its group broke
                return [*out, Deliver(cid, entry), *self._cut(cid, state)]
            out.append(Deliver(cid, entry))
            state.last_sent = entry
            cursor += 1
        state.cursor = cursor
        if state.unsent_skips and out:  # the gap is said right before what follows it
            out.insert(0, Skipped(cid, state.unsent_skips))
            state.unsent_skips = 0
        return out

    def _settle(self) -> list[Action]:
        """After any change: (skip) move consumers over ``max_lag`` behind the leader ahead, again
        while that moves the leader (a skip past a kept batch can); then clear ``catching_up``."""
        out: list[Action] = []
        leader = 0 if self.max_lag is None else self._leader_lag()  # (stall: lags from the newest)
        while self.max_lag is not None:  # (each round skips a batch at least: this ends)
            late = leader + self.max_lag
            skipped = [c for c, s in self.consumers.items() if not s.catching_up and self._lag(s) > late]
            for cid in skipped:
                out.extend(self._skip(cid, self.consumers[cid], late))
            if not skipped or (now := self._leader_lag()) == leader:
                break
            leader = now
        for state in self.consumers.values():
            if state.catching_up and self._caught_up(state, leader):
                state.catching_up = False
        return out

    def _skip(self, cid: Hashable, state: ConsumerState, lag: int) -> list[Action]:
        """Move a straggler's cursor past its oldest unsent batches until its lag is ``lag``
        (epoch markers are still sent). Its Skipped goes out with the next entry sent: one for
        the gap, not one per batch published while it (stopped?) reads nothing."""
        out: list[Action] = []
        while self._lag(state) > lag:
            # _deliver stopped on a batch (markers need no credit): that one is skipped.
            assert self._log[state.cursor].kind is EntryKind.BATCH  # type: ignore[index]
            state.cursor += 1  # type: ignore[operator]
            state.skipped += 1
            state.unsent_skips += 1
            out.extend(self._deliver(cid, state))
        return out

    def _lag(self, state: ConsumerState) -> int:
        if state.cursor is None or state.cursor >= self.next_seq:
            return 0
        return self.published - self._before[state.cursor]

    def _active(self) -> list[ConsumerState]:
        """Consumers the stream is being sent to (not waiting for a boundary or, restored, for a
        batch further on than the next one, not finished)."""
        return [
            c
            for c in self.consumers.values()
            if c.cursor is not None and c.cursor <= self.next_seq and not c.finished
        ]

    def _leader_lag(self) -> int:
        return min((self._lag(c) for c in self._active()), default=0)

    def _caught_up(self, state: ConsumerState, leader: int) -> bool:
        """Has a joiner caught up? stall: within ``window``. skip: as far as the leader (let go at
        ``max_lag`` behind, a batch before its next release would skip it: no slack at all)."""
        if self.max_lag is None:
            return self._lag(state) <= self.window
        return self._lag(state) <= leader

    def _window_open(self) -> bool:
        """May batch ``next_seq`` be published? stall: not while any consumer lags ``window``
        batches behind. skip: not while the leader does, nor while a joiner is still catching
        up (more than ``max_lag`` behind the leader). (After the batch, none is further behind.)"""
        if self.max_lag is None:  # (one pass, _lag inlined: this runs for every batch)
            nxt, before, limit = self.next_seq, self._before, self.published - self.window
            for c in self.consumers.values():
                if c.cursor is not None and c.cursor < nxt and not c.finished and before[c.cursor] <= limit:
                    return False
            return True
        return self._leader_lag() < self.window and not any(c.catching_up for c in self._active())

    def _resident(self, seq: int) -> bool:
        entry = self._log.get(seq)
        if entry is None or entry.kind is not EntryKind.BATCH:
            return entry is not None
        place = self._places[entry.place]  # type: ignore[index]
        return place.holds(seq)

    def _oldest_replayable(self) -> int:
        """The smallest seq from which every entry up to the newest can still be sent (is in its
        place or kept)."""
        return min(self._replay_from, self.next_seq)

    def _trim(self) -> None:
        """Forget log entries no consumer can still be sent and no joiner can replay.

        The log stays short: entries at or past the slowest cursor are unsent batches, and they
        and the replayable ones are in a place or kept.
        """
        keep_from = min(self._oldest_replayable(), self.next_seq - 1)  # END stays
        for c in self.consumers.values():
            if c.cursor is not None and c.cursor < keep_from:
                keep_from = c.cursor
        while self._log:
            seq = next(iter(self._log))
            if seq >= keep_from:
                break
            del self._log[seq]
            del self._before[seq]
        if len(self._epoch_starts) > 1 and self._log:  # only epochs with entries in the log are asked about
            oldest = next(iter(self._log.values())).epoch
            for table in (self._epoch_batches, self._epoch_starts):
                for epoch in [e for e in table if e < oldest]:
                    del table[epoch]
