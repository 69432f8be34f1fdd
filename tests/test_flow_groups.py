"""Groups in the pure flow state machine: the ranks of one job split the stream with equal
shares per epoch, start together, and break loudly when one of them leaves."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tensorsocket.flow import (
    UNSAID,
    Deliver,
    EntryKind,
    Flow,
    GroupBroken,
    LateJoin,
    Membership,
    Tail,
)
from tensorsocket.flow_groups import NotRejoined, nearer, past_end_of, sent_before, until_epoch
from tensorsocket.flow_invariants import check_invariants

BATCH, EPOCH_END, END = EntryKind.BATCH, EntryKind.EPOCH_END, EntryKind.END


def expected_share(rank: int, size: int, batches: int, tail: Tail) -> list[int]:
    """The batch indices of an epoch of ``batches`` that rank ``rank`` of ``size`` gets,
    written as a user would compute them next to a plain DataLoader."""
    full = batches // size * size
    mine = list(range(rank, full, size))
    short = batches - full
    if short and tail is Tail.PAD:
        mine.append(full + rank % short)
    return mine


@pytest.mark.parametrize("tail", list(Tail))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("batches", [0, 1, 2, 3, 5, 8, 11])
def test_a_group_of_size_ranks_gets_equal_shares_that_cover_the_epoch(size, batches, tail):
    flow = Flow(window=4, places=4)
    got: dict[int, list[int]] = {r: [] for r in range(size)}
    ends = dict.fromkeys(range(size), 0)

    def take(out):
        for a in out:
            assert isinstance(a, Deliver), a
            rank = int(a.consumer[1:])
            if a.entry.kind is BATCH:
                got[rank].append(a.entry.index)
                take(flow.release(a.consumer, [a.entry.seq]))  # a fast trainer
            elif a.entry.kind is EPOCH_END:
                ends[rank] += 1

    for r in range(size):
        take(flow.join(f"r{r}", 2, member=Membership("job", r, size, tail)))
    for i in range(batches):
        place = flow.reserve()
        assert place is not None, "a group of fast ranks never stalls the producer"
        take(flow.publish(place, i))
        check_invariants(flow)
    take(flow.end_epoch("end"))
    assert ends == dict.fromkeys(range(size), 1)
    for r in range(size):
        assert got[r] == expected_share(r, size, batches, tail), r
    counts = {len(v) for v in got.values()}
    assert len(counts) == 1, got  # equal batch counts: DDP's all-reduces line up
    union = sorted(i for v in got.values() for i in v)
    if tail is Tail.DROP:
        assert union == list(range(batches // size * size))
    else:
        assert set(union) == set(range(batches))


def test_a_group_starts_only_when_complete_and_nothing_is_sent_before():
    flow = Flow(window=4, places=4)
    assert flow.join("a", 2, member=Membership("job", 0, 2)) == []
    assert flow.serving() == 0  # the producer does not start for half a group
    place = flow.reserve()
    flow.publish(place, "b0")
    out = flow.join("b", 2, member=Membership("job", 1, 2))  # replay: the epoch from its start
    assert out == []  # batch 0's round (0, 1) is not complete yet
    place = flow.reserve()
    out = flow.publish(place, "b1")
    assert {(a.consumer, a.entry.index) for a in out} == {("a", 0), ("b", 1)}
    assert flow.serving() == 2


def test_a_group_that_joins_after_the_replay_window_starts_at_the_next_epoch_as_a_unit():
    flow = Flow(window=2, places=2)
    flow.join("solo", 2)
    for i in range(3):  # overwrites batch 0: the epoch cannot be replayed any more
        flow.release("solo", [d.entry.seq for d in flow.publish(flow.reserve(), i)])
    assert flow.join("a", 2, member=Membership("job", 0, 2)) == []
    assert flow.join("b", 2, member=Membership("job", 1, 2)) == []
    assert [flow.consumers[c].cursor for c in "ab"] == [None, None]
    flow.end_epoch("end")
    assert [flow.consumers[c].cursor for c in "ab"] == [flow.next_seq, flow.next_seq]


@pytest.mark.parametrize(
    "first, second, needle",
    [
        (Membership("j", 0, 2), Membership("j", 0, 2), "rank 0 has joined already"),
        (Membership("j", 0, 2), Membership("j", 1, 3), "world_size=3, the ones that joined 2"),
        (Membership("j", 0, 2), Membership("j", 1, 2, Tail.DROP), "tail='drop', the others 'pad'"),
        (None, Membership("j", 2, 2), "rank must be an int from 0 to world_size - 1 = 1, got 2"),
        (None, Membership("j", 0, 0), "world_size must be a positive int"),
        (None, Membership("j", 0, 5), "needs slots >= 5"),
    ],
)
def test_conflicting_members_are_refused_and_leave_the_group_as_it_was(first, second, needle):
    flow = Flow(window=4, places=4)
    if first is not None:
        flow.join("first", 1, member=first)
    with pytest.raises(ValueError, match=needle):
        flow.join("second", 1, member=second)
    assert "second" not in flow.consumers


def test_groups_refuse_now_and_skip():
    with pytest.raises(ValueError, match="late_join='replay' or 'next_epoch'"):
        Flow(window=4).join("a", 1, LateJoin.NOW, Membership("j", 0, 2))
    with pytest.raises(ValueError, match="stragglers='stall'"):
        Flow(window=4, max_lag=2).join("a", 1, member=Membership("j", 0, 2))
    flow = Flow(window=4)
    flow.join("a", 1, LateJoin.NEXT_EPOCH, Membership("j", 0, 2))
    with pytest.raises(ValueError, match="late_join='replay', the others 'next_epoch'"):
        flow.join("b", 1, LateJoin.REPLAY, Membership("j", 1, 2))


def _group_of_two(prefetch_b: int = 4) -> Flow:
    flow = Flow(window=4, places=4)
    flow.join("a", 4, member=Membership("job", 0, 2))
    flow.join("b", prefetch_b, member=Membership("job", 1, 2))
    flow.join("solo", 4)
    return flow


def test_a_member_leaving_mid_epoch_breaks_its_group_at_once_and_spares_the_others():
    flow = _group_of_two()
    for i in range(2):
        flow.publish(flow.reserve(), i)
    out = flow.leave("a")
    assert out == [GroupBroken("b", "job", 0, "a", until=None)]
    assert flow.consumers["b"].broken and flow.serving() == 1
    out = flow.publish(flow.reserve(), 2)  # b holds batch 1 still, nobody sends it anything
    assert [a.consumer for a in out] == ["solo"]
    assert flow.holders(flow.consumers["b"].held[1]) == {"b", "solo"}  # what it holds stays protected
    assert flow.leave("b") == []  # its group is broken already


def test_a_member_leaving_after_its_epoch_share_lets_the_others_finish_that_epoch():
    flow = _group_of_two(prefetch_b=1)
    for i in range(3):
        flow.publish(flow.reserve(), i)
    flow.release("solo", [0, 1, 2])
    flow.release("a", [0])
    flow.end_epoch("end")  # seq 3: a is sent batch 2 (the short round, padded) and the marker
    flow.release("a", [2])
    assert flow.consumers["a"].last_sent.kind is EPOCH_END
    assert flow.leave("a") == []  # b is still owed its share of epoch 0: batch 2 and the marker
    assert flow.consumers["b"].group.until == 0 and not flow.consumers["b"].broken
    out = flow.release("b", [1])
    assert [(a.entry.kind, a.entry.index) for a in out[:2]] == [(BATCH, 2), (EPOCH_END, 0)]
    assert out[2:] == [GroupBroken("b", "job", 0, "a", until=0)] and flow.consumers["b"].broken


def test_a_member_that_was_sent_its_share_already_is_told_after_it():
    flow = _group_of_two()
    for i in range(3):
        flow.publish(flow.reserve(), i)
    flow.end_epoch("end")  # both were sent everything of epoch 0
    assert flow.leave("a") == [GroupBroken("b", "job", 0, "a", until=0)]


def _past_the_epoch_end(prefetch_b: int) -> Flow:
    """Epoch 0 of 4 batches (a: 0 and 2, b: 1 and 3), then 2 of epoch 1: a took its share and
    the marker and was sent batch 0 of epoch 1 too; b holds what its ``prefetch_b`` allows."""
    flow = Flow(window=4, places=8)
    flow.join("a", 4, member=Membership("job", 0, 2))
    flow.join("b", prefetch_b, member=Membership("job", 1, 2))
    for i in range(4):
        flow.publish(flow.reserve(), i)
    flow.release("a", [0, 2])
    flow.end_epoch("end")  # seq 4
    for i in range(2):
        flow.publish(flow.reserve(), 10 + i)
    last = flow.consumers["a"].last_sent
    assert (last.kind, last.epoch) == (BATCH, 1)
    return flow


def test_a_member_whose_bye_says_it_finished_the_epoch_lets_the_others_finish_it():
    """It was sent a batch of the next epoch (prefetched), but its trainer took the epoch's end
    and nothing after: the others are sent the rest of their share of that epoch."""
    flow = _past_the_epoch_end(prefetch_b=1)  # b holds batch 1; batch 3 and the marker are owed
    assert flow.leave("a", said=0) == []
    assert flow.consumers["b"].group.until == 0 and not flow.consumers["b"].broken
    out = flow.release("b", [1])
    sent = [(a.entry.kind, a.entry.epoch, a.entry.index) for a in out[:2]]
    assert sent == [(BATCH, 0, 3), (EPOCH_END, 0, 0)]
    assert out[2:] == [GroupBroken("b", "job", 0, "a", until=0)]


def test_a_member_sent_past_that_epoch_end_is_told_to_stop_there():
    flow = _past_the_epoch_end(prefetch_b=4)  # b was sent batch 1 of epoch 1 already
    assert flow.consumers["b"].last_sent.epoch == 1
    assert flow.leave("a", said=0) == [GroupBroken("b", "job", 0, "a", until=0)]
    assert flow.consumers["b"].broken


def test_a_member_that_died_is_judged_by_what_it_was_sent():
    flow = _past_the_epoch_end(prefetch_b=1)  # sent a batch of epoch 1: mid-epoch, for all we know
    assert flow.leave("a") == [GroupBroken("b", "job", 0, "a", until=None)]


def test_a_bye_mid_epoch_stops_the_others_at_once_even_after_an_epoch_end_was_sent():
    flow = _group_of_two()
    for i in range(3):
        flow.publish(flow.reserve(), i)
    flow.end_epoch("end")  # a was sent its share and the marker, but its trainer had not taken them
    assert flow.leave("a", said=None) == [GroupBroken("b", "job", 0, "a", until=None)]


def test_a_bye_naming_an_epoch_it_was_not_sent_the_end_of_is_not_believed():
    flow = _group_of_two()
    for i in range(3):
        flow.publish(flow.reserve(), i)
    assert flow.leave("a", said=0) == [GroupBroken("b", "job", 0, "a", until=None)]


def test_a_second_member_leaving_mid_epoch_stops_the_ones_still_finishing_it():
    """a leaves at epoch 0's end, so b and c are owed the rest of it; then b dies mid-epoch:
    c, still owed its share, is told at once (what a could wait for, b never ran)."""
    flow = Flow(window=6, places=6)
    for r, c in enumerate("abc"):
        flow.join(c, 1, member=Membership("job", r, 3))
    for i in range(6):  # 2 a rank; each holds its first (prefetch 1)
        flow.publish(flow.reserve(), i)
    flow.release("a", [0])
    flow.end_epoch("end")
    flow.release("a", [3])
    assert flow.leave("a", said=0) == []
    assert flow.consumers["c"].group.until == 0 and not flow.consumers["c"].broken
    assert flow.leave("b") == [GroupBroken("c", "job", 1, "b", until=None)]
    assert flow.release("c", [2]) == []  # nothing more of epoch 0


def test_a_later_leaver_that_ends_the_group_no_sooner_changes_nothing():
    flow = Flow(window=6, places=6)
    for r, c in enumerate("abc"):
        flow.join(c, 1, member=Membership("job", r, 3))
    for i in range(6):
        flow.publish(flow.reserve(), i)
    flow.release("a", [0])
    flow.end_epoch("end")
    flow.release("a", [3])
    flow.leave("a", said=0)
    flow.release("b", [1])  # b is sent batch 4 and the end, then told
    assert flow.consumers["b"].broken
    assert flow.leave("b", said=0) == []  # (told already)
    assert flow.consumers["c"].group.until == 0 and not flow.consumers["c"].broken


def test_a_member_rejoining_a_successor_after_an_epoch_end_is_believed_before_it_is_sent_anything():
    """A successor continues epoch 0 at its batch 6: rank a had received all of epoch 0 and
    its end (it rejoins at epoch 1's start), rank b rejoins at batch 6. a takes the end queued
    from the old producer and leaves: b is still sent the rest of its share."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 6)
    flow.join("a", 4, member=Membership("job", 0, 2), at=(1, 0), rejoined=True)
    flow.join("b", 4, member=Membership("job", 1, 2), at=(0, 6), rejoined=True)
    flow.publish(flow.reserve(), 6)
    assert flow.leave("a", said=0) == []
    out = flow.publish(flow.reserve(), 7) + flow.end_epoch("end")
    sent = [(a.entry.kind, a.entry.index) for a in out if isinstance(a, Deliver)]
    assert sent == [(BATCH, 7), (EPOCH_END, 0)]
    assert out[-1] == GroupBroken("b", "job", 0, "a", until=0)


def test_members_waiting_for_the_next_epoch_when_a_rank_leaves_are_sent_nothing_of_it():
    """A successor still publishes epoch 0; the group rejoined at epoch 1's start (it had epoch
    0's end), so it waits for epoch 1. A rank dies: the other is told at once, and sent no
    batch of epoch 1 (before: all of epoch 1, its peer gone, then GroupBroken)."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 6)
    for rank, cid in enumerate("ab"):
        flow.join(cid, 2, member=Membership("job", rank, 2), at=(1, 0), rejoined=True)
    assert flow.leave("a") == [GroupBroken("b", "job", 0, "a", until=0)]
    out = flow.publish(flow.reserve(), 6) + flow.publish(flow.reserve(), 7) + flow.end_epoch("end")
    out += flow.publish(flow.reserve(), 8) + flow.publish(flow.reserve(), 9)
    assert [a for a in out if a.consumer == "b"] == []


def test_a_group_missing_a_rank_as_a_successor_starts_is_broken_and_that_rank_refused_later():
    """A successor continues epoch 0 at batch 6; rank 0 of job rejoined, rank 1 did not within
    the successor's wait. Before: the group stayed forming to the end of the stream and rank 0
    got END, its epochs cut short as if whole. Now, as the successor starts, rank 0 is told its
    group broke, naming rank 1; rank 1 rejoining later is refused; a new job of that name (not
    rejoining) forms as usual, and a group of new members is not given up."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 6)
    flow.join("a", 2, member=Membership("job", 0, 2), at=(0, 6), rejoined=True)
    flow.join("n", 2, member=Membership("new", 0, 2))  # (forming, no rank rejoined: it waits on)
    out = flow.break_unrejoined()
    assert out == [GroupBroken("a", "job", 1, NotRejoined("job", 1), until=None)]
    assert flow.consumers["a"].broken and not flow.consumers["n"].broken
    check_invariants(flow)
    with pytest.raises(
        ValueError, match="group 'job' broke as the producer restarted: rank 1 did not rejoin"
    ):
        flow.join("b", 2, member=Membership("job", 1, 2), at=(0, 6), rejoined=True)
    assert "b" not in flow.consumers
    flow.join("c", 2, member=Membership("job", 0, 2))
    flow.join("d", 2, member=Membership("job", 1, 2))
    assert not flow.consumers["c"].forming and not flow.consumers["c"].broken
    out = flow.publish(flow.reserve(), 6)
    assert {a.consumer for a in out if isinstance(a, Deliver)} <= {"c", "d"}
    assert flow.break_unrejoined() == []
    check_invariants(flow)


@pytest.mark.parametrize(
    ("at", "sent"), [(None, None), ((0, 0), None), ((3, 0), (2, True)), ((3, 5), (3, False))]
)
def test_sent_before(at, sent):
    assert sent_before(at) == sent


@pytest.mark.parametrize(
    ("until", "before", "sooner"),
    [(None, 2, True), (1, 2, True), (2, 2, False), (3, 2, False), (None, None, False), (1, None, False)],
)
def test_nearer(until, before, sooner):
    assert nearer(until, before) is sooner


@pytest.mark.parametrize(
    ("epoch", "cursor", "sent_its_end"),
    [
        (2, 9, False),
        (2, 10, True),
        (2, None, True),
        (3, 15, False),
        (3, None, True),
        (1, 10, True),
        (0, 10, True),
    ],
)
def test_past_end_of(epoch, cursor, sent_its_end):
    starts = {2: 4, 3: 10}  # epoch 2's end is seq 9; epoch 3 is being published; 0 and 1 are forgotten
    assert past_end_of(epoch, cursor, starts, publishing=3) is sent_its_end


@pytest.mark.parametrize(
    ("said", "last_epoch", "last_was_end", "until"),
    [
        (UNSAID, 3, True, 3),  # died right after an epoch's end was sent: the others finish it
        (UNSAID, 3, False, None),  # died with a batch of epoch 3 sent: mid-epoch
        (None, 3, True, None),  # said mid-epoch
        (3, 3, True, 3),
        (2, 3, True, 2),  # took epoch 2's end and nothing since, though epoch 3 was sent to it
        (2, 3, False, 2),
        (3, 3, False, None),  # epoch 3's end was never sent to it
        (4, 3, True, None),
    ],
)
def test_until_epoch(said, last_epoch, last_was_end, until):
    assert until_epoch(said, (last_epoch, last_was_end)) == until
    assert until_epoch(said, None) is None  # sent nothing: its group never got far


def test_a_restarted_group_joins_again_as_a_new_group():
    flow = _group_of_two()
    flow.publish(flow.reserve(), 0)
    flow.leave("a")
    flow.leave("b")
    flow.join("a2", 4, member=Membership("job", 0, 2))
    out = flow.join("b2", 4, member=Membership("job", 1, 2))  # replays the epoch from its start
    flow.publish(flow.reserve(), 1)
    assert flow.consumers["a2"].group is flow.consumers["b2"].group and flow.consumers["a2"].group.started
    assert out == [] and flow.consumers["a2"].received == 1


def test_a_forming_group_is_sent_end_when_the_stream_ends():
    flow = Flow(window=2)
    flow.join("a", 1, member=Membership("job", 0, 2))
    out = flow.end_stream("END")
    assert [(a.consumer, a.entry.kind) for a in out] == [("a", END)]
    assert flow.finished()


# ---------------------------------------------------------------------- the state machine

GROUPS = {"g": 2, "h": 3}  # name -> size
MEMBERS = [(g, r) for g, n in GROUPS.items() for r in range(n)] + [(None, 0), (None, 1)]


@dataclass
class Seen:
    """What one consumer was sent, in order: (epoch, index) of batches, ("end", epoch) markers."""

    group: str | None
    rank: int
    incarnation: int
    tail: Tail = Tail.PAD
    entries: list[tuple] = field(default_factory=list)
    held: set[int] = field(default_factory=set)
    broken: bool = False
    finished: bool = False
    had_end: int | None = None  # restored at an epoch's start: it had the end of the one before


class GroupMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.flow: Flow | None = None

    @initialize(extra=st.integers(0, 3), window=st.integers(3, 5))
    def setup(self, extra: int, window: int) -> None:
        self.flow = Flow(window=window, places=window + extra)
        self.where: dict[int, tuple[int, int]] = {}  # seq -> (epoch, index), the model's own count
        self.memory: dict[int, int] = {}  # place -> seq last written
        self.epoch, self.index = 0, 0
        self.lengths: dict[int, int] = {}  # epoch -> batches, once ended
        self.seen: dict[Hashable, Seen] = {}
        self.incarnations: dict[str, int] = dict.fromkeys(GROUPS, 0)
        self.cids = 0

    def _handle(self, out: list) -> None:
        for a in out:
            s = self.seen[a.consumer]
            end = isinstance(a, Deliver) and a.entry.kind is END  # a broken member is still sent END
            assert not s.finished and (not s.broken or end), ("sent something after the end", a)
            if isinstance(a, GroupBroken):
                assert s.group == a.group
                # Told to stop after an epoch: it was sent that epoch's end (its whole share), here
                # or before it was restored
                had = s.had_end is not None and a.until is not None and a.until <= s.had_end
                assert a.until is None or ("end", a.until) in s.entries or had, (a, s.entries)
                event("group broken after an epoch" if a.until is not None else "group broken mid-epoch")
                s.broken = True
                continue
            assert isinstance(a, Deliver)
            e = a.entry
            group = self.flow.consumers[a.consumer].group if a.consumer in self.flow.consumers else None
            if group is not None and group.lost is not None and e.kind is not END:
                assert group.until is not None and e.epoch <= group.until, ("sent past the cut", a, group)
            if e.kind is BATCH:
                assert self.memory[e.place] == e.seq, "sent an overwritten batch"
                assert (e.epoch, e.index) == self.where[e.seq]
                s.entries.append(self.where[e.seq])
                s.held.add(e.seq)
            elif e.kind is EPOCH_END:
                s.entries.append(("end", e.epoch))
            else:
                s.finished = True

    @rule(who=st.sampled_from(MEMBERS), prefetch=st.integers(1, 4), tail=st.sampled_from(list(Tail)))
    def join(self, who: tuple[str | None, int], prefetch: int, tail: Tail) -> None:
        assert self.flow is not None
        group, rank = who
        taken = [
            s
            for c, s in self.seen.items()
            if c in self.flow.consumers and s.group == group and s.rank == rank and group is not None
        ]
        forming = group is not None and group in self.flow._forming.groups
        cid = f"c{self.cids}"
        self.cids += 1
        if group is None:
            self.seen[cid] = Seen(None, rank, 0)
            self._handle(self.flow.join(cid, prefetch))
            return
        if not forming:
            self.incarnations[group] += 1
        tail = Tail.PAD if group == "g" else tail  # "h" may be either, the same for all its ranks
        if forming and self.flow._forming.groups[group].tail is not tail:
            with pytest.raises(ValueError):
                self.flow.join(cid, prefetch, member=Membership(group, rank, GROUPS[group], tail))
            return
        if any(s.incarnation == self.incarnations[group] for s in taken):
            with pytest.raises(ValueError, match="joined already"):
                self.flow.join(cid, prefetch, member=Membership(group, rank, GROUPS[group], tail))
            return
        self.seen[cid] = Seen(group, rank, self.incarnations[group], tail)
        self._handle(self.flow.join(cid, prefetch, member=Membership(group, rank, GROUPS[group], tail)))

    @rule(group=st.sampled_from(sorted(GROUPS)), prefetch=st.integers(1, 4), tail=st.sampled_from(list(Tail)))
    def join_whole_group(self, group: str, prefetch: int, tail: Tail) -> None:
        """Every rank a forming group lacks (or a new one), as torchrun starts them."""
        assert self.flow is not None
        forming = self.flow._forming.groups.get(group)
        missing = [r for r in range(GROUPS[group]) if forming is None or r not in forming.members]
        if forming is not None:
            tail = forming.tail
        for rank in missing:
            self.join((group, rank), prefetch, tail)
        event("a whole group joined")

    @precondition(lambda self: self.flow is not None and self.flow.consumers)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        assert self.flow is not None
        cid = data.draw(st.sampled_from(sorted(self.flow.consumers)))
        ends = [e[1] for e in self.seen[cid].entries if e[0] == "end"]
        # What its BYE says: nothing (it died), mid-epoch, an epoch whose end it was sent, or
        # a later one (not believed)
        had = [] if self.seen[cid].had_end is None else [self.seen[cid].had_end]
        said = data.draw(st.sampled_from([UNSAID, None, self.epoch + 1, *had, *ends[-2:]]))
        self._handle(self.flow.leave(cid, said))
        self.seen[cid].held.clear()

    @precondition(lambda self: self.flow is not None and any(s.held for s in self.seen.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.flow is not None
        cid = data.draw(st.sampled_from(sorted(c for c, s in self.seen.items() if s.held)))
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.seen[cid].held)), min_size=1, unique=True))
        self.seen[cid].held -= set(seqs)
        self._handle(self.flow.release(cid, seqs))

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule()
    def publish(self) -> None:
        assert self.flow is not None
        place = self.flow.reserve()
        if place is None:
            return
        seq = self.flow.next_seq
        self.memory[place] = seq
        self.where[seq] = (self.epoch, self.index)
        self.index += 1
        self._handle(self.flow.publish(place, seq))

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule()
    def end_epoch(self) -> None:
        assert self.flow is not None
        self.lengths[self.epoch] = self.index
        self._handle(self.flow.end_epoch("end"))
        self.epoch, self.index = self.epoch + 1, 0

    @precondition(lambda self: self.flow is not None and not self.flow.ended and self.epoch >= 2)
    @rule()
    def end_stream(self) -> None:
        assert self.flow is not None
        if self.index:
            self.lengths[self.epoch] = self.index
        self._handle(self.flow.end_stream("END"))

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        prefetch=st.integers(1, 4),
        delta=st.integers(-1, 1),
        rejoined=st.booleans(),
    )
    def join_restored_group(self, group: str, prefetch: int, delta: int, rejoined: bool) -> None:
        """Every rank of a new group, restored (or rejoining a successor) at an epoch's start:
        the one before, this one or the next."""
        assert self.flow is not None
        if group in self.flow._forming.groups:
            return
        at = (max(0, self.epoch + delta), 0)
        self.incarnations[group] += 1
        for rank in range(GROUPS[group]):
            cid = f"c{self.cids}"
            self.cids += 1
            had = at[0] - 1 if at[0] else None
            self.seen[cid] = Seen(group, rank, self.incarnations[group], had_end=had)
            member = Membership(group, rank, GROUPS[group])
            self._handle(self.flow.join(cid, prefetch, member=member, at=at, rejoined=rejoined))
        event(f"a group restored at an epoch {delta:+d} from this one")

    @invariant()
    def invariants(self) -> None:
        if self.flow is not None:
            check_invariants(self.flow)
            for cid, c in self.flow.consumers.items():  # members finishing an epoch their group may
                g = c.group
                if g is None or g.lost is None or c.broken or c.finished:
                    continue
                assert g.until is not None and c.cursor is not None, ("left uncut", cid, c, g)
                after = self.flow._epoch_starts.get(g.until + 1)
                assert after is None or c.cursor < after, ("a finishing member past its epoch", cid, c, g)

    @invariant()
    def shares_are_equal_and_exact(self) -> None:
        """For every incarnation of a group and every epoch all of its members were sent the
        end of: each rank got exactly its share, in order."""
        if self.flow is None:
            return
        for group, size in GROUPS.items():
            for n in range(1, self.incarnations[group] + 1):
                members = [s for s in self.seen.values() if s.group == group and s.incarnation == n]
                for s in members:
                    epochs: dict[int, list[int]] = {}
                    for item in s.entries:
                        if item[0] == "end":
                            got = epochs.pop(item[1], [])
                            assert got == expected_share(s.rank, size, self.lengths[item[1]], s.tail), (
                                s,
                                got,
                            )
                            event("an epoch's share checked")
                        else:  # (a member that started mid-epoch would fail the check above)
                            epochs.setdefault(item[0], []).append(item[1])

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule()
    def everyone_releases_then_a_place_is_free(self) -> None:
        """Progress: once every consumer released all it holds, the producer can publish."""
        assert self.flow is not None
        while any(s.held for s in self.seen.values()):  # a release may send more
            for cid, s in self.seen.items():
                if s.held:
                    seqs = sorted(s.held)
                    s.held.clear()
                    self._handle(self.flow.release(cid, seqs))
        place = self.flow.reserve()
        assert place is not None, "deadlock: nobody holds anything and still no place"
        self.flow.cancel(place)
        self.memory[place] = -1  # whatever it held is forgotten

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule(data=st.data())
    def restart_at_a_position(self, data: st.DataObject) -> None:
        """An ungrouped consumer restarts from a state saved at one of the batches it was
        sent: the new one starts exactly there when that batch and all after it are still
        resident (its replay, in effect); else where its policy says."""
        assert self.flow is not None
        restartable = [
            c for c, s in self.seen.items() if c in self.flow.consumers and s.group is None and s.entries
            and any(e[0] != "end" for e in s.entries)
        ]  # fmt: skip
        if not restartable:
            return
        cid = data.draw(st.sampled_from(sorted(restartable)))
        old = self.seen[cid]
        position = data.draw(st.sampled_from([e for e in old.entries if e[0] != "end"]))
        self._handle(self.flow.leave(cid))
        old.held.clear()
        seq = next(q for q, where in self.where.items() if where == position)
        exact = all(
            self.memory.get(self.flow._log[q].place) == q if self.flow._log.get(q) is not None
            and self.flow._log[q].kind is BATCH else q in self.flow._log
            for q in range(seq, self.flow.next_seq)
        )  # fmt: skip
        new = f"c{self.cids}"
        self.cids += 1
        self.seen[new] = Seen(None, old.rank, 0)
        self._handle(self.flow.join(new, 4, at=position))
        if exact:
            assert self.seen[new].entries[:1] == [position], (position, self.seen[new].entries)
            event("restarted exactly")
        else:
            event("restarted by policy")

    @precondition(lambda self: self.flow is not None and not self.flow.ended)
    @rule(keep=st.integers(1, 2))
    def trainers_wait_holding_their_newest(self, keep: int) -> None:
        """No deadlock in DDP's lockstep: every consumer holds its newest ``keep`` batches
        (the step's, and one a prefetching fetcher took) and releases the rest, until nothing
        more comes; then the producer must still find a place for the next batch."""
        assert self.flow is not None
        while True:
            released = False
            for cid, s in self.seen.items():
                state = self.flow.consumers.get(cid)
                if state is None:
                    continue
                old = sorted(s.held)[: max(0, len(s.held) - min(keep, state.prefetch - 1))]
                if old:
                    s.held -= set(old)
                    self._handle(self.flow.release(cid, old))
                    released = True
            if not released:
                break
        place = self.flow.reserve()
        assert place is not None, "deadlock: every consumer waits and no place is free"
        self.flow.cancel(place)
        self.memory[place] = -1
        event(f"trainers wait holding {keep}")


