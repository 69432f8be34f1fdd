"""A trainer that rejoins a successor which starts its epoch again (its loader cannot repeat
its order) only after the successor stopped waiting for it and published on. Real processes:
a ``tensorsocket serve --resume`` producer SIGKILLed, its successor served, trainers spawned
and stopped (SIGSTOP) across the restart."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tensorsocket import endpoint, protocol
from tensorsocket.cli.query import query_status
from tensorsocket.consumer import resume
from tensorsocket.consumer.inbox import Inbox
from tensorsocket.consumer.shared import END, EPOCH_END, Settings, Shared
from tensorsocket.producer import restart
from tensorsocket.protocol import Kind
from tests.support import SPAWN, wait_until
from tests.test_restart import ROWS, SAMPLES, _consume, _serve
from tests.test_restart_rejoins import end_all

EPOCHS = 3
BATCHES = SAMPLES // ROWS


def _late_rejoiners(name: str, tmp_path: Any, successors: int) -> dict[str, dict[str, Any]]:
    """Trainers P, S (``late_join="replay"``) and N (``"now"``); S and N are stopped once
    each had a few batches of epoch 0, the producer is SIGKILLed and an ``unrepeatable``
    successor without replay (``--replay 0``) starts epoch 0 again. It waits 1 s (``--grace``)
    for S and N, then serves P. With 2 ``successors``, it is SIGKILLed once it published 6
    batches, and the next starts epoch 0 again once more (its order is not the first
    successor's either). Once the last successor's first 4 places were reused, S and N go on
    and rejoin. What each saw, by label."""
    out, log = SPAWN.Queue(), tmp_path / "producer.log"
    extra = ("--epochs", str(EPOCHS), "--replay", "0", "--arg", "delay=0.05")  # (20 batches a second)
    options = {"P": {}, "S": {}, "N": {"late_join": "now"}}
    trainers = {
        label: SPAWN.Process(target=_consume, args=(name, {"label": label, **o}, out))
        for label, o in options.items()
    }
    state, address, lives = restart.state_path(endpoint.resolve(name)), endpoint.resolve(name), []
    for p in trainers.values():
        p.start()
    try:
        lives.append(_serve(name, "unrepeatable", log, extra))
        wait_until(
            lambda: (
                state.exists() and restart.read(state).point.index >= 3 and restart.read(state).consumers == 3
            ),
            60,
            "3 batches of epoch 0 to the 3 trainers",
        )
        for label in ("S", "N"):
            os.kill(trainers[label].pid, signal.SIGSTOP)
        lives[0].kill()
        lives[0].wait()
        for life in range(successors):
            if life:
                wait_until(lambda: _published(address) >= 6, 60, "the successor to publish 6 batches")
                lives[-1].kill()
                lives[-1].wait()
            lives.append(_serve(name, "unrepeatable", log, (*extra, "--grace", "1")))
        wait_until(lambda: _published(address) >= 8, 60, "the successor to publish 8 batches")
        for label in ("S", "N"):
            os.kill(trainers[label].pid, signal.SIGCONT)
        results = {r["options"]["label"]: r for r in (out.get(timeout=120) for _ in trainers)}
        assert lives[-1].wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        end_all(lives, trainers.values())
    text = log.read_text()
    assert "starting that epoch again" in text, text[-3000:]
    return results


def _published(address: str) -> int:
    try:
        return query_status(address, 2)["published"]
    except Exception:  # (not bound yet, or busy bringing its loader back)
        time.sleep(0.05)
        return 0


def _once_each(epoch: list[Any]) -> bool:
    return sorted(i for i, _ in epoch) == list(range(SAMPLES))


@pytest.mark.parametrize("successors", [1, 2])
def test_a_trainer_rejoining_a_restarted_epoch_too_late_is_told_what_it_missed(name, tmp_path, successors):
    """S and N had batches of epoch 0 when the producer died; its successor starts epoch 0
    again as a new stream and, without them, serves P. When they rejoin, the new epoch 0's
    first batches are gone (no replay): S (late joiner by replay) is placed at epoch 1, N
    (``late_join="now"``) part-way into epoch 0. Before, neither was told: S's epoch 0 ran on
    into epoch 1's batches (2 epochs of a 3-epoch stream), and N got the rest of the new epoch
    0 after what it had of the old one, with ``missed`` None. Now S's epoch 0 ends where it
    rejoined, and each counts in ``missed`` the new epoch's batches it did not get: what it had
    of epoch 0 (``repeated``), plus what came of it, is the whole epoch less ``missed``.

    With 2 successors, S and N rejoin a stream that replaced the one that replaced theirs.
    Before, they raised ProducerLost ("serves another stream"): a stream named only the one it
    replaced. Now it names those that one replaced too."""
    results = _late_rejoiners(name, tmp_path, successors)
    for label, r in results.items():
        assert "error" not in r, r
        seen, again, missed = r["seen"], r["repeated"] or 0, r["missed"] or 0
        assert len(seen) == EPOCHS, (label, again, missed, [len(e) for e in seen])
        assert len(seen[0]) == (again + BATCHES - missed) * ROWS, (label, again, missed, len(seen[0]))
        assert all(_once_each(e) for e in seen[1:]), label
        if missed < BATCHES:  # (what came of the new epoch 0: each sample at most once)
            new = [i for i, _ in seen[0][again * ROWS :]]
            assert len(set(new)) == len(new), label
    assert results["P"]["missed"] is None and _once_each(results["P"]["seen"][0][-SAMPLES:])
    s, n = results["S"], results["N"]
    assert s["repeated"] >= 3 and s["missed"] == BATCHES, s["missed"]  # placed at epoch 1
    assert n["repeated"] >= 3 and 4 <= n["missed"] < BATCHES, n["missed"]  # placed past 4 reused places


class _Sent(list):
    """A link that keeps what is sent on it (a BYE at the stream's end)."""

    send = list.append


def _inbox_rejoined_at(
    at: tuple[int, int], batches_per_epoch: int | None, group: tuple[str, int, int, str] | None = None
) -> Inbox:
    """A consumer's inbox that rejoined at ``at`` (a rank of ``group``: name, rank, size, tail)."""
    settings = Settings("ipc:///nowhere", "t", 1.0, 1, "replay", None, None, None, False, group=group)
    inbox = Inbox(Shared(), settings, link=_Sent(), stream="s")  # type: ignore[arg-type]
    inbox.rejoined_at, inbox.batches_per_epoch = at, batches_per_epoch
    return inbox


def _ends_queued(inbox: Inbox) -> list[int]:
    """The epochs ended in the queue (its last entry: the stream's end, if it came)."""
    ended = []
    while not inbox.shared.queue.empty():
        kind, payload = inbox.shared.queue.get()
        if kind == END:
            assert inbox.shared.queue.empty()
            break
        assert kind == EPOCH_END
        ended.append(payload)
    return ended


@pytest.mark.parametrize(
    ("first", "ended", "missed"),
    [
        ((Kind.BATCH, 1, 5), [], 0),  # where it should be
        ((Kind.BATCH, 1, 9), [], 4),  # past it in its epoch
        ((Kind.BATCH, 2, 3), [1], 19 + 3),  # in the next epoch: its epoch ends first
        ((Kind.EPOCH_END, 1, 0), [], 19),  # its epoch's end: the rest of that epoch
        ((Kind.EPOCH_END, 3, 0), [1, 2], 19 + 24 + 24),  # a later epoch's end
        ((Kind.END, 2, 0), [1], 19),  # the stream's end after its epoch
        ((Kind.END, 4, 0), [1, 2, 3], 19 + 24 + 24),  # after later epochs
    ],
)
def test_what_a_rejoin_lost_is_counted_from_the_first_entry_whatever_it_is(first, ended, missed):
    """A rejoined consumer (at batch 5 of epoch 1, 24 batches an epoch) counts in ``missed``
    the batches between there and its first entry, and ends the epochs it jumps over. An epoch
    end or the stream's end as the first entry counts the rest of that epoch (before, each
    counted nothing, and the stream's end ended no epoch)."""
    inbox = _inbox_rejoined_at((1, 5), 24)
    kind, epoch, index = first
    if kind is Kind.END:
        assert inbox._other(kind, {"seq": 100, "epoch": epoch, "reason": None})
    else:
        assert inbox._new(kind, 100, epoch, index)
    assert (_ends_queued(inbox), inbox.shared.missed, inbox.rejoined_at) == (ended, missed, None)


def test_an_epoch_end_first_after_a_rejoin_counts_nothing_when_the_epoch_length_is_unknown():
    inbox = _inbox_rejoined_at((1, 5), None)
    assert inbox._new(Kind.EPOCH_END, 100, 2, 0)
    assert (_ends_queued(inbox), inbox.shared.missed) == ([1], 0)


def test_a_stream_started_again_names_the_streams_its_predecessor_had_replaced_up_to_a_bound():
    first = protocol.restarting("s1", 0, None)
    assert first == ["s1", 0] and protocol.replaced_streams(first) == ["s1"]
    second = protocol.restarting("s2", 1, first)
    assert second == ["s2", 1, "s1"] and protocol.replaced_streams(None) == []
    chain = None
    for n in range(40):
        chain = protocol.restarting(f"s{n}", n, chain)
    assert protocol.replaced_streams(chain) == [f"s{n}" for n in range(39, 39 - 17, -1)]
    assert protocol._restarted(chain) and not protocol._restarted([*chain, "one more"])


@pytest.mark.parametrize(
    ("tail", "first", "missed"),
    [
        ("drop", (Kind.EPOCH_END, 1, 0), 0),  # its last round was its epoch's last
        ("drop", (Kind.BATCH, 2, 0), 0),  # the next epoch's first round
        ("pad", (Kind.EPOCH_END, 1, 0), 4),  # the padded last round (8, 9, 8, 9) went by
        ("pad", (Kind.BATCH, 2, 0), 4),
    ],
)
def test_a_group_rank_misses_nothing_past_the_last_round_it_is_sent(tail, first, missed):
    """A rank of a group of 4 over 10-batch epochs rejoins after round 4-7 (at batch 8). With
    ``group_tail="drop"`` the short last round goes to nobody: an epoch end or the next epoch
    first is no loss (the reviewer's case: before, 2 batches were counted missed). With
    ``"pad"`` it is sent, padded, and going past it misses that round."""
    inbox = _inbox_rejoined_at((1, 8), 10, ("g", 1, 4, tail))
    kind, epoch, index = first
    assert inbox._new(kind, 100, epoch, index)
    assert inbox.shared.missed == missed


def test_an_epochs_span_is_its_batches_or_a_groups_last_round_end():
    assert [resume.epoch_span(10, g) for g in (None, ("g", 0, 4, "drop"), ("g", 0, 4, "pad"))] == [10, 8, 12]
    assert resume.epoch_span(12, ("g", 0, 4, "drop")) == resume.epoch_span(12, ("g", 0, 4, "pad")) == 12
    assert resume.epoch_span(None, ("g", 0, 4, "pad")) is None


def test_a_consumer_that_rejoins_from_a_batch_it_never_mapped_counts_what_it_had_before_it():
    """A chaos helper's case (a rank SIGSTOPped across a kill): batch 22 of epoch 0 was unlinked
    by the successor before the consumer mapped it, and it read on into epoch 1's batches (each
    released, none yielded). It rejoins from batch 22, so what it had of epoch 0 is what the
    next rejoin counts as come again. Before: the later batches had moved its epoch's start
    to epoch 1, and it said 0 batches of epoch 0 came again where it had 22."""
    inbox = _inbox_rejoined_at((0, 0), 24)
    inbox.rejoined_at, inbox.began, inbox.last_seq, inbox.next_at = None, (0, 0), 21, (0, 22)
    assert inbox._unmapped(22, 0, 22, FileNotFoundError(2, "No such file", "/dev/shm/gone"))
    assert inbox._new(Kind.EPOCH_END, 24, 0, 0) and inbox._new(Kind.BATCH, 25, 1, 0)
    assert inbox.began == (1, 0)
    inbox.rejoin_from_freed()
    assert (inbox.last_seq, inbox.next_at, inbox.began, inbox.freed) == (21, (0, 22), (0, 0), None)
