"""Consumer groups with real processes: the ranks of distributed jobs split one producer's
stream (torchrun with gloo, DDP training bit-identical to ranks reading a plain DataLoader),
while other groups and ungrouped consumers see all of it; a dead rank breaks its group
loudly and spares everyone else."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tensorsocket import Consumer, GroupBroken, Producer, Refused
from tensorsocket.cli.status import format_status
from tests.support import SPAWN, free_port, private_network, serving, wait_until
from tests.test_flow_groups import expected_share

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 4


def make_loader(samples: int, seed: int = 7) -> DataLoader:
    """A shuffled DataLoader of (16 features, sample id); the same object a user would hand
    the producer, and, built again, the reference each rank computes its share from."""
    features = torch.randn(samples, 16, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(features, torch.arange(samples))
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))


def reference_epochs(samples: int, epochs: int) -> list[list[list[int]]]:
    """The sample ids of every batch of every epoch, as a fresh identical loader gives them."""
    loader = make_loader(samples)
    return [[ids.tolist() for _, ids in loader] for _ in range(epochs)]


def share_of(epoch: list[list[int]], rank: int, size: int, tail: str) -> list[list[int]]:
    from tensorsocket.flow import Tail

    return [epoch[i] for i in expected_share(rank, size, len(epoch), Tail(tail))]


def read_epochs(consumer: Consumer, epochs: int) -> list[list[list[int]]]:
    return [[ids.tolist() for _, ids in consumer] for _ in range(epochs)]


# ---------------------------------------------------------------------- torchrun jobs

DDP_RANK = """\
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tensorsocket import Consumer
from tests.test_groups import make_loader

name, group, samples, epochs, report = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def train(epoch_iterators):
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for batches in epoch_iterators:
        ids_seen = []
        for x, ids in batches:
            ids_seen.append(ids.tolist())
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), ids % 2).backward()  # all-reduced
            optimizer.step()
        seen.append(ids_seen)
    return [p.detach().clone() for p in model.parameters()], seen


with Consumer(name=name, group=group, label=f"{group} rank {rank}") as consumer:  # rank from LOCAL_RANK
    length = len(consumer)
    shared_weights, seen = train(consumer for _ in range(epochs))

plain = make_loader(samples)  # the reference: each rank reads its batches (i % world == rank) itself
reference = (
    [batch for i, batch in enumerate(plain) if i % world == rank] for _ in range(epochs)
)
reference_weights, reference_seen = train(reference)
with open(f"{report}.{rank}", "w") as f:
    json.dump(
        {
            "seen": seen,
            "len": length,
            "same_batches": seen == reference_seen,
            "bit_identical": all(torch.equal(a, b) for a, b in zip(shared_weights, reference_weights)),
        },
        f,
    )
