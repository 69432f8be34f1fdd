"""A restored consumer joins the pure flow at its position (epoch, index): exact when that
batch is still resident or not yet published, else where its late-join policy says."""

from __future__ import annotations

import pytest

from tensorsocket.flow import Deliver, EntryKind, Flow, LateJoin, Membership
from tensorsocket.flow_invariants import check_invariants
from tensorsocket.producer.restart import rejoinable, rejoined

BATCH, EPOCH_END = EntryKind.BATCH, EntryKind.EPOCH_END


def sent(out: list, cid: str) -> list[tuple]:
    """What ``cid`` was sent, as (epoch, index) for batches and ("end", epoch) for markers."""
    got = []
    for a in out:
        if isinstance(a, Deliver) and a.consumer == cid:
            e = a.entry
            got.append((e.epoch, e.index) if e.kind is BATCH else ("end", e.epoch))
    return got


def run(flow: Flow, batches: int, out: list, release: tuple[str, ...] = ()) -> None:
    """Publish ``batches`` batches; the consumers in ``release`` release what they are sent."""
    for _ in range(batches):
        place = flow.reserve()
        assert place is not None
        actions = flow.publish(place, None)
        out += actions
        for a in actions:
            if isinstance(a, Deliver) and a.consumer in release:
                out += flow.release(a.consumer, [a.entry.seq])
        check_invariants(flow)


def test_resumes_at_a_resident_batch_of_this_epoch():
    flow = Flow(window=2, places=8)  # 6 replay places keep what the reader consumed
    out: list = []
    flow.join("reader", 2)
    run(flow, 5, out, release=("reader",))
    joined = flow.join("back", 2, at=(0, 3))  # it had taken batches 0, 1, 2
    assert sent(joined, "back") == [(0, 3), (0, 4)]


def test_resumes_at_a_batch_not_yet_published_and_is_sent_nothing_before_it():
    flow = Flow(window=4, places=4)
    out: list = []
    flow.join("reader", 4)
    run(flow, 2, out, release=("reader",))
    out += flow.join("back", 4, at=(0, 3))  # a predecessor took 0..2 from an earlier stream position
    run(flow, 3, out, release=("reader",))
    assert sent(out, "back") == [(0, 3), (0, 4)]


@pytest.mark.parametrize("index", [0, 2])
def test_resumes_in_the_next_epoch_after_finishing_this_one(index):
    flow = Flow(window=4, places=4)
    out: list = []
    flow.join("reader", 4)
    run(flow, 3, out, release=("reader",))
    out += flow.join("back", 4, at=(1, index))
    out += flow.end_epoch("end")
    run(flow, 4, out, release=("reader", "back"))
    assert sent(out, "back") == [(1, i) for i in range(index, 4)]


def test_a_position_past_the_epochs_end_starts_at_its_end_marker():
    flow = Flow(window=4, places=4)
    out: list = []
    flow.join("reader", 4)
    run(flow, 2, out, release=("reader",))
    out += flow.join("back", 4, at=(0, 7))  # the epoch turns out to have 3 batches
    run(flow, 1, out, release=("reader",))
    out += flow.end_epoch("end")
    run(flow, 1, out, release=("reader", "back"))
    assert sent(out, "back") == [("end", 0), (1, 0)]


def test_a_position_no_longer_resident_falls_back_to_the_policy():
    flow = Flow(window=2, places=2)
    out: list = []
    flow.join("reader", 2)
    run(flow, 5, out, release=("reader",))  # batches 0..2 overwritten
    assert sent(flow.join("back", 2, LateJoin.NOW, at=(0, 1)), "back") == [(0, 3), (0, 4)]
    assert (
        flow.join("waits", 2, at=(0, 1)) == [] and flow.consumers["waits"].cursor is None
    )  # replay: next epoch


def test_a_restored_group_resumes_where_all_its_ranks_agree():
    flow = Flow(window=4, places=12)
    out: list = []
    flow.join("reader", 4)
    run(flow, 6, out, release=("reader",))
    out += flow.join("r0", 4, member=Membership("job", 0, 2), at=(0, 4))
    out += flow.join("r1", 4, member=Membership("job", 1, 2), at=(0, 4))
    run(flow, 2, out, release=("reader",))
    assert sent(out, "r0") == [(0, 4), (0, 6)] and sent(out, "r1") == [(0, 5), (0, 7)]


