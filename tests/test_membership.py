"""Heterogeneous consumers with real sockets and shared memory: late joiners under each
policy, stragglers under stall and skip, per-consumer batch sizes, consumers that never
iterate, and churn (100 joins and leaves) that leaves nothing behind."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tensorsocket import Consumer, Producer
from tensorsocket.errors import Evicted
from tests.support import (
    SPAWN,
    HeldFirstEpoch,
    NestedLoader,
    join_or_fail,
    serving,
    shm_segments,
    start_consumers,
    wait_until,
)

# ---------------------------------------------------------------------------- helpers


def numbered(batches: int, rows: int = 4) -> list[torch.Tensor]:
    """Batch i is a tensor full of i: what a consumer saw tells which batch it was."""
    return [torch.full((rows, 3), i, dtype=torch.int64) for i in range(batches)]


def paced(batches: int, delay: float) -> Any:
    """A loader (a generator function) yielding ``numbered`` batches at most every ``delay`` s."""

    def epoch() -> Any:
        for batch in numbered(batches):
            time.sleep(delay)
            yield batch

    return epoch


class Reader(threading.Thread):
    """A consumer in a thread: reads epochs (until the stream ends, ``epochs`` epochs, or
    ``stop`` is set at an epoch boundary), recording the batch numbers of each epoch."""

    def __init__(
        self,
        name: str,
        *,
        step: float = 0.0,
        epochs: int | None = None,
        stop: threading.Event | None = None,
        **options: Any,
    ) -> None:
        super().__init__(name=f"reader-{options.get('label', '')}", daemon=True)
        self.consumer = Consumer(name=name, **options)
        self.step, self.epochs, self.stop = step, epochs, stop
        self.epochs_seen: list[list[int]] = []
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            while not self.consumer.finished and (self.epochs is None or len(self.epochs_seen) < self.epochs):
                if self.stop is not None and self.stop.is_set():
                    break
                seen = []
                for batch in self.consumer:
                    seen.append(int(batch[0, 0]))
                    assert bool((batch == batch[0, 0]).all()), "a batch mixes two batches' data"
                    del batch
                    if self.step:
                        time.sleep(self.step)
                if seen or not self.consumer.finished:
                    self.epochs_seen.append(seen)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - t0
            self.consumer.close()


# ---------------------------------------------------------------------------- late joiners


def finish(consumers: list[Any], server: threading.Thread, errors: list[BaseException]) -> None:
    """Join the consumer processes and the serving thread; the producer raised nothing."""
    for p in consumers:
        p.join(timeout=10)
    join_or_fail(server)
    assert errors == []


def assert_whole_epochs(reports: list[dict[str, Any]], epochs: int, batches: int) -> None:
    """Every ``run_consumer`` report: every batch of every epoch once, bit for bit, then END."""
    for report in reports:
        assert report["error"] is None, report["error"]
        assert report["bad"] == []
        assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]
        assert report["finished"] and report["after_end"] == 0


def test_joiner_inside_the_replay_window_sees_the_whole_epoch_in_its_own_process(name):
    """Leader and joiner are real processes that check every batch bit for bit by index."""
    batches, epochs = 12, 2
    loader = HeldFirstEpoch(NestedLoader(batches, delay=0.1), at=6)
    producer = Producer(loader, name=name, slots=2)
    go = SPAWN.Event()
    joiners, joined = start_consumers(name, 1, epochs, batches, go=go)  # started, not yet joined
    with serving(producer, epochs) as (server, errors):
        leaders, results = start_consumers(name, 1, epochs, batches)
        wait_until(lambda: producer.status()["next_seq"] >= 4, 30, "the leader to be mid-epoch")
        go.set()
        wait_until(lambda: len(producer.status()["consumers"]) == 2, 30, "the joiner")
        assert producer.status()["epoch"] == 0, "the epoch ended before the joiner could join"
        loader.go_once_joined(producer)
        # Batches 0-1 left the two places before it joined: kept, they are written there again.
        wait_until(lambda: producer.status()["restaged"] >= 2, 30, "the joiner's first batches re-staged")
        status = producer.status()
        assert status["places"] == 2 and status["kept_batches"] >= 4, status  # no place but the window's
        reports = [results.get(timeout=60), joined.get(timeout=60)]
        finish(leaders + joiners, server, errors)
    assert_whole_epochs(reports, epochs, batches)


def test_a_joiner_and_a_leader_each_holding_their_last_batch_do_not_wait_for_ever(name, caplog):
    """slots=2: the leader's loop holds batch N-1 while it waits for N, which waits for the
    joiner; the joiner's holds the batch it last got while it waits for the next, kept and in
    no place. With both places held nothing ever moved again (every consumer waited, heartbeats
    kept them all connected): the producer now adds a place once the joiner has waited a while."""
    batches, epochs = 12, 2
    loader = HeldFirstEpoch(NestedLoader(batches, delay=0.05), at=6)
    producer = Producer(loader, name=name, slots=2)
    go = SPAWN.Event()
    joiners, joined = start_consumers(name, 1, epochs, batches, go=go, hold=1)
    with caplog.at_level(logging.INFO, logger="tensorsocket"), serving(producer, epochs) as (server, errors):
        leaders, results = start_consumers(name, 1, epochs, batches, hold=1)
        wait_until(lambda: producer.status()["next_seq"] >= 5, 30, "batches 0-2 to leave their places")
        go.set()
        loader.go_once_joined(producer)
        reports = [results.get(timeout=60), joined.get(timeout=60)]
        finish(leaders + joiners, server, errors)
    assert_whole_epochs(reports, epochs, batches)
    assert "every place was held" in caplog.text and "one place more, 3 now" in caplog.text


class ReusedBuffers:
    """A loader that writes its batches into the same ``ring`` tensors in turn (as some
    hand-written loaders do): a kept batch changes after it was published. (768 KiB each: a
    smaller batch is kept as a copy from the start.)"""

    def __init__(self, batches: int, ring: int = 1, columns: int = 24576) -> None:
        self.buffers = [torch.zeros(4, columns, dtype=torch.int64) for _ in range(ring)]
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        for i in range(self.batches):
            buffer = self.buffers[i % len(self.buffers)]
            buffer.fill_(i)
            time.sleep(0.05)
            yield buffer


def _leader_then_joiner(name: str, loader: Any, epochs: int) -> tuple[Reader, Reader, list[BaseException]]:
    """A leader from the start, a joiner once batches 0-2 left their two places (the loader
    held until it joined, inside the first epoch)."""
    held = HeldFirstEpoch(loader, at=6)
    producer = Producer(held, name=name, slots=2)
    with serving(producer, epochs) as (server, errors):
        leader = Reader(name, label="leader")
        leader.start()
        wait_until(lambda: producer.status()["next_seq"] >= 5, 30, "batches 0-2 to leave their places")
        joiner = Reader(name, label="joiner")
        joiner.start()
        held.go_once_joined(producer)
        join_or_fail(leader)
        join_or_fail(joiner)
        join_or_fail(server)
    return leader, joiner, errors


def test_a_loader_that_reuses_its_buffer_is_replayed_exactly_from_copies(name, caplog):
    """The newest kept batch is checked when the next is pulled: changed, it is copied back out
    of its place, and every later batch is kept as a copy."""
    batches, epochs = 20, 2
    with caplog.at_level(logging.WARNING, logger="tensorsocket"):
        leader, joiner, errors = _leader_then_joiner(name, ReusedBuffers(batches), epochs)
    assert errors == [] and leader.error is None and joiner.error is None
    full = list(range(batches))
    assert leader.epochs_seen == [full] * epochs
    assert joiner.epochs_seen == [full] * epochs  # epoch 0 replayed, each batch as it was published
    assert "batch 0 of epoch 0 changed after it was published" in caplog.text


def test_a_kept_batch_that_changed_unnoticed_is_not_sent_its_joiner_is_evicted_saying_why(name):
    """Two buffers in turn: each batch changes two batches later, after the check. The
    joiner's replay finds it at re-stage: the joiner is evicted with why, never sent other
    bytes under that batch's number, and the others go on."""
    leader, joiner, errors = _leader_then_joiner(name, ReusedBuffers(20, ring=2), 1)
    assert joiner.epochs_seen == []  # (a batch with other bytes would fail Reader's check, too)
    assert isinstance(joiner.error, Evicted) and "changed after it was published" in str(joiner.error)
    assert errors == [] and leader.error is None and leader.epochs_seen == [list(range(20))]


