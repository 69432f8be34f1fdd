"""A group whose ranks had received unequal shares of an epoch when their producer died, and
whose successor starts that epoch again (its loader cannot repeat the order): every rank
must still end the epoch after the same number of batches, or DDP's all-reduces would wait
at its end. Real processes: a resumable producer SIGKILLed, a ``tensorsocket serve --resume``
successor, ranks spawned."""

from __future__ import annotations

from typing import Any

import pytest

from tensorsocket.errors import ProtocolError
from tensorsocket.protocol import Kind
from tests.support import SPAWN
from tests.test_restart import EPOCHS, ROWS, SAMPLES, _consume
from tests.test_restart_late_rejoin import _inbox_rejoined_at
from tests.test_restart_rejoins import _kill_and_serve_unrepeatable, _publish_until_told_then_die, _trainer

GROUP = {"group": "job", "world_size": 2}


def _ranks_apart_when_the_producer_dies(name: str, tmp_path: Any) -> list[dict[str, Any]]:
    """Rank 1 stops holding its first batch (its I/O thread still takes what its prefetch
    allows); rank 0 runs on as far as the producer's window lets it, so it has received more
    rounds of epoch 0 than rank 1 when the producer is SIGKILLed. What each rank saw, by rank."""
    die, out, stopped, go = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    first = SPAWN.Process(target=_publish_until_told_then_die, args=(name, die, SAMPLES, 4, EPOCHS, 2))
    first.start()
    ranks = [
        SPAWN.Process(target=_trainer, args=(name, "rank0", out, {**GROUP, "rank": 0})),
        SPAWN.Process(
            target=_consume,
            args=(name, {"label": "rank1", **GROUP, "rank": 1, "prefetch": 2}, out, (stopped, go)),
        ),
    ]
    for p in ranks:
        p.start()
    assert stopped.wait(60)
    log = tmp_path / "producer.log"
    results = _kill_and_serve_unrepeatable(name, first, die, ranks, out, log, go)
    return sorted(results, key=lambda r: r["options"]["rank"])


def test_ranks_that_had_unequal_shares_of_an_epoch_started_again_end_it_after_as_many_batches(name, tmp_path):
    """Before: each rank got its whole share of the epoch's new order after what it had, so
    rank 0 had as many more batches of epoch 0 as it had received more rounds (chaos seed 8003:
    9 against 8). Now a rank that had more skips that many of its first batches of the new
    order (``missed`` says how many), so both have the share of the rank that had fewest
    plus that: every rank's ``repeated`` less ``missed`` is the same."""
    results = _ranks_apart_when_the_producer_dies(name, tmp_path)
    assert all("error" not in r for r in results), results
    had = [r["repeated"] or 0 for r in results]
    assert had[0] > had[1], f"the scenario needs rank 0 ahead when the producer died: {had}"
    counts = [[len(e) // ROWS for e in r["seen"]] for r in results]
    share = SAMPLES // ROWS // 2
    assert counts[0] == counts[1] == [share + had[1]] + [share] * (EPOCHS - 1), (had, counts)
    assert [r["missed"] or 0 for r in results] == [had[0] - had[1], 0]
    # the new order's part of epoch 0: no sample twice; all but rank 0's skipped batches
    after = [i for r, h in zip(results, had, strict=True) for i, _ in r["seen"][0][h * ROWS :]]
    assert len(after) == len(set(after)) == SAMPLES - (had[0] - had[1]) * ROWS
    for epoch in range(1, EPOCHS):
        assert sorted(i for r in results for i, _ in r["seen"][epoch]) == list(range(SAMPLES))


def test_a_rank_told_where_it_goes_on_rejoins_there_after_another_crash_and_counts_the_skip_missed():
    """PLACED, as a rank's inbox takes it: its next rejoin names that batch (a successor's
    successor, before it received anything there, places it after what it skipped), and
    ``missed`` counts the batches skipped. A consumer outside a group is never sent one."""
    inbox = _inbox_rejoined_at((0, 0), 24, ("job", 0, 2, "pad"))
    inbox.rejoined_at = None
    assert inbox._other(Kind.PLACED, {"epoch": 0, "index": 4, "skipped": 2})
    assert inbox.next_at == (0, 4) and inbox.shared.missed == 2
    loner = _inbox_rejoined_at((0, 0), 24)
    with pytest.raises(ProtocolError, match="unexpected placed"):
        loner._other(Kind.PLACED, {"epoch": 0, "index": 4, "skipped": 2})