def test_a_group_whose_ranks_disagree_starts_by_its_policy():
    flow = Flow(window=4, places=12)
    flow.join("reader", 4)
    run(flow, 4, [], release=("reader",))
    flow.join("r0", 4, member=Membership("job", 0, 2), at=(0, 2))
    out = flow.join("r1", 4, member=Membership("job", 1, 2), at=(0, 4))
    assert sent(out, "r0") == [(0, 0), (0, 2)]  # replay: the epoch from its start


def test_a_group_starts_when_all_its_ranks_are_ready_whatever_order_they_load_their_states_in():
    """Trainers construct their consumers, then load their checkpoints, then iterate: the
    group waits for every rank to be ready (it began iterating) and starts from the position
    they agree on, rounded to a round's start."""
    flow = Flow(window=4, places=12)
    flow.join("reader", 4)
    run(flow, 6, [], release=("reader",))
    assert flow.join("r0", 4, member=Membership("job", 0, 2), ready=False) == []
    assert flow.ready("r0", at=(0, 5)) == []  # r1 has not even joined yet
    assert flow.join("r1", 4, member=Membership("job", 1, 2), ready=False) == []
    out = flow.ready("r1", at=(0, 5))
    assert sent(out, "r0") == [(0, 4)] and sent(out, "r1") == [(0, 5)]
    assert flow.ready("r1", at=(0, 0)) == []  # said again: ignored


def test_a_position_past_an_ended_epochs_end_is_at_its_end_marker():
    flow = Flow(window=4, places=12)
    flow.join("reader", 4)
    out: list = []
    run(flow, 5, out, release=("reader",))
    flow.end_epoch("end")
    run(flow, 1, out, release=("reader",))
    out = flow.join("r0", 4, member=Membership("job", 0, 2), at=(0, 6))  # pad: ceil(5 / 2) * 2
    out += flow.join("r1", 4, member=Membership("job", 1, 2), at=(0, 6))
    assert sent(out, "r0") == sent(out, "r1") == [("end", 0)]  # then epoch 1, a round at a time


def test_under_skip_a_consumer_waiting_for_a_later_batch_is_not_the_leader():
    flow = Flow(window=4, places=12, max_lag=2)
    out: list = []
    flow.join("slow", 1)
    flow.join("restored", 4, at=(0, 50))
    run(flow, 3, out)
    assert not any(not isinstance(a, Deliver) for a in out), "the slow consumer was skipped"


# ---------------------------------------------------------------------- a restarted producer


def test_a_successor_continues_the_numbers_and_places_rejoiners_at_their_positions():
    """start_at: batch 5 of epoch 2 (whose first entry was seq 40) is published next, as seq
    45; a consumer at or past it starts there, one behind it follows its policy."""
    flow = Flow(window=4, places=8)
    flow.start_at(2, 40, 5)
    out: list = []
    out += flow.join("at", 4, at=(2, 5))
    out += flow.join("ahead", 4, at=(2, 7))  # it had received 5 and 6 before the crash
    out += flow.join("behind", 4, at=(2, 3))  # not resident: replay is not open mid-epoch
    check_invariants(flow)
    run(flow, 4, out, release=("at", "ahead"))
    assert sent(out, "at") == [(2, 5), (2, 6), (2, 7), (2, 8)]
    assert sent(out, "ahead") == [(2, 7), (2, 8)]
    assert sent(out, "behind") == []  # waits for epoch 3
    assert [a.entry.seq for a in out if isinstance(a, Deliver) and a.consumer == "at"] == [45, 46, 47, 48]
    out += flow.end_epoch("end")
    assert flow.epoch == 3 and flow.next_seq == 50
    run(flow, 1, out, release=("at", "ahead", "behind"))
    assert sent(out, "behind") == [(3, 0)]  # its policy: the next epoch