def test_small_batches_are_kept_as_copies_so_a_reused_buffer_does_not_matter(name, caplog):
    """96-byte batches: each is kept as a copy of its place at once, so even two buffers in
    turn (which a kept batch by reference would not survive, see above) replay exactly."""
    with caplog.at_level(logging.WARNING, logger="tensorsocket"):
        loader = ReusedBuffers(20, ring=2, columns=3)
        leader, joiner, errors = _leader_then_joiner(name, loader, 1)
    assert errors == [] and leader.error is None and joiner.error is None
    assert leader.epochs_seen == joiner.epochs_seen == [list(range(20))]
    assert "changed after it was published" not in caplog.text


@pytest.mark.parametrize("policy", ["replay", "next_epoch", "now"])
def test_joiner_outside_the_replay_window_follows_its_policy(name, policy, caplog):
    batches, epochs = 10, 3
    loader = HeldFirstEpoch(numbered(batches), at=6)  # (until the joiner joined: mid-epoch 0)
    producer = Producer(loader, name=name, slots=2, replay=0)  # keeps only 2 batches
    with serving(producer, epochs) as (server, errors):
        leader = Reader(name, step=0.03, label="leader")
        leader.start()
        wait_until(lambda: producer.status()["next_seq"] >= 5, 30, "batch 0 to be overwritten")
        joiner = Reader(name, late_join=policy, label="joiner")
        joiner.start()
        loader.go_once_joined(producer)
        join_or_fail(leader)
        join_or_fail(joiner)
        join_or_fail(server)
    assert errors == [] and leader.error is None and joiner.error is None
    full = list(range(batches))
    assert leader.epochs_seen == [full] * epochs  # never a batch twice or out of order
    if policy == "now":
        first, *rest = joiner.epochs_seen
        assert 0 < first[0] and first == list(range(first[0], batches)), first
        assert rest == [full] * (epochs - 1)
        assert "this first epoch is partial" in caplog.text
    else:  # the epoch's start is gone: both wait for the next epoch
        assert joiner.epochs_seen == [full] * (epochs - 1)


