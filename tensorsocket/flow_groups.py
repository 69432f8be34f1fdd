"""Groups, the flow's rules for consumers that split the stream: the ranks of one distributed
job. Pure, like :mod:`tensorsocket.flow`, which applies them; nothing here knows of places.

Batch ``i`` of an epoch goes to rank ``i % size``, one *round* of ``size`` batches at a time:
a round is sent once all of it is published (or its epoch ended), so the short last round of
an epoch can follow the group's :class:`Tail` and every rank gets the same number of batches
per epoch (DDP's all-reduces line up; a user computes the same shares from a plain
DataLoader with :func:`share`). A group starts only when all ``size`` ranks joined and are
ready (began iterating, after any restore), at an epoch's first batch (late-join policies ``replay`` or ``next_epoch``), as a unit; the
producer's window must hold a round (``size <= slots``). A member that leaves breaks it: the
others are sent nothing more (a :class:`GroupBroken` action each) right away, or, when it left
at an epoch's end (:func:`until_epoch`), once they were sent their share of that epoch (or
sooner, if another member leaves before that: :func:`nearer`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

#: Places added per rank of the running groups. A group's ranks hold *different* batches (an
#: ungrouped consumer's are the newest, shared by all), and in DDP's lockstep each rank holds
#: its current batch (1) and maybe one a prefetching fetcher took ahead (Lightning's: 2) while
#: it waits for its next, which the round being written needs a place for (3): without these,
#: every place could be held by ranks that each wait for a batch there is no place for.
GROUP_PLACES_PER_RANK = 3


class Tail(str, Enum):
    """What a group does with an epoch's last batches when their number is not a multiple of
    its size: ``pad`` sends that short round again to the ranks it lacks (every rank gets
    ceil(n / size) batches, as DistributedSampler pads), ``drop`` sends it to nobody
    (floor(n / size) each, as DistributedSampler(drop_last=True))."""

    PAD = "pad"
    DROP = "drop"


@dataclass(frozen=True)
class Membership:
    """What a consumer says of the group it belongs to."""

    group: str
    rank: int
    size: int
    tail: Tail = Tail.PAD


@dataclass
class Group:
    """One group: who joined (by rank), whether it started, and who broke it."""

    name: str
    size: int
    tail: Tail
    policy: str  # a LateJoin value, the same for every member
    members: dict[int, Hashable] = field(default_factory=dict)  # rank -> consumer
    started: bool = False
    lost: tuple[int, Hashable] | None = None  # (rank, consumer) of the member whose leaving broke it
    until: int | None = None  # once broken: the epoch its members may finish (None: none)

    @property
    def running(self) -> bool:
        return self.started and self.lost is None

    def ends_after(self, epoch: int) -> bool:
        """Broken, its members finishing epoch ``until``: is ``epoch``'s end the last sent to them?"""
        return self.until is not None and epoch >= self.until

    def starts_when(self, ready: Callable[[Hashable], bool]) -> bool:
        """Whether it starts, given which members are ``ready``: not started yet, and every one
        of its ranks joined and ready."""
        members = self.members.values()
        return not self.started and len(members) == self.size and all(ready(cid) for cid in members)


@dataclass(frozen=True)
class GroupBroken:
    """Action: ``consumer``'s group lost its rank ``rank`` (consumer ``lost``): it is sent
    nothing more (what it holds stays protected until it releases it or leaves). ``until``:
    the last epoch it may still use what it was sent of (the one the lost rank finished); None:
    the group broke mid-epoch, so nothing it was sent but not yet used is of use to DDP."""

    consumer: Hashable
    group: str
    rank: int
    lost: Hashable
    until: int | None


@dataclass(frozen=True)
class NotRejoined:
    """The ``lost`` of a :class:`GroupBroken` whose rank never rejoined a restarted producer
    (there is no consumer to name)."""

    group: str
    rank: int

    def __str__(self) -> str:
        return "did not rejoin the restarted producer within its wait"


class Unsaid(Enum):
    """The type of :data:`UNSAID`."""

    UNSAID = "unsaid"


#: A member that left without saying how far its trainer read (it died, or was evicted).
UNSAID = Unsaid.UNSAID
#: What a leaving member's BYE said (see :func:`until_epoch`).
Said = int | None | Unsaid