def test_start_at_comes_first_and_checks_its_numbers():
    flow = Flow(window=2)
    with pytest.raises(ValueError, match="index"):
        flow.start_at(0, 0, -1)
    flow.join("c", 2)
    with pytest.raises(RuntimeError, match="before"):
        flow.start_at(1, 10, 0)


def test_the_restart_point_is_the_oldest_entry_someone_may_not_have_received():
    flow = Flow(window=4, places=8)
    out: list = []
    flow.join("fast", 4)
    flow.join("slow", 4)
    run(flow, 3, out, release=("fast",))
    assert flow.restart_point() == 0  # slow holds 0..2: they may have been in flight
    flow.release("slow", [0, 1])
    assert flow.restart_point() == 2
    flow.release("slow", [2])
    assert flow.restart_point() == 3 == flow.next_seq  # everyone has everything
    out += flow.join("late", 4)  # replay: the epoch from its start again
    assert flow.restart_point() == 0 and flow.keep_from() == 0
    flow.leave("late")
    assert flow.restart_point() == 3 and flow.keep_from() == 0  # a replay may still start at 0


@pytest.mark.parametrize(
    "restart, rank0, rank1, sent0, sent1",
    [
        # rank 0 received round 2-3's batch, rank 1's was in flight: rank 1 rejoins at round 2,
        # rank 0 at round 4 (before: at round 2 too, and its consumer dropped the batch it had)
        (2, (0, 4), (0, 2), [(0, 4)], [(0, 3), (0, 5)]),
        # rank 0 received and released batch 4, rank 1's batch 5 was in flight: the restart
        # point is inside the round 4-5, and the group starts there, not at the next epoch
        (5, (0, 6), (0, 4), [(0, 6)], [(0, 5), (0, 7)]),  # (round 8-9 is not complete yet)
    ],
    ids=["at-a-round-start", "inside-a-round"],
)
def test_a_groups_ranks_rejoining_after_a_crash_each_go_on_after_the_last_round_it_received(
    restart, rank0, rank1, sent0, sent1
):
    flow = Flow(window=4, places=8)
    flow.start_at(0, 0, restart)
    out: list = []
    out += flow.join("r0", 4, member=Membership("job", 0, 2), ready=False)
    out += flow.join("r1", 4, member=Membership("job", 1, 2), ready=False)
    out += flow.ready("r0", rank0, rejoined=True)
    out += flow.ready("r1", rank1, rejoined=True)
    run(flow, 4, out, release=("r0", "r1"))
    assert sent(out, "r0") == sent0 and sent(out, "r1") == sent1


def test_a_successor_waits_for_those_with_something_to_lose_and_counts_only_their_rejoins():
    """rejoinable(): what a producer's state file tells its successor to wait for, consumers
    sent something (they rejoin after it); rejoined(): those of them back (both read the flow). A consumer sent
    nothing yet, a forming group's member and a new consumer count in neither."""
    flow = Flow(window=4, places=8)
    out: list = []
    flow.join("a", 4)
    flow.join("half", 4, member=Membership("job", 0, 2))
    assert rejoinable(flow) == 0  # nobody was sent anything
    run(flow, 1, out, release=("a",))
    flow.join("idle", 4, LateJoin.NEXT_EPOCH)  # mid-epoch: it waits for the next one
    run(flow, 1, out, release=("a",))
    assert sent(out, "a") == [(0, 0), (0, 1)] and not sent(out, "idle")
    assert flow.serving() == 2 and rejoinable(flow) == 1 and rejoined(flow) == 0

    successor = Flow(window=4, places=8)
    successor.start_at(0, 0, 1)
    successor.join("new", 4)  # joins the successor first: not one of its predecessor's
    assert successor.serving() == 1 and rejoined(successor) == 0
    successor.join("a", 4, at=(0, 2), rejoined=True)
    successor.join("restored", 4, at=(0, 1))  # load_state_dict(): a position, but no rejoin
    assert rejoined(successor) == 1 and successor.serving() == 3
    # nothing sent yet, but "a" has a position to lose: its successor's successor waits for it
    assert rejoinable(successor) == 1
    check_invariants(successor)