dist.destroy_process_group()
# Leave without the interpreter's teardown: gloo's worker threads can abort it now and then
# ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291 describes
# the teardown race), after the report above is written.
sys.stdout.flush()
os._exit(0)
"""


def _torchrun(script: Any, args: list[str]) -> subprocess.Popen:
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(script), *args,
    ]  # fmt: skip
    if private_network():  # its store and gloo then cannot listen beyond loopback
        command = [*private_network(), *command]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _whole_stream(name: str, epochs: int, out: Any) -> None:
    with Consumer(name=name, label="ungrouped") as consumer:
        out.put(read_epochs(consumer, epochs))


def test_two_torchrun_jobs_split_the_stream_within_and_share_it_across(name, tmp_path):
    samples, epochs = 64, 2  # 16 batches an epoch: no short last round
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(DDP_RANK))
    out = SPAWN.Queue()
    whole = SPAWN.Process(target=_whole_stream, args=(name, epochs, out))
    whole.start()
    jobs = {
        g: _torchrun(script, [name, g, str(samples), str(epochs), str(tmp_path / g)])
        for g in ("job-a", "job-b")
    }
    try:
        producer = Producer(make_loader(samples), name=name, slots=4, replay=0, min_consumers=5)
        with serving(producer, epochs=epochs) as (thread, errors):
            outputs = {g: job.communicate(timeout=180)[0] for g, job in jobs.items()}
            everything = out.get(timeout=60)
            whole.join(timeout=30)
            thread.join(timeout=30)
        assert not errors, errors
    finally:
        for job in jobs.values():
            job.kill()
        whole.kill()
    for g, job in jobs.items():
        assert job.returncode == 0, outputs[g][-4000:]
    reference = reference_epochs(samples, epochs)
    assert everything == reference  # the ungrouped consumer: every batch, in order
    for g in jobs:
        ranks = [json.loads((tmp_path / f"{g}.{r}").read_text()) for r in range(2)]
        for epoch in range(epochs):
            shares = [sorted(i for b in r["seen"][epoch] for i in b) for r in ranks]
            assert not set(shares[0]) & set(shares[1]), "the ranks' samples overlap"
            assert sorted(shares[0] + shares[1]) == list(range(samples)), "their union is not the epoch"
            assert len(ranks[0]["seen"][epoch]) == len(ranks[1]["seen"][epoch]) == 8
        for r in ranks:
            assert r["len"] == 8
            assert r["same_batches"], "a rank was not sent its i % world_size batches"
            assert r["bit_identical"], "DDP over the group differs from DDP over a plain DataLoader"


# ---------------------------------------------------------------------- a rank dies


def _member(
    name: str, group: str, rank: int, epochs: int, out: Any, kill_after: int | None, step: float
) -> None:
    """A rank that reads ``epochs`` epochs (or SIGKILLs itself after ``kill_after`` batches)
    and reports what it saw, or the error it raised and when."""
    report: dict[str, Any] = {"group": group, "rank": rank, "seen": [], "error": None}
    try:
        with Consumer(
            name=name, group=group, rank=rank, world_size=2, timeout=5.0, label=f"{group}/{rank}"
        ) as c:
            taken = 0
            for _ in range(epochs):
                epoch = []
                for _, ids in c:
                    epoch.append(ids.tolist())
                    taken += 1
                    if kill_after is not None and taken == kill_after:
                        out.put({**report, "killed_at": time.time()})
                        out.close()
                        out.join_thread()  # the queue's feeder thread has sent it
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(step)
                report["seen"].append(epoch)
    except GroupBroken as exc:
        report["error"], report["error_at"] = str(exc), time.time()
    out.put(report)


def test_a_killed_rank_breaks_its_group_and_nobody_else_notices(name):
    samples, epochs = 48, 2
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_member, args=(name, "a", 0, epochs, out, None, 0.05)),
        SPAWN.Process(target=_member, args=(name, "a", 1, epochs, out, 2, 0.05)),
        SPAWN.Process(target=_member, args=(name, "b", 0, epochs, out, None, 0.0)),
        SPAWN.Process(target=_member, args=(name, "b", 1, epochs, out, None, 0.0)),
        SPAWN.Process(target=_whole_stream, args=(name, epochs, out)),
    ]
    for p in procs:
        p.start()
    try:
        with Producer(make_loader(samples), name=name, slots=4, replay=0, min_consumers=5) as producer:
            with serving(producer, epochs=epochs) as (thread, errors):
                reports = [out.get(timeout=60) for _ in range(5)]  # the victim reports before it dies
                thread.join(timeout=30)
            assert not errors, errors
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    everything = next(r for r in reports if isinstance(r, list))
    by = {(r["group"], r["rank"], "killed_at" in r): r for r in reports if isinstance(r, dict)}
    reference = reference_epochs(samples, epochs)
    assert everything == reference
    for rank in range(2):
        assert by[("b", rank, False)]["error"] is None
        assert by[("b", rank, False)]["seen"] == [share_of(e, rank, 2, "pad") for e in reference]
    survivor, killed = by[("a", 0, False)], by[("a", 1, True)]
    assert survivor["error"] is not None, "the dead rank's peer never heard of it"
    assert "rank 1 of group 'a'" in survivor["error"] and "died" in survivor["error"], survivor["error"]
    assert survivor["error_at"] - killed["killed_at"] < 5.0, "not within the consumer's timeout"


# ---------------------------------------------------------------------- tails, len, status


def test_pad_and_drop_give_every_rank_the_same_count_and_len_says_it(name):
    samples, epochs = 28, 2  # 7 batches an epoch: 2 ranks pad one round, 3 ranks drop one batch
    results: dict[tuple[str, int], Any] = {}

    def rank(group: str, r: int, size: int, tail: str) -> None:
        with Consumer(name=name, group=group, rank=r, world_size=size, group_tail=tail) as c:
            results[group, r] = (len(c), read_epochs(c, epochs))

    threads = [threading.Thread(target=rank, args=("pad", r, 2, "pad")) for r in range(2)]
    threads += [threading.Thread(target=rank, args=("drop", r, 3, "drop")) for r in range(3)]
    for t in threads:
        t.start()
    with Producer(make_loader(samples), name=name, slots=4, replay=0, min_consumers=5) as producer:
        producer.serve(epochs=epochs)
    for t in threads:
        t.join(timeout=30)
    reference = reference_epochs(samples, epochs)
    for (group, r), (length, seen) in results.items():
        size = 2 if group == "pad" else 3
        assert seen == [share_of(e, r, size, group) for e in reference], (group, r)
        assert length == len(seen[0]) == (4 if group == "pad" else 2)
    assert len(results) == 5


def test_status_shows_a_group_forming_then_running(name):
    producer = Producer(make_loader(32), name=name, slots=4, replay=0)
    try:
        first = Consumer(name=name, group="job", rank=0, world_size=2, label="r0")
        (group,) = producer.status()["groups"]
        assert (group["name"], group["size"], group["state"], group["ranks"]) == ("job", 2, "forming", [0])
        second = Consumer(name=name, group="job", rank=1, world_size=2, label="r1")
        assert producer.status()["groups"][0]["state"] == "forming"  # until every rank iterates
        iter(first), iter(second)  # ready: after any load_state_dict
        wait_until(lambda: producer.status()["groups"][0]["state"] == "running", 5, "the group to start")
        status = producer.status()
        assert status["groups"][0]["ranks"] == [0, 1]
        assert {(c["label"], c["group"], c["rank"]) for c in status["consumers"]} == {
            ("r0", "job", 0),
            ("r1", "job", 1),
        }
        text = format_status(status, gpu=([], {}))
        assert "rank 1 of job" in text and "running" in text
        second.close()
        first.close()
    finally:
        producer.close()


def test_a_rank_waiting_for_a_group_that_does_not_form_says_so_once(name, caplog):
    """Rank 0 iterates; rank 1 never joins (it died at start, or has another group name): the
    wait goes on, as it must (rank 1 may still come), with one warning once it lasted the
    consumer's timeout; then rank 1 joins and both get the batches."""
    producer = Producer(make_loader(8), name=name, slots=4, replay=0)
    with serving(producer, 1) as (thread, errors):
        first = Consumer(name=name, group="job", rank=0, world_size=2, timeout=0.5, label="r0")
        taken: list[int] = []
        waiting = threading.Thread(target=lambda: taken.extend(len(b[1]) for b in first), daemon=True)
        waiting.start()
        wait_until(lambda: "has waited 0.5 s for its first batch" in caplog.text, 10, "the warning")
        time.sleep(1.0)  # (a TICK is 50 ms: once, not each)
        assert caplog.text.count("for its first batch") == 1
        assert "rank 0 of group 'job'" in caplog.text and "all its 2 ranks joined" in caplog.text
        with Consumer(name=name, group="job", rank=1, world_size=2, timeout=5.0) as second:
            second_took = [len(b[1]) for b in second]
        waiting.join(timeout=20)
        first.close()
        thread.join(timeout=20)
    assert not waiting.is_alive() and errors == []
    assert taken == second_took == [BATCH]  # 2 batches of 4: a round, a batch to each rank


