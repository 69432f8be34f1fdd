"""Places added while the stream runs (a group's, one for a blocked joiner) that do not fit
the shared memory: the consumer that needs them is refused or evicted, saying why with the
numbers, and the others' stream goes on. Before, the producer hit ENOSPC and ended the
stream for everyone. Real processes in a 64 MiB /dev/shm (a container's default)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support import run_in_64_mib_dev_shm, small_shm_works

pytestmark = pytest.mark.skipif(
    not small_shm_works(), reason="mounting a private tmpfs needs root (CI runs as root)"
)

EPOCHS, BATCHES = 3, 8

# A producer of BATCHES batches of MIB MiB ("4,10": the first batch 4, the rest 10) (private memory: kept for replay where they are,
# none of it in /dev/shm), a leader from the start, and consumers with LATE's options half a
# second after its first batch: what each got, or the error it raised. OPTIONS: the producer's other arguments.
SCENARIO = """\
import json, logging, sys, time
import torch
from tensorsocket import Consumer, Producer
from tests.support import FORK


def consume(name, options, started, joined, out):
    before = options.pop("before", False)  # joins before the first batch: the loader waits for it
    if options.get("label") != "leader" and not before:
        started.wait(60)  # half a second (or "after" s) after the leader's first batch
        time.sleep(options.pop("after", 0.5))
    ready = options.pop("ready", None)  # joined at once, began iterating after the first batch
    try:
        with Consumer(name=name, timeout=30, **options) as consumer:
            if before:
                joined.put(options.get("label"))
            if ready is not None:
                started.wait(60)
                time.sleep(ready)
            epochs = []
            while not consumer.finished:
                epochs.append([])
                for x, in consumer:
                    epochs[-1].append(int(x[0]))
                    started.set()
            out.put({"options": options, "epochs": [e for e in epochs if e]})
    except Exception as exc:
        out.put({"options": options, "error": f"{type(exc).__name__}: {exc}"})


class Batches:
    def __init__(self, count, mib, joined, before):
        self.count, self.mib, self.first = count, mib, True
        self.joined, self.before = joined, before

    def __len__(self):
        return self.count

    def __iter__(self):
        for _ in range(self.before if self.first else 0):  # (a loaded machine starts them late)
            self.joined.get(timeout=60)
        for i in range(self.count):
            time.sleep(0.1)
            mib = self.mib[0] if self.first else self.mib[-1]  # the stream's first batch, then the rest
            self.first = False
            yield (torch.full((mib << 20,), i, dtype=torch.uint8),)