def test_grace_period_starts_without_the_expected_count(name):
    producer = Producer(numbered(3), name=name, min_consumers=3, grace=0.5)
    with serving(producer, 1) as (server, errors):
        t0 = time.monotonic()
        reader = Reader(name)
        reader.start()
        join_or_fail(reader)
        waited = time.monotonic() - t0
        join_or_fail(server)
    assert errors == [] and reader.error is None
    assert reader.epochs_seen == [[0, 1, 2]]
    assert 0.4 < waited < 10, waited


# ---------------------------------------------------------------------------- stragglers


def test_skip_keeps_the_fast_consumer_going_and_counts_what_the_slow_one_missed(name):
    batches, epochs, slow_step = 40, 2, 0.1  # the loader: 10 ms per batch
    producer = Producer(paced(batches, 0.01), name=name, slots=8, replay=0, stragglers="skip", max_lag=4)
    with serving(producer, epochs) as (server, errors):
        fast = Reader(name, label="fast", prefetch=2)
        slow = Reader(name, step=slow_step, label="slow", prefetch=1)
        fast.start()
        slow.start()

        def skipped_by_slow() -> list[int]:  # (while it is there: it leaves once it read the end)
            return [
                c["skipped"] for c in producer.status()["consumers"] if c["label"] == "slow" and c["skipped"]
            ]

        producer_status_skipped = wait_until(
            skipped_by_slow, 30, "the producer to skip batches for the slow one"
        )
        join_or_fail(fast)
        join_or_fail(slow)
        join_or_fail(server)
    assert errors == [] and fast.error is None and slow.error is None
    assert fast.epochs_seen == [list(range(batches))] * epochs
    # The slow one ran at its own pace; what it saw is in order, each once, and what it did not
    # see is exactly what it was told it skipped.
    seen = [i for epoch in slow.epochs_seen for i in epoch]
    assert len(slow.epochs_seen) == epochs
    for epoch in slow.epochs_seen:
        assert epoch == sorted(set(epoch)), epoch
    skipped = slow.consumer.skipped
    assert skipped > 0 and len(seen) + skipped == batches * epochs, (len(seen), skipped)
    assert producer_status_skipped and 0 < producer_status_skipped[0] <= skipped
    # Under stall the fast one would have waited for the slow one's steps.
    assert fast.elapsed < 0.5 * slow_step * batches * epochs, fast.elapsed