def test_members_that_conflict_are_refused_with_the_reason(name):
    producer = Producer(make_loader(32), name=name, slots=4, replay=0)
    try:
        with Consumer(name=name, group="job", rank=0, world_size=2):
            with pytest.raises(Refused, match="rank 0 has joined already"):
                Consumer(name=name, group="job", rank=0, world_size=2, timeout=5.0)
            with pytest.raises(Refused, match="world_size=3, the ones that joined 2"):
                Consumer(name=name, group="job", rank=1, world_size=3, timeout=5.0)
            with pytest.raises(Refused, match="needs slots >= 5"):
                Consumer(name=name, group="big", rank=0, world_size=5, timeout=5.0)
            assert producer.status()["groups"][0]["ranks"] == [0]  # the refused ones left no trace
    finally:
        producer.close()


@pytest.mark.parametrize(
    "kwargs, env, needle",
    [
        ({"group": "job"}, {}, "rank is not given and LOCAL_RANK is not set"),
        ({"group": "job"}, {"LOCAL_RANK": "0"}, "world_size is not given and LOCAL_WORLD_SIZE is not set"),
        ({"group": "job"}, {"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='x' is not an int"),
        (
            {"group": "job"},
            {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "rank must be from 0 to world_size - 1 = 1",
        ),
        ({"group": "job", "rank": 0, "world_size": 0}, {}, "world_size must be from 1 to 65536"),
        ({"group": "job", "rank": True, "world_size": 2}, {}, "rank must be an int"),
        ({"group": "", "rank": 0, "world_size": 2}, {}, "group must be a name of 1 to 128 characters"),
        ({"group": 3, "rank": 0, "world_size": 2}, {}, "group must be a name"),
        ({"rank": 0}, {}, "pass group='...' too"),
        ({"world_size": 2}, {}, "pass group='...' too"),
        ({"group_tail": "drop"}, {}, "group_tail applies to a group member"),
        (
            {"group": "job", "rank": 0, "world_size": 2, "group_tail": "even"},
            {},
            "group_tail must be 'pad' or 'drop'",
        ),
        (
            {"group": "job", "rank": 0, "world_size": 2, "late_join": "now"},
            {},
            "use late_join='replay' or 'next_epoch'",
        ),
        (
            {"group": "job", "rank": 0, "world_size": 2, "batch_size": 8},
            {},
            "takes the producer's batches whole",
        ),
    ],
)
def test_bad_group_arguments_fail_at_construction(kwargs, env, needle, monkeypatch):
    for variable in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=needle):
        Consumer(name="nobody-serves-this", timeout=0.5, **kwargs)


def test_rank_and_world_size_default_to_torchruns_environment(name, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with Producer(make_loader(32), name=name, slots=4, replay=0) as producer:
        with Consumer(name=name, group="job") as c:
            assert (c.group, c.rank, c.world_size) == ("job", 1, 2)
            wait_until(lambda: producer.status()["groups"], 5, "the member to join")
            assert producer.status()["groups"][0]["ranks"] == [1]


@contextlib.contextmanager
def two_iterating_ranks(
    name: str, samples: int | Any, epochs: int, tail: str = "pad"
) -> Iterator[tuple[Any, ...]]:
    """A producer serving ``epochs`` of ``samples`` (or of that loader) to a group of two ranks
    that began iterating (so it started): (producer, rank 0, rank 1, their epoch iterators).
    Closed after, the producer with them (nobody is left to read the rest of the stream)."""
    loader = make_loader(samples) if isinstance(samples, int) else samples
    producer = Producer(loader, name=name, slots=4, replay=0)
    try:
        with serving(producer, epochs=epochs) as (thread, errors):
            kwargs: dict[str, Any] = dict(name=name, group="job", world_size=2, group_tail=tail, timeout=5.0)
            r0 = Consumer(rank=0, label="r0", **kwargs)
            r1 = Consumer(rank=1, label="r1", **kwargs)
            yield producer, r0, r1, iter(r0), iter(r1)
            r0.close()
            r1.close()
            producer.close()
            thread.join(timeout=30)
        assert not errors, errors
    finally:
        producer.close()


def test_a_member_back_from_its_step_raises_group_broken_before_a_batch_sent_ahead_of_it(name):
    """The news of a broken group came during a member's training step, after a batch of its
    share: its next next() raises GroupBroken instead of giving that batch (before: it gave
    it, and raised one batch late; a DDP rank would run a step its lost peer never runs)."""
    with two_iterating_ranks(name, 64, epochs=1) as (producer, _, r1, it0, it1):
        first = next(it0)
        next(it1)
        wait_until(lambda: producer.status()["published"] >= 4, 10, "batches sent ahead")
        r1.close()  # mid-epoch: the group breaks while r0 is in its "step"
        wait_until(lambda: producer.status()["groups"][0]["state"] == "broken", 5, "the group to break")
        time.sleep(0.3)  # (the news is on its way to r0, behind the batches sent before it)
        with pytest.raises(GroupBroken, match="rank 1 of group 'job' .* mid-epoch"):
            next(it0)
        del first


def test_a_member_that_finished_its_epoch_and_left_lets_the_others_finish_it(name):
    """Rank 1 reads all of epoch 0 and leaves, after the producer had already sent it batches
    of epoch 1 (prefetched): rank 0 still gets all of its share of epoch 0, then GroupBroken
    at epoch 1 (before, the producer judged by what it had sent: mid-epoch, so rank 0 was cut
    short of its share, and a DDP job lost its last steps of an epoch both ranks began)."""
    samples = 32  # 8 batches an epoch, 4 a rank
    reference = reference_epochs(samples, 1)[0]
    with two_iterating_ranks(name, samples, epochs=2) as (producer, r0, r1, it0, it1):
        assert [ids.tolist() for _, ids in it1] == share_of(reference, 1, 2, "pad")
        wait_until(lambda: producer.status()["published"] >= 10, 10, "batches of epoch 1 sent ahead")
        r1.close()  # at the end of epoch 0, with batches of epoch 1 sent to it, unread
        wait_until(lambda: producer.status()["groups"][0]["state"] == "broken", 5, "the group to break")
        time.sleep(0.3)  # (the news reached r0)
        assert [ids.tolist() for _, ids in it0] == share_of(reference, 0, 2, "pad")
        with pytest.raises(GroupBroken, match="rank 1 of group 'job' .* after the end of epoch 0"):
            next(iter(r0))


class EpochsOf:
    """A loader whose epochs have these numbers of batches (the producer calls set_epoch)."""

    def __init__(self, *lengths: int) -> None:
        self.lengths, self.epoch = lengths, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.full((BATCH,), float(i)) for i in range(self.lengths[self.epoch])])