if __name__ == "__main__":
    name, slots, epochs, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
    mib = [int(m) for m in sys.argv[3].split(",")]
    late, options = json.loads(sys.argv[6]), json.loads(sys.argv[7])
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
    out, started, joined = FORK.Queue(), FORK.Event(), FORK.Queue()
    before = sum(1 for options in late if options.get("before"))
    procs = [FORK.Process(target=consume, args=(name, {"label": "leader"}, started, joined, out))]
    procs += [FORK.Process(target=consume, args=(name, options, started, joined, out)) for options in late]
    for p in procs:
        p.start()
    report = {}
    try:
        Producer(Batches(batches, mib, joined, before), name=name, slots=slots, **options).serve(epochs=epochs)
    except OSError as exc:
        report["producer_error"] = str(exc)
    report["consumers"] = {r["options"].get("label", "?"): r for r in (out.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    print("REPORT " + json.dumps(report), flush=True)
"""


def _run(
    tmp_path: Any,
    name: str,
    slots: int,
    mib: int | str,
    late: list[dict[str, Any]],
    epochs: int = EPOCHS,
    **producer: Any,
) -> tuple[dict[str, Any], str]:
    args = [name, str(slots), str(mib), str(epochs), str(BATCHES), json.dumps(late), json.dumps(producer)]
    return run_in_64_mib_dev_shm(SCENARIO, args, tmp_path)


def _ranks(size: int) -> list[dict[str, Any]]:
    return [
        {"label": f"rank{r}", "group": "g", "rank": r, "world_size": size, "late_join": "next_epoch"}
        for r in range(size)
    ]


def _leader_got_everything(report: dict[str, Any], out: str, epochs: int = EPOCHS) -> None:
    assert "producer_error" not in report, report
    leader = report["consumers"]["leader"]
    assert leader.get("epochs") == [list(range(BATCHES))] * epochs, (leader, out[-3000:])


def test_a_group_whose_places_do_not_fit_is_refused_and_the_stream_goes_on(tmp_path, name):
    """slots=2 of 12 MiB take 24 MiB; a group of 2 ranks would add 6 places (72 MiB) to the
    40 MiB left."""
    report, out = _run(tmp_path, name, slots=2, mib=12, late=_ranks(2))
    _leader_got_everything(report, out)
    for rank in ("rank0", "rank1"):
        error = report["consumers"][rank]["error"]
        assert error.startswith("Refused:"), error
        assert "group 'g': its 2 ranks need 6 more places of 12.0 MiB (3 a rank): 72 MiB" in error, error
        assert "/dev/shm has 40 MiB free (room for 3)" in error and "--shm-size" in error, error


def test_a_group_formed_before_the_first_batch_is_counted_in_its_check(tmp_path, name):
    """The 2 ranks join before the first batch (min_consumers=3 waits for them), so no batch
    size is known at their join: the first batch's check counts the group's 6 places beside
    the 2 slots, 96 MiB of 12 MiB places in 64. Fewer slots cannot help (the group's places
    alone do not fit), and the error does not suggest it."""
    late = [r | {"before": True} for r in _ranks(2)]
    report, out = _run(tmp_path, name, slots=2, mib=12, late=late, replay=0, min_consumers=3)
    error = report.get("producer_error", "")
    assert "need 8 x 12.0 MiB = 96 MiB for slots=2 and the 6 places of group(s) 'g'" in error, out[-3000:]
    assert "/dev/shm has 64 MiB free: make batches smaller, run fewer ranks, or" in error, error
    assert "lower slots=" not in error, error
    for label in ("leader", "rank0", "rank1"):  # each is told why the stream ended
        told = report["consumers"][label]["error"]
        assert told.startswith("ProducerLost:") and "96 MiB" in told, told


def test_a_group_whose_ranks_joined_before_the_first_batch_and_start_after_it_is_checked(tmp_path, name):
    """The 2 ranks join before the first batch (no batch size known: nothing to check them
    by), and begin iterating after it: their group's start adds 6 places of 12 MiB (72 MiB)
    to the 40 MiB left. Before, nothing checked them, and the producer hit ENOSPC, ending the
    stream for everyone. Now its ranks are evicted, saying why, and the leader goes on. (The
    loader's first batch waits for the ranks' join: on a loaded CI machine they were once
    slower than it, and refused at their join, the first test's case.)"""
    late = [r | {"before": True, "ready": 0.5} for r in _ranks(2)]
    report, out = _run(tmp_path, name, slots=2, mib=12, late=late, replay=0)
    _leader_got_everything(report, out)
    for rank in ("rank0", "rank1"):
        error = report["consumers"][rank]["error"]
        assert error.startswith("Evicted:"), error
        assert "group 'g': its 2 ranks need 6 more places of 12.0 MiB (3 a rank): 72 MiB" in error, error
        assert "/dev/shm has 40 MiB free (room for 3)" in error, error


def test_a_group_is_counted_at_the_size_batches_grew_to(tmp_path, name):
    """The first batch is 4 MiB, the rest 10: the 6 places the group would add are 60 MiB (as
    the arenas grew), not 24 (the first batch's size), against the 44 MiB left."""
    report, out = _run(tmp_path, name, slots=2, mib="4,10", late=_ranks(2))
    _leader_got_everything(report, out)
    for rank in ("rank0", "rank1"):
        error = report["consumers"][rank]["error"]
        assert "6 more places of 10.0 MiB (3 a rank): 60 MiB" in error, error


def test_a_group_whose_places_fit_runs(tmp_path, name):
    """The same with 4 MiB batches: its 6 places (24 MiB) fit, and each rank gets its share.
    The ranks join half a second after the leader's first batch and start at the next
    epoch's first batch: more epochs than the others, so ranks that start late (a loaded
    machine starting three processes) still get some before the stream ends."""
    report, out = _run(tmp_path, name, slots=2, mib=4, late=_ranks(2), epochs=EPOCHS + 3)
    _leader_got_everything(report, out, EPOCHS + 3)
    shares = [report["consumers"][rank].get("epochs") for rank in ("rank0", "rank1")]
    assert all(shares), (report, out[-3000:])
    assert len(shares[0]) == len(shares[1]) >= 1
    for epoch in zip(*shares, strict=True):
        assert sorted(epoch[0] + epoch[1]) == list(range(BATCHES)), shares


def test_a_joiner_waiting_for_a_place_that_does_not_fit_is_evicted_and_the_stream_goes_on(tmp_path, name):
    """slots=2 of 24 MiB take 48 MiB. The leader's loop holds one batch while it waits for
    the next, which it was sent; the replaying joiner waits for a kept batch to be written
    again, and one more place (24 MiB) does not fit the 16 MiB left. (The replay budget is
    given: by default it is a quarter of the free /dev/shm, here less than a batch.)"""
    joiner = [{"label": "joiner", "late_join": "replay"}]
    report, out = _run(tmp_path, name, slots=2, mib=24, late=joiner, replay=1 << 30)
    _leader_got_everything(report, out)
    error = report["consumers"]["joiner"]["error"]
    assert error.startswith("Evicted:"), error
    assert "one more place of 24.0 MiB does not fit: /dev/shm has 16 MiB free" in error, error
    assert "late_join='next_epoch'" in error and "--shm-size" in error, error


def test_a_member_that_conflicts_with_its_group_is_told_so_not_that_memory_is_short(tmp_path, name):
    """slots=4 of 5 MiB take 20 MiB. Rank 0 of a group of 2 (6 places: 30 MiB, which fit)
    waits for its rank 1, which never comes; a member that says world_size=4 joins later. Its
    12 places would not fit either, but what is wrong is its world_size, and that is what it
    is told (it was told the memory was short)."""
    late = [_ranks(2)[0], {"label": "wrong", "group": "g", "rank": 1, "world_size": 4, "after": 1.5}]
    report, out = _run(tmp_path, name, slots=4, mib=5, late=late, epochs=EPOCHS + 2)
    _leader_got_everything(report, out, EPOCHS + 2)
    error = report["consumers"]["wrong"]["error"]
    assert (
        error.startswith("Refused:") and "this member says world_size=4, the ones that joined 2" in error
    ), error
    assert report["consumers"]["rank0"].get("epochs") == [], report["consumers"]["rank0"]