@pytest.mark.parametrize("stragglers", ["stall", "skip"])
def test_a_consumer_that_never_iterates(name, stragglers):
    """stall: it is not evicted (its heartbeats come from a thread), so the others wait for it,
    and go on at once when it closes. skip: the others never wait; it is moved ahead."""
    batches = 20
    producer = Producer(paced(batches, 0.01), name=name, slots=4, replay=0, stragglers=stragglers)
    with serving(producer, 1) as (server, errors):
        idle = Consumer(name=name, timeout=0.5, label="idle")
        reader = Reader(name, label="reader")
        reader.start()
        if stragglers == "stall":
            time.sleep(1.5)  # three times idle's timeout
            status = producer.status()
            assert [c["label"] for c in status["consumers"]] == ["idle", "reader"]  # not evicted
            assert status["published"] <= 8, status["published"]  # the others wait for it
            assert reader.is_alive()
            idle.close()
        join_or_fail(reader)
        if stragglers == "skip":
            assert [c["skipped"] for c in producer.status()["consumers"] if c["label"] == "idle"][0] > 0
            idle.close()
        join_or_fail(server)
    assert errors == [] and reader.error is None
    assert reader.epochs_seen == [list(range(batches))]


def test_a_long_training_step_never_gets_a_consumer_evicted(name):
    producer = Producer(numbered(3), name=name, slots=1, replay=0)
    with serving(producer, 1) as (server, errors):
        reader = Reader(name, step=1.5, timeout=1.0)  # each step longer than its silence timeout
        reader.start()
        join_or_fail(reader)
        join_or_fail(server)
    assert errors == [] and reader.error is None
    assert reader.epochs_seen == [[0, 1, 2]]


# ---------------------------------------------------------------------------- batch sizes


SIZES = [16, 48, 64, 96, 100, 128]


def read_rebatched(consumer: Consumer, epochs: int, out: dict[str, Any]) -> None:
    try:
        out["len"] = len(consumer)
        out["epochs"] = []
        for _ in range(epochs):
            sizes, ids, feats = [], [], []
            for sample_ids, features in consumer:
                sizes.append(len(sample_ids))
                ids.append(sample_ids.clone())
                feats.append(features.clone())
            out["epochs"].append((sizes, torch.cat(ids), torch.cat(feats)))
    except BaseException as exc:
        out["error"] = exc
    finally:
        consumer.close()