def test_a_member_told_to_stop_after_an_epoch_raises_before_an_empty_epoch_after_it(name):
    """tail='drop' and an epoch of 1 batch: neither rank gets any of it. Rank 1 leaves at the
    end of epoch 0, after that empty epoch 1 was sent (its end only): rank 0 raises at epoch
    1's first next(), not after an empty epoch its lost peer never ran."""
    with two_iterating_ranks(name, EpochsOf(2, 1, 40), epochs=3, tail="drop") as (producer, r0, r1, it0, it1):
        assert len(list(it1)) == 1
        wait_until(lambda: producer.status()["epoch"] >= 2, 10, "epoch 1 to end")
        r1.close()  # at the end of epoch 0 (its loop took nothing since)
        wait_until(lambda: producer.status()["groups"][0]["state"] == "broken", 5, "the group to break")
        time.sleep(0.3)  # (the news reached r0)
        assert len(list(it0)) == 1
        with pytest.raises(GroupBroken, match="after the end of epoch 0"):
            next(iter(r0))


def test_a_broken_groups_member_keeps_what_it_holds_past_its_timeout(name):
    """After its group broke, a member that still holds a batch keeps heartbeating, so it is
    not evicted and the producer never writes over the batch, while others go on."""
    producer = Producer(make_loader(64), name=name, slots=2, replay=0)
    try:
        with serving(producer, epochs=1) as (thread, errors):
            r0 = Consumer(name=name, group="job", rank=0, world_size=2, timeout=1.0, label="r0")
            r1 = Consumer(name=name, group="job", rank=1, world_size=2, timeout=1.0, label="r1")
            reader = Consumer(name=name, timeout=5.0, label="reader")
            it0, it1 = iter(r0), iter(r1)
            _, held = next(it0)
            expected = held.clone()
            next(it1)
            r1.close()  # mid-epoch: the group breaks
            wait_until(lambda: producer.status()["groups"][0]["state"] == "broken", 5, "the group to break")
            # its message read by r0's I/O thread (at a tick: a batch for r0 was on its way
            # before it, which next() would otherwise read and return itself)
            wait_until(lambda: r0._shared.cut_off is not None, 30, "r0 to read GROUP_BROKEN")
            with pytest.raises(GroupBroken, match="rank 1 of group 'job'"):
                next(it0)
            everything: list[torch.Tensor] = []

            def read() -> None:  # slowly: the stream goes on well past r0's timeout
                for _, ids in reader:
                    everything.append(ids.clone())
                    time.sleep(0.2)

            slow = threading.Thread(target=read)
            slow.start()
            time.sleep(1.5)
            assert "r0" in [c["label"] for c in producer.status()["consumers"]]  # not evicted
            slow.join(timeout=30)
            assert torch.equal(held, expected), "a batch it held was written over"
            assert sum(len(b) for b in everything) == 64
            del held
            r0.close()
            reader.close()
            thread.join(timeout=30)
        assert not errors, errors
    finally:
        producer.close()


