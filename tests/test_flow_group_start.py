"""Where a group's ranks start when they rejoin a restarted producer (the pure flow): each after
the last round it received, and, when the successor starts their epoch again in a new order,
levelled so every rank ends each epoch after as many batches (:func:`level_restarted`)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorsocket.flow import Flow, Membership, Placed, Tail
from tensorsocket.flow_groups import level_restarted, rejoin_at
from tensorsocket.flow_invariants import check_invariants
from tensorsocket.producer import successor
from tensorsocket.producer.shared import Config
from tests.test_flow_resume import run, sent


@pytest.mark.parametrize(
    ("ranks", "skips"),
    [
        ([(0, 4), (0, 2)], [2, 0]),  # the one that had fewest gets the whole new order's share
        ([(0, 3), (0, 3)], [0, 0]),  # (the usual case: every rank gets its whole share again)
        ([(0, 3), (0, 3), (0, 2)], [1, 1, 0]),
        ([(1, 1), (0, 7)], [1, 7]),  # rank 0 had epoch 0's end: each ends its epoch after its share
        ([(2, 0), (1, 5), (1, 6)], [0, 5, 6]),
    ],
)
def test_ranks_skip_what_they_had_beyond_the_shares_the_others_get_again(ranks, skips):
    assert level_restarted(ranks) == skips


def test_a_rank_rejoins_after_its_last_round_or_inside_a_round_the_successor_starts_in():
    assert rejoin_at((0, 4), 0, 2, 0, 5) == (0, 4)  # it would lack batch 4: not there
    assert rejoin_at((0, 4), 1, 2, 0, 5) == (0, 5)  # its batch 5 is the first the successor has
    assert rejoin_at((0, 4), 1, 2, 0, None) == (0, 4)
    assert rejoin_at((0, 0), 0, 2, 2, 0) == (0, 4)  # two rounds skipped


def _rejoined_group(
    positions: list[tuple[tuple[int, int], int | None]], window: int = 4
) -> tuple[Flow, list]:
    """A successor that starts epoch 0 from its first batch, and a group whose ranks rejoin it
    at their ``positions`` (where they go on, and the rounds they had of that epoch, or None
    for a rank of the same stream)."""
    flow = Flow(window=window, places=2 * window)
    flow.start_at(0, 0, 0)
    out: list = []
    size = len(positions)
    for rank, (_, had) in enumerate(positions):
        out += flow.join(
            f"r{rank}", 4, member=Membership("job", rank, size), ready=False, rejoined=True, had=had
        )
    for rank, (at, _) in enumerate(positions):
        out += flow.ready(f"r{rank}", at, rejoined=True)
    return flow, out


def test_a_rank_that_had_more_of_an_epoch_started_again_skips_as_many_of_its_new_order():
    """Rank 0 had 4 rounds of the old order, rank 1 had 2 (rank 0's batches ran ahead): rank 0
    skips its first 2 batches of the new order, and both end the epoch after 6."""
    flow, out = _rejoined_group([((0, 0), 4), ((0, 0), 2)])
    assert [a for a in out if isinstance(a, Placed)] == [Placed("r0", 0, 4, 2)]
    run(flow, 12, out, release=("r0", "r1"))
    out += flow.end_epoch(None)
    check_invariants(flow)
    assert sent(out, "r0") == [(0, 4), (0, 6), (0, 8), (0, 10), ("end", 0)]
    assert sent(out, "r1") == [(0, 1), (0, 3), (0, 5), (0, 7), (0, 9), (0, 11), ("end", 0)]


def test_ranks_that_had_as_much_each_get_their_whole_share_of_the_new_order_again():
    flow, out = _rejoined_group([((0, 0), 3), ((0, 0), 3)])
    assert not any(isinstance(a, Placed) for a in out)
    run(flow, 4, out, release=("r0", "r1"))
    assert sent(out, "r0") == [(0, 0), (0, 2)] and sent(out, "r1") == [(0, 1), (0, 3)]


def test_ranks_on_both_sides_of_an_epochs_end_each_end_their_epoch_after_their_share():
    """Rank 0 had all of epoch 0 and 1 round of epoch 1; rank 1 had 5 of epoch 0's 6 rounds.
    Rank 1 gets the last batch of its share of the new epoch 0, rank 0 none of it; in epoch 1
    rank 0 skips 1: each ends each epoch after 6 batches, counting what it had."""
    flow, out = _rejoined_group([((1, 0), 1), ((0, 0), 5)])
    assert [a for a in out if isinstance(a, Placed)] == [Placed("r0", 1, 2, 1), Placed("r1", 0, 10, 5)]
    run(flow, 12, out, release=("r0", "r1"))
    out += flow.end_epoch(None)
    run(flow, 12, out, release=("r0", "r1"))
    check_invariants(flow)
    assert sent(out, "r1") == [(0, 11), ("end", 0), *[(1, i) for i in range(1, 12, 2)]]
    assert sent(out, "r0") == [(1, i) for i in range(2, 12, 2)]


def test_ranks_of_the_same_stream_each_go_on_after_what_they_received():
    """A successor that continues the stream (had None): nothing skipped, nobody told."""
    flow, out = _rejoined_group([((0, 2), None), ((0, 0), None)])
    assert not any(isinstance(a, Placed) for a in out)
    run(flow, 4, out, release=("r0", "r1"))
    assert sent(out, "r0") == [(0, 2)] and sent(out, "r1") == [(0, 1), (0, 3)]


def test_a_rank_that_had_received_nothing_counts_as_having_had_none_of_the_epoch():
    """Rank 1's first batch was in flight when the producer died: it rejoins with no position
    (nothing received, nothing restored). Before: the group fell back to its policy, both
    started the new order at its start, and rank 0 had 4 batches more. Now rank 1 counts as at
    the epoch's start with none of it, and rank 0 skips its 4."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 0)
    out: list = []
    out += flow.join("r0", 4, member=Membership("job", 0, 2), ready=False, rejoined=True, had=4)
    out += flow.join("r1", 4, member=Membership("job", 1, 2), ready=False)
    out += flow.ready("r0", (0, 0), rejoined=True)
    out += flow.ready("r1")
    assert [a for a in out if isinstance(a, Placed)] == [Placed("r0", 0, 8, 4)]
    run(flow, 24, out, release=("r0", "r1"))
    assert len(sent(out, "r0")) + 4 == len(sent(out, "r1")) == 12


def test_a_group_placed_by_its_policy_after_a_rank_could_not_be_placed_keeps_no_rank_s_offset():
    """A successor of the same stream that moved on before the group rejoined: rank 0 could be
    placed (epoch 1, after its round 0: waiting for that epoch), rank 1 not (its batch is gone),
    so the policy places the group at epoch 1's start. Found in review: rank 0's offset in epoch
    1 stayed, and both skipped epoch 1's first round."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 0)
    out: list = []
    flow.join("other", 4)
    run(flow, 14, out, release=("other",))
    for r in range(2):
        out += flow.join(f"r{r}", 4, member=Membership("job", r, 2), ready=False, rejoined=True)
    out += flow.ready("r0", (1, 2), rejoined=True)
    out += flow.ready("r1", (0, 2), rejoined=True)
    run(flow, 2, out, release=("other", "r0", "r1"))
    out += flow.end_epoch(None)
    run(flow, 4, out, release=("other", "r0", "r1"))
    check_invariants(flow)
    assert sent(out, "r0") == [(1, 0), (1, 2)] and sent(out, "r1") == [(1, 1), (1, 3)]


def test_a_successor_learns_the_rounds_a_rank_had_of_the_epoch_it_starts_again():
    config = _config(stream="B", restarted=["A", 1])
    assert successor.had(config, ["A", 1, 10, True], 2) == 5
    assert successor.had(config, ["A", 1, 10, False], 2) == 5  # restored, nothing received since
    assert successor.had(config, ["A", 2, 4, True], 2) == 2  # its own epoch, a later one
    assert successor.had(config, ["A", 0, 22, True], 2) == 0  # (before the restarted epoch)
    assert successor.had(config, ["B", 1, 10, True], 2) is None  # the same stream: nothing started again
    assert successor.had(config, ["A", 1, 10, True], None) is None  # not a group member
    assert successor.had(config, None, 2) is None
    assert successor.had(_config(stream="A"), ["A", 1, 10, True], 2) is None


def _config(**fields: Any) -> Config:
    return Config("ipc:///nowhere", 4, 0, "stall", None, 24, 96, **fields)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), size=st.integers(2, 3), tail=st.sampled_from(list(Tail)), window=st.integers(3, 6))
def test_a_restarted_group_ends_every_epoch_level_whatever_its_ranks_had(data, size, tail, window):
    """Any mix of ranks in epoch 0 and epoch 1 (one that had epoch 0's end), each having had
    any part of its epoch, rejoin a successor that starts epoch 0 again: counting what each
    had, every rank ends epochs 0 and 1 after as many batches, at least its share, and is
    sent no batch twice."""
    if window < size:
        return
    n = data.draw(st.integers(size, 4 * size), label="batches an epoch")
    share = -(-n // size) if tail is Tail.PAD else n // size
    ranks = [
        (epoch, data.draw(st.integers(0, share - epoch), label=f"rank {r} had"))
        for r, epoch in enumerate(data.draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
    ]
    flow = Flow(window=window, places=2 * window)
    flow.start_at(0, 0, 0)
    out: list = []
    cids = [f"r{r}" for r in range(size)]
    for r, (_, had) in enumerate(ranks):
        member = Membership("job", r, size, tail)
        out += flow.join(cids[r], 4, member=member, ready=False, rejoined=True, had=had)
    for r, (epoch, _) in enumerate(ranks):
        out += flow.ready(cids[r], (epoch, 0), rejoined=True)
    for _ in range(2):
        run(flow, n, out, release=tuple(cids))
        out += flow.end_epoch(None)
    check_invariants(flow)
    totals = []
    for cid, (epoch, had) in zip(cids, ranks, strict=True):
        got = [x for x in sent(out, cid) if x[0] != "end"]
        assert len(got) == len(set(got))
        old = [share, had] if epoch == 1 else [had, 0]
        totals.append(tuple(old[e] + sum(1 for x in got if x[0] == e) for e in (0, 1)))
    assert len(set(totals)) == 1 and min(totals[0]) >= share, (ranks, totals)


def test_a_rank_restored_that_received_nothing_since_goes_on_at_its_restored_position():
    """A group restored at batch 10; rank 0 received round 10-11's batch, rank 1's was in
    flight when the producer died, and the successor continues the stream from batch 11. Found
    in review: rank 1's READY names its restore (not a rejoin), so the group fell back to its
    policy and both went on at epoch 1, 6 rounds of epoch 0 lost. Now each goes on where it is."""
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, 11)
    out: list = []
    for r in range(2):
        out += flow.join(f"r{r}", 4, member=Membership("job", r, 2), ready=False)
    out += flow.ready("r0", (0, 12), rejoined=True)
    out += flow.ready("r1", (0, 10))
    run(flow, 5, out, release=("r0", "r1"))
    assert sent(out, "r0") == [(0, 12), (0, 14)] and sent(out, "r1") == [(0, 11), (0, 13), (0, 15)]