def test_every_batch_size_gets_every_sample_once_per_epoch_bit_exact(name):
    samples, epochs = 64 * 5 + 17, 2  # the producer's last batch is ragged
    ids = torch.arange(samples)
    features = torch.randn(samples, 3, 2, generator=torch.Generator().manual_seed(0))
    features[5, 0, 0] = float("nan")
    loader = DataLoader(TensorDataset(ids, features), batch_size=64, shuffle=False)
    combos = [(b, drop) for b in SIZES for drop in (False, True)]
    producer = Producer(loader, name=name, slots=4, min_consumers=len(combos))
    outs: dict[tuple[int, bool], dict[str, Any]] = {}
    with serving(producer, epochs) as (server, errors):
        threads = []
        for b, drop in combos:
            outs[b, drop] = {}
            consumer = Consumer(name=name, batch_size=b, drop_last=drop, label=f"b{b}{'d' if drop else ''}")
            threads.append(threading.Thread(target=read_rebatched, args=(consumer, epochs, outs[b, drop])))
        for t in threads:
            t.start()
        for t in threads:
            join_or_fail(t, 60)
        join_or_fail(server)
    assert errors == []
    for (b, drop), out in outs.items():
        assert "error" not in out, (b, drop, out.get("error"))
        n = samples // b * b if drop else samples
        expected_sizes = [b] * (samples // b) + ([] if drop or samples % b == 0 else [samples % b])
        assert out["len"] == len(expected_sizes), (b, drop)
        assert len(out["epochs"]) == epochs
        for sizes, got_ids, got_features in out["epochs"]:
            assert sizes == expected_sizes, (b, drop, sizes)
            assert torch.equal(got_ids, ids[:n]), (b, drop)
            assert torch.equal(got_features.view(torch.int32), features[:n].view(torch.int32)), (b, drop)


def test_a_recut_at_prefetch_2_holds_the_last_epochs_tail_into_the_next(name):
    """README: prefetch counts the batch the loop variable still holds, 2 or more will do. A
    re-cut (7 from 4) held the loop variable's tail of the last epoch (views of one producer
    batch) and the new epoch's first samples (views of another) while it waited for the next
    producer batch: all that prefetch=2 allows, and the second epoch raised Hoarding."""
    epochs, samples = 2, 100
    producer = Producer([(torch.arange(i, i + 4),) for i in range(0, samples, 4)], name=name, replay=0)
    with serving(producer, epochs) as (server, errors):
        with Consumer(name=name, batch_size=7, prefetch=2, timeout=10) as consumer:
            for _ in range(epochs):
                seen = []
                for (ids,) in consumer:  # ids stays bound past the loop, as in any for loop
                    seen.extend(ids.tolist())
                assert seen == list(range(samples))
        join_or_fail(server)
    assert errors == []


# ---------------------------------------------------------------------------- churn


def churn(name: str, joins: int, done: Any) -> None:
    """Driver process: fork ``joins`` short-lived consumers one after another. Each takes a
    few batches and then closes, or SIGKILLs itself while holding them. Forking from a process
    that has imported torch and tensorsocket makes each one cost milliseconds, not seconds."""
    from tensorsocket import Consumer

    policies = ["replay", "next_epoch", "now"]
    outcomes = {"closed": 0, "killed": 0, "failed": 0}
    for i in range(joins):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                consumer = Consumer(name=name, timeout=5, late_join=policies[i % 3], label=f"churn-{i}")
                held: list[Any] = []
                want = 0 if policies[i % 3] == "replay" else i % 3  # a replaying joiner holds the others up
                while len(held) < want:  # a partial first epoch ('now') may end before that
                    for batch in consumer:
                        held.append(batch)
                        if len(held) == want:
                            break
                if i % 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                consumer.close()
            except BaseException:
                import traceback

                traceback.print_exc()  # in the test's captured stderr
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            outcomes["killed"] += 1
        elif os.WEXITSTATUS(status) == 0:
            outcomes["closed"] += 1
        else:
            outcomes["failed"] += 1
    done.put(outcomes)


def open_fds() -> dict[int, str]:
    """This process's open fds and what they point at, but for files under /proc: the I/O
    thread's liveness check reads /proc/<pid>/stat for an instant, which is no leak."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd listdir itself used
        if not target.startswith("/proc/"):
            out[int(fd)] = target
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_churn_of_a_hundred_joins_and_leaves_leaves_nothing_behind(name):
    batches = 10
    producer = Producer(numbered(batches, rows=256), name=name, slots=3)
    stop = threading.Event()
    with serving(producer, None) as (server, errors):
        survivors = [Reader(name, step=0.002, stop=stop, label=f"survivor-{i}") for i in range(2)]
        for r in survivors:
            r.start()
        # Warm up: every place has been written (the replay buffer is full) before the baseline.
        wait_until(lambda: producer.status()["next_seq"] > 3 * (batches + 1), 30, "warm-up")
        wait_until(lambda: producer.status()["resident_batches"] == producer.status()["places"], 30, "places")
        done = SPAWN.Queue()  # (its pipe exists before the baseline)
        before = producer.status()
        segments = len(shm_segments(os.getpid()))
        fds = open_fds()
        rss = rss_bytes()

        driver = SPAWN.Process(target=churn, args=(name, 100, done))
        driver.start()
        outcomes = done.get(timeout=240)
        driver.join(timeout=30)
        assert driver.exitcode == 0 and outcomes["failed"] == 0, outcomes
        driver.close()
        assert outcomes["killed"] == 50 and outcomes["closed"] == 50

        wait_until(lambda: len(producer.status()["consumers"]) == 2, 30, "the churners to be gone")
        progress = producer.status()["published"]
        wait_until(lambda: producer.status()["published"] > progress + batches, 30, "progress after churn")
        after = producer.status()
        deadline = time.monotonic() + 5  # zmq closes connections in its own thread
        while len(open_fds()) > len(fds) and time.monotonic() < deadline:
            time.sleep(0.05)
        fds_after = open_fds()
        rss_after = rss_bytes()
        stop.set()
        for r in survivors:
            join_or_fail(r, 60)
    assert errors == []
    assert after["places"] == before["places"] and after["slot_bytes"] == before["slot_bytes"]
    assert len(shm_segments(os.getpid())) == 0  # unlinked at close
    assert segments == before["places"]
    new = {fd: target for fd, target in fds_after.items() if fds.get(fd) != target}
    assert len(fds_after) <= len(fds), ("fds left open", new)
    assert rss_after - rss < 32 << 20, f"RSS grew by {(rss_after - rss) / 2**20:.1f} MiB"
    logging.getLogger("tensorsocket").info(
        "churn: RSS %+d KiB, fds %d -> %d", (rss_after - rss) >> 10, len(fds), len(fds_after)
    )
    for r in survivors:
        assert r.error is None, r.error
        assert r.epochs_seen and all(epoch == list(range(batches)) for epoch in r.epochs_seen), r.epochs_seen
