"""The values the flow state machine (:mod:`tensorsocket.flow`) works with: the stream's
entries, the actions it returns, and what it records of each place and consumer."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from .flow_groups import Group, GroupBroken


class EntryKind(Enum):
    BATCH = "batch"
    EPOCH_END = "epoch_end"
    END = "end"


class LateJoin(str, Enum):
    """Where a consumer that joins mid-epoch starts (see the module docstring)."""

    REPLAY = "replay"
    NEXT_EPOCH = "next_epoch"
    NOW = "now"


@dataclass(frozen=True)
class Entry:
    """One position of the stream; ``payload`` is opaque here (the encoded message).
    ``epoch`` and ``index`` (a batch's position in its epoch) are derived from the stream."""

    seq: int
    kind: EntryKind
    place: int | None
    payload: Any
    epoch: int = field(default=0, compare=False)
    index: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Deliver:
    """Action: send ``entry`` to ``consumer``."""

    consumer: Hashable
    entry: Entry


@dataclass(frozen=True)
class Skipped:
    """Action: tell ``consumer`` that its next ``count`` batches were skipped (it lagged more
    than ``max_lag``); what it is sent next follows them."""

    consumer: Hashable
    count: int


@dataclass(frozen=True)
class Placed:
    """Action: tell ``consumer``, a rank of a group rejoining a producer that starts its epoch
    again, that it goes on at batch ``index`` of ``epoch`` (a round's start) of the new order:
    it skips its first ``skipped`` batches there, as it had received that many more of the old
    order than another rank (see :func:`tensorsocket.flow_groups.level_restarted`)."""

    consumer: Hashable
    epoch: int
    index: int
    skipped: int


Action = Deliver | Skipped | GroupBroken | Placed


class PlaceState(IntEnum):
    """FREE -> FILLING (reserve) -> PUBLISHED (publish) -> FILLING (reserve again) ...;
    FILLING -> FREE on cancel."""

    FREE = 0
    FILLING = 1
    PUBLISHED = 2


@dataclass
class Place:
    state: PlaceState = PlaceState.FREE
    seq: int | None = None
    holders: set[Hashable] = field(default_factory=set)

    def holds(self, seq: int) -> bool:
        """Is batch ``seq`` in this place (published, not since overwritten)?"""
        return self.state is PlaceState.PUBLISHED and self.seq == seq

    @property
    def unheld(self) -> bool:
        """It holds a published batch that no consumer holds."""
        return self.state is PlaceState.PUBLISHED and not self.holders


@dataclass
class ConsumerState:
    """What the flow knows of one consumer. Read-only for callers."""

    prefetch: int
    cursor: int | None
    policy: LateJoin = LateJoin.REPLAY
    held: dict[int, int] = field(default_factory=dict)  # seq -> place
    received: int = 0  # batches sent
    skipped: int = 0  # batches jumped over (policy skip)
    unsent_skips: int = 0  # of those, not yet said: a Skipped goes out before the next entry sent
    finished: bool = False  # END was sent
    catching_up: bool = False  # joined further behind than the limit allows, not yet caught up
    group: Group | None = None
    rank: int = 0
    last_sent: Entry | None = None  # the last entry sent to it
    broken: bool = False  # its group broke: sent nothing more, no cursor
    at: tuple[int, int] | None = None  # the position a restored group member asked for
    rejoined: bool = False  # ``at`` is where it rejoins a restarted producer (what it received)
    had: int | None = None  # a group member from a stream whose epoch is started again: its rounds of it
    ready: bool = True  # a group member: its trainer began iterating (its group may start)
    resume_index: int = 0  # waiting for the next epoch: start at this batch of it
    wants: int | None = None  # the kept batch, in no place now, it waits for (see restage())

    @property
    def forming(self) -> bool:
        """A member of a group that has not started (not all of its ranks joined yet)."""
        return self.group is not None and not self.group.started