def until_epoch(said: Said, sent: tuple[int, bool] | None) -> int | None:
    """The epoch a leaving member's group may still finish (its other ranks are sent the rest
    of their share of it, then nothing), or None: it left mid-epoch, and they stop at once.

    ``said``: what its BYE said, the epoch whose end its trainer took, with nothing taken
    since (None: it was mid-epoch). A rank may leave at an epoch's end after the producer sent
    it batches of the next: what it was sent says nothing of what it used, so the BYE does.
    Believed when it names an epoch no later than the last whose end it may have been sent
    (``sent``: the epoch of the last entry it was sent, and whether that was an epoch's end;
    None: nothing). :data:`UNSAID`: judged by what it was sent, an epoch's end and nothing after."""
    if sent is None:
        return None
    epoch, at_end = sent
    if said is UNSAID:
        return epoch if at_end else None
    return said if said is not None and said <= (epoch if at_end else epoch - 1) else None


def sent_before(at: tuple[int, int] | None) -> tuple[int, bool] | None:
    """What a member that was sent nothing here had been sent before, for :func:`until_epoch`:
    one restored or rejoining at ``at`` (epoch, index) had taken the epoch before's end, if
    ``at`` is an epoch's start, else part of that epoch (None: nothing)."""
    if at is None or at == (0, 0):
        return None
    return (at[0] - 1, True) if at[1] == 0 else (at[0], False)


def nearer(until: int | None, before: int | None) -> bool:
    """Does a second member's leaving, after which its group may finish epoch ``until``
    (None: none), end the group sooner than the first's (``before``)? Its others still being
    sent the rest of an epoch then stop sooner (those told already keep what they were told)."""
    return before is not None and (until is None or until < before)


def past_end_of(epoch: int, cursor: int | None, starts: dict[int, int], publishing: int) -> bool:
    """Was a member at ``cursor`` sent ``epoch``'s end (an epoch's end is sent to every member),
    or is it past it? ``starts``: the first seq of each epoch the flow still remembers;
    ``publishing``: the epoch being published."""
    if cursor is None:  # (a started member) waits for the next epoch's start: never sent this one's end
        return epoch <= publishing
    start = starts.get(epoch + 1)
    if start is None:  # the next epoch has not begun (nobody is past it), or is forgotten (all are)
        return epoch < publishing
    return cursor >= start


def share(rank: int, size: int, tail: Tail, index: int, total: int | None, published: int) -> bool | None:
    """Is batch ``index`` of an epoch rank ``rank``'s? None while undecided: its round is not
    all published (``published`` batches of the epoch so far) and the epoch's ``total`` is
    not known yet (it has not ended)."""
    start = index - index % size
    if total is None:
        if published < start + size:
            return None
        in_round = size
    else:
        in_round = min(size, total - start)
    if in_round == size:
        return index - start == rank
    if tail is Tail.DROP:
        return False
    return rank % in_round == index - start  # the short round again, from its start


def rejoin_at(at: tuple[int, int], rank: int, size: int, skip: int, first: int | None) -> tuple[int, int]:
    """Where a rank rejoining a restarted producer goes on: the round after the last it
    received (``at``'s), ``skip`` rounds later; or at ``first`` (the successor's first batch of
    that epoch, None if it has none) if that is inside a round it lacks no batch before (rank
    0 received batch 4 of a round 4-5 that rank 1 did not: the successor starts at 5)."""
    epoch, index = at
    index = index - index % size + skip * size
    if first is not None and first <= index + rank:
        index = max(index, first)
    return epoch, index


def level_restarted(ranks: list[tuple[int, int]]) -> list[int]:
    """How many of its first rounds of the new order each rank of a group skips when it rejoins a
    producer that starts an epoch again in a new order (its loader cannot repeat the old one):
    ``ranks`` gives each rank's epoch there and how many rounds of it the rank had received
    from the old order. Each then ends every epoch after as many batches as the others (DDP's
    all-reduces line up) and, at equal steps, is at the same round (its checkpoints agree).

    All in one epoch: the least a rank had comes again whole (every rank gets the whole new
    order's share after it), a rank that had more skips that many more (what it had already
    stands for them). Ranks in different epochs (a rank had an epoch's end when another had
    not: the old order's epoch was as long as any other): each skips what it had of its epoch,
    so it ends each epoch after its share, as the ranks that finished one did."""
    if len({epoch for epoch, _ in ranks}) > 1:
        return [had for _, had in ranks]
    least = min(had for _, had in ranks)
    return [had - least for _, had in ranks]