def test_many_ranks_on_a_small_window_do_not_wait_for_each_others_releases(name):
    """Each rank holds other places than the others, so one that waits for its next batch must
    have sent what it released: held back (four to a message) while every rank waited, they
    left the producer without a free place until some rank's I/O thread woke for a heartbeat,
    up to a second later (6 ranks on 8 slots: waits of 0.5-0.9 s; without them a few ms)."""
    samples, size = BATCH * 600, 6
    results: dict[int, Any] = {}
    long_waits: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        with Consumer(name=name, group="wide", rank=r, world_size=size, timeout=30) as c:
            seen, waits, it = [], [], iter(c)
            while True:
                started = time.monotonic()
                try:
                    _, ids = next(it)
                except StopIteration:
                    break
                waits.append(time.monotonic() - started)
                seen.append(ids.tolist())
            # (the first waits for every rank to join)
            results[r], long_waits[r] = [seen], [round(w, 3) for w in waits[1:] if w >= 0.4]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    with Producer(make_loader(samples), name=name, slots=8, replay=0, min_consumers=size) as producer:
        producer.serve(epochs=1)
    for t in threads:
        t.join(timeout=30)
    reference = reference_epochs(samples, 1)
    assert [results.get(r) for r in range(size)] == [
        [share_of(reference[0], r, size, "pad")] for r in range(size)
    ]
    # One stall of the loaded machine may make a wait or two long (six ranks, their I/O threads
    # and the producer share one process); the fault made many.
    assert sum(len(w) for w in long_waits.values()) <= 2, f"waits of 0.4 s or more, by rank: {long_waits}"