TestGroupMachine = GroupMachine.TestCase
TestGroupMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_places_to_start_counts_what_a_groups_start_would_add_beside_the_running_ones():
    """What the producer checks against the memory before a member joins (see
    tensorsocket.producer.room): the places the start adds, GROUP_PLACES_PER_RANK a rank."""
    flow = Flow(window=4, places=4)
    job, other = Membership("job", 0, 2), Membership("other", 0, 3)
    assert flow.places_to_start(job) == 6
    flow.join("a", 2, member=job)
    assert flow.places_to_start(Membership("job", 1, 2)) == 6  # forming: nothing added yet
    flow.join("b", 2, member=Membership("job", 1, 2))
    assert flow.place_count == 4 + 6
    assert flow.places_to_start(other) == 9  # the running group keeps its 6
    flow.leave("a")
    flow.leave("b")  # a group that ended leaves its places to later ones
    assert flow.places_to_start(other) == 3 and flow.place_count == 10


def test_places_to_start_refuses_first_what_join_would_refuse():
    """The producer asks before the memory check, so that a member in conflict with its group
    is told of the conflict, not of memory it would not have been given anyway."""
    flow = Flow(window=4, places=4)
    flow.join("a", 2, member=Membership("job", 0, 2))
    with pytest.raises(ValueError, match="this member says world_size=3, the ones that joined 2"):
        flow.places_to_start(Membership("job", 1, 3))
    with pytest.raises(ValueError, match="rank 0 has joined already"):
        flow.places_to_start(Membership("job", 0, 2))
    with pytest.raises(ValueError, match="a group starts at an epoch's first batch"):
        flow.places_to_start(Membership("job", 1, 2), LateJoin.NOW)
    assert flow.places_to_start(Membership("job", 1, 2)) == 6
    assert list(flow.consumers) == ["a"] and flow.place_count == 4  # nothing recorded