class Forming:
    """Groups waiting for some of their ranks, by name, and the places added for groups."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.places = 0
        self.unrejoined: dict[str, int] = {}  # group -> the rank that did not rejoin (give_up)

    def add(
        self, cid: Hashable, member: Membership, policy: str, window: int, stall: bool, rejoined: bool = False
    ) -> Group:
        """Record ``cid`` as a member (ValueError as :meth:`check`, or for a rank rejoining a
        group given up: :meth:`give_up`); the group it joined."""
        if rejoined and member.group in self.unrejoined:
            raise ValueError(
                f"group {member.group!r} broke as the producer restarted: rank {self.unrejoined[member.group]} "
                "did not rejoin within its wait, and the stream went on. Restart the job as a whole "
                "(torchrun's elastic restart does) to join again as a new group"
            )
        group = self.check(member, policy, window, stall)
        group.members[member.rank] = cid
        self.groups[member.group] = group
        return group

    def check(self, member: Membership, policy: str, window: int, stall: bool) -> Group:
        """The group ``member`` would join; ValueError naming a bad member or a conflict with
        the ones already here (nothing is recorded either way)."""
        name, rank, size = member.group, member.rank, member.size
        if not stall:
            raise ValueError(
                f"group {name!r}: groups need the producer's stragglers='stall' (a skipped batch "
                "would give its ranks unequal shares)"
            )
        if policy == "now":
            raise ValueError(
                f"group {name!r}: a group starts at an epoch's first batch; use late_join='replay' or 'next_epoch'"
            )
        if type(size) is not int or size < 1:
            raise ValueError(f"group {name!r}: world_size must be a positive int, got {size!r}")
        if type(rank) is not int or not 0 <= rank < size:
            raise ValueError(
                f"group {name!r}: rank must be an int from 0 to world_size - 1 = {size - 1}, got {rank!r}"
            )
        if size > window:
            raise ValueError(
                f"group {name!r} has {size} ranks but the producer has slots={window}: a group "
                f"is sent a round of {size} batches at once, so it needs slots >= {size}"
            )
        tail = Tail(member.tail)
        group = self.groups.get(name) or Group(name, size, tail, policy)
        if size != group.size:
            raise ValueError(
                f"group {name!r}: this member says world_size={size}, the ones that joined {group.size}"
            )
        if rank in group.members:
            raise ValueError(f"group {name!r}: rank {rank} has joined already (two members claim it)")
        if tail is not group.tail:
            raise ValueError(
                f"group {name!r}: this member says tail={tail.value!r}, the others {group.tail.value!r}"
            )
        if policy != group.policy:
            raise ValueError(
                f"group {name!r}: this member says late_join={policy!r}, the others {group.policy!r}"
            )
        return group

    def start(self, group: Group) -> None:
        """All its ranks joined and are ready: it is no longer forming."""
        if self.groups.get(group.name) is group:
            del self.groups[group.name]
        group.started = True

    def give_up(self, rejoined: Callable[[Hashable], bool]) -> list[Group]:
        """A successor starts publishing: the forming groups its predecessor served (a member
        ``rejoined``) that still lack a rank will never start, as that rank did not rejoin in
        time and the stream goes on past it. Each is marked lost for that rank, taken out, and
        remembered, so that rank, rejoining later, is refused rather than waiting alone."""
        gone = []
        for group in list(self.groups.values()):
            if len(group.members) == group.size or not any(rejoined(c) for c in group.members.values()):
                continue
            rank = min(set(range(group.size)) - group.members.keys())
            group.lost, group.until = (rank, NotRejoined(group.name, rank)), None
            del self.groups[group.name]
            self.unrejoined[group.name] = rank
            gone.append(group)
        return gone

    def forget(self, group: Group, rank: int, cid: Hashable) -> None:
        """A member of a forming group left: one rank fewer."""
        if group.members.get(rank) == cid:
            del group.members[rank]
        if not group.members and self.groups.get(group.name) is group:
            del self.groups[group.name]

    def more_places(self, groups: Iterable[Group]) -> int:
        """How many places to add so the running ``groups`` have theirs (see
        :data:`GROUP_PLACES_PER_RANK`); the count is kept: they stay for later groups."""
        more = self._beyond_added(sum(g.size for g in groups if g.running))
        self.places += more
        return more

    def places_to_start(self, member: Membership, groups: Iterable[Group]) -> int:
        """How many places starting ``member``'s group (it forms, or a member's joining forms
        it) would add beside the running ``groups``: a check made before it joins."""
        return self._beyond_added(member.size + sum(g.size for g in groups if g.running))

    def _beyond_added(self, ranks: int) -> int:
        return max(0, GROUP_PLACES_PER_RANK * ranks - self.places)
