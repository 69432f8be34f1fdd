"""Starting a group, for the flow state machine (:class:`tensorsocket.flow.Flow` inherits
it): once every rank joined and is ready, where each rank starts, and, for ranks rejoining a
restarted producer, where each goes on after what it received (:mod:`.flow_groups` has the
rules). Pure like the rest of the flow, and tested with it."""

from __future__ import annotations

from collections.abc import Hashable

from .flow_groups import Forming, Group, level_restarted, rejoin_at
from .flow_types import Action, ConsumerState, Placed


class GroupStarts:
    """Flow's methods that start a group; the state is the flow's own."""

    # (set by Flow.__init__; listed for readers)
    consumers: dict[Hashable, ConsumerState]
    ended: bool
    _forming: Forming
    _epoch_starts: dict[int, int]

    # (and Flow's methods add_places, groups, _place, _begin and _oldest_replayable)

    def _start_group(self, group: Group) -> list[Action]:
        """Start a forming group once all its ranks joined and are ready (after END each
        member is sent END on its own): from where their positions all agree (a round's
        start), else where its policy says. Ranks rejoining a restarted producer may disagree
        by what was in flight when it died: each goes on where it rejoins (:meth:`_rejoin_group`)."""
        if self.ended or not group.starts_when(lambda cid: self.consumers[cid].ready):
            return []
        states = [self.consumers[group.members[r]] for r in range(group.size)]
        self._forming.start(group)
        self.add_places(self._forming.more_places(self.groups()))
        positions = {s.at for s in states}
        rejoined = all(s.rejoined for s in states)
        placed = self._rejoin_group(states) if any(s.rejoined for s in states) else None
        if placed is None:  # from where all agree; rejoining, the earliest (each drops what it had)
            at = positions.pop() if len(positions) == 1 else None
            if at is not None:
                at = (at[0], at[1] - at[1] % group.size)
            elif None not in positions and rejoined:
                at = min(positions)  # type: ignore[type-var]
                lacks = min(m.at[1] + m.rank for m in states if m.at[0] == at[0]) - at[1]  # (its first batch)
                at = rejoin_at(at, lacks, group.size, 0, self._first_in(at[0]))
            lead = states[0]
            self._place(lead, lead.policy, at)
            for s in states[1:]:
                s.cursor, s.resume_index = lead.cursor, lead.resume_index
            placed = []
        return placed + self._begin([group.members[r] for r in range(group.size)])

    def _rejoin_group(self, states: list[ConsumerState]) -> list[Action] | None:
        """Place each rank of a group rejoining a restarted producer where it rejoins
        (:func:`rejoin_at`), in a new order after what it had if the successor starts its epoch
        again (:func:`level_restarted`: a :class:`Placed` tells a rank that skips); None if one
        cannot be sent from there (the group then starts at the earliest). A rank restored that
        received nothing since goes on at its restored position too; one that had received
        nothing at all (its group's first round was in flight when the producer died), at the
        others' earliest epoch's start, having had none of it."""
        back = [s for s in states if s.rejoined]
        if any(s.at is None for s in back):
            return None
        start = min(s.at[0] for s in back)  # type: ignore[index]
        ats = [(start, 0) if s.at is None else s.at for s in states]
        size, skips = len(states), [0] * len(states)
        if all(s.had is not None for s in back):
            had = [0 if s.at is None else s.had or 0 for s in states]
            skips = level_restarted([(at[0], h) for at, h in zip(ats, had, strict=True)])  # type: ignore[index, misc]
        out: list[Action] = []
        for s, at, skip in zip(states, ats, skips, strict=True):
            at = rejoin_at(at, s.rank, size, skip, self._first_in(at[0]))  # type: ignore[arg-type, index]
            if not self._place(s, s.policy, at):
                return None
            if skip:
                out.append(Placed(s.group.members[s.rank], *at, skip))  # type: ignore[union-attr]
        return out

    def _first_in(self, epoch: int) -> int | None:
        """The first batch of ``epoch`` that is still resident or not yet published (None: none)."""
        start = self._epoch_starts.get(epoch)
        return None if start is None else self._oldest_replayable() - start
