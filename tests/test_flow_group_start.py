"""Where a group's ranks start when they rejoin a restarted producer (the pure flow): each after
the last round it received, and, when the successor starts their epoch again in a new order,
levelled so every rank ends each epoch after as many batches (:func:`level_restarted`)."""

from __future__ import annotations

import pytest

from tensorsocket.flow import Flow, Membership, Placed
from tensorsocket.flow_groups import level_restarted, rejoin_at
from tensorsocket.flow_invariants import check_invariants
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
