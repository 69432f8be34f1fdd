"""tensorsocket.status: a consumer's rates and the bottleneck analysis on crafted records, and
the typed records against what a real producer reports (a renamed key fails here)."""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Producer, gpu_memory
from tensorsocket.cli.query import query_status
from tensorsocket.cli.status import format_status
from tensorsocket.producer.shared import Shared
from tensorsocket.status import (
    RATE_WINDOW,
    ConsumerRates,
    ConsumerStatus,
    ProducerStatus,
    behind,
    bottleneck,
    check,
    rates,
    same_producer,
    slowest,
    time_shares,
)
from tests.support import SPAWN, NestedLoader, serving, unique_name, wait_until


def consumer(label: str, **fields: Any) -> ConsumerStatus:
    base: dict[str, Any] = {
        "label": label, "pid": 7, "device": "cpu", "batch_size": None, "late_join": "replay",
        "joined_s_ago": 75.0, "cursor": 17, "lag": 0, "catching_up": False, "held": 1,
        "received": 16, "skipped": 0, "batches": 16, "samples": 512, "waiting_s": 1.0,
        "samples_per_s": 250.0, "batches_per_s": 7.8, "waiting_share": 0.5, "gpu_mib": None,
        "group": None, "rank": None,
    }  # fmt: skip
    return {**base, **fields}  # type: ignore[typeddict-item]


def producer(**fields: Any) -> ProducerStatus:
    base: dict[str, Any] = {
        "endpoint": "ipc:///x.sock", "pid": 42, "uptime_s": 10.0, "slots": 4, "places": 12,
        "replay_batches": 8, "replay_budget_bytes": 1 << 30, "starts_with": None, "preparing": None, "kept_batches": 8,
        "resident_batches": 12,
        "slot_bytes": 12 << 20, "transport": "shm", "device": "cpu", "gpu_mib": None, "stragglers": "stall",
        "max_lag": None, "epoch": 1, "next_seq": 20, "ended": False, "batches_per_epoch": 16,
        "samples_per_epoch": 512, "published": 18, "loader_wait": 6.0, "slot_wait": 1.0,
        "publish_time": 1.5, "restaged": 3, "bad_messages": 0, "dropped_replies": 0,
        "consumers": [consumer("a", lag=1, held=2), consumer("b", held=0)], "groups": [],
    }  # fmt: skip
    return {**base, **fields}  # type: ignore[typeddict-item]


def keys(record: type) -> set[str]:
    return set(record.__annotations__)


# ---------------------------------------------------------------------------- rates


def test_rates_before_any_report_are_none() -> None:
    assert rates(deque(), now=100.0) == {
        "batches": 0, "samples": 0, "waiting_s": 0.0,
        "samples_per_s": None, "batches_per_s": None, "waiting_share": None,
    }  # fmt: skip


def test_rates_need_reports_spanning_more_than_a_fifth_of_a_second() -> None:
    one = rates([(10.0, 4, 128, 0.5)], now=10.0)
    assert (one["batches"], one["samples"], one["waiting_s"]) == (4, 128, 0.5)
    assert one["samples_per_s"] is None and one["batches_per_s"] is None and one["waiting_share"] is None
    close = rates([(10.0, 4, 128, 0.5), (10.1, 5, 160, 0.5)], now=10.1)
    assert close["samples_per_s"] is None and close["batches"] == 5


def test_rates_over_the_recent_window() -> None:
    stats = [(0.0, 0, 0, 0.0), (10.0, 100, 3200, 2.0), (12.0, 120, 3840, 2.5), (14.0, 140, 4480, 3.0)]
    r = rates(deque(stats), now=14.0)
    # The report at t=0 is older than the window: rates run from t=10 to t=14.
    assert 14.0 - 0.0 > RATE_WINDOW >= 14.0 - 10.0
    assert r == {
        "batches": 140, "samples": 4480, "waiting_s": 3.0,
        "samples_per_s": 320.0, "batches_per_s": 10.0, "waiting_share": 0.25,
    }  # fmt: skip
    assert set(r) == keys(ConsumerRates)
    # Reports gone stale: rates from the last one alone, i.e. none.
    assert rates(stats, now=100.0)["samples_per_s"] is None
    # A waiting share never exceeds 1 (reports' clocks differ slightly).
    assert rates([(0.0, 0, 0, 0.0), (1.0, 1, 1, 1.5)], now=1.0)["waiting_share"] == 1.0


# ---------------------------------------------------------------------------- analysis


def test_time_shares_since_start_and_since_the_previous_snapshot() -> None:
    assert time_shares(producer()) == pytest.approx(
        {"span": 10.0, "loader": 0.6, "slot": 0.1, "write": 0.05, "idle": 0.25}
    )
    later = producer(uptime_s=12.0, published=28, loader_wait=6.2, slot_wait=2.6, publish_time=3.2)
    assert time_shares(later, producer()) == pytest.approx(
        {"span": 2.0, "loader": 0.1, "slot": 0.8, "write": 0.05, "idle": 0.05}
    )
    restarted = producer(pid=43, uptime_s=1.0, loader_wait=0.5, slot_wait=0.0, publish_time=0.0)
    assert time_shares(restarted, producer())["span"] == 1.0  # another producer: since its start
    assert time_shares(producer(uptime_s=0.0))["span"] == 0.0
    # A 2.04 s wait in next(loader) that began before a 2 s refresh ends in it (counted where
    # it ends): the shares are scaled to 100%, not shown as 102% (the CLI helper saw that)
    straddling = producer(uptime_s=12.0, published=19, loader_wait=8.04, slot_wait=1.0, publish_time=1.54)
    shares = time_shares(straddling, producer())
    assert shares["loader"] + shares["slot"] + shares["write"] == pytest.approx(1.0) and shares["idle"] == 0.0
    assert shares["loader"] == pytest.approx(2.04 / 2.08) and shares["write"] == pytest.approx(0.04 / 2.08)


def test_same_producer() -> None:
    first = producer()
    assert same_producer(producer(uptime_s=11.0, published=19), first)
    assert not same_producer(producer(uptime_s=11.0), None)
    assert not same_producer(producer(uptime_s=11.0, pid=43), first)
    assert not same_producer(producer(uptime_s=9.0), first)  # time went backwards: not the same run
    assert not same_producer(producer(uptime_s=11.0, published=3), first)


def test_slowest_is_furthest_behind_then_busiest_then_slowest_rate() -> None:
    assert behind(consumer("x", lag=3, held=2)) == 5
    assert slowest(producer(consumers=[])) is None
    far = [consumer("near", lag=0, held=1), consumer("far", lag=2, held=1)]
    assert slowest(producer(consumers=far))["label"] == "far"  # type: ignore[index]
    tied = [consumer("idle", waiting_share=0.9), consumer("busy", waiting_share=0.1)]
    assert slowest(producer(consumers=tied))["label"] == "busy"  # type: ignore[index]
    rated = [consumer("fast", samples_per_s=500.0), consumer("slow", samples_per_s=100.0)]
    assert slowest(producer(consumers=rated))["label"] == "slow"  # type: ignore[index]
    # One that has not reported yet (no share, no rate) is not blamed on a tie.
    fresh = [consumer("new", samples_per_s=None, batches_per_s=None, waiting_share=None), consumer("old")]
    assert slowest(producer(consumers=fresh))["label"] == "old"  # type: ignore[index]


def test_bottleneck() -> None:
    assert bottleneck(producer()) == "the loader"
    assert (
        bottleneck(producer(loader_wait=0.5, slot_wait=8.0, publish_time=8.5)) == "the slowest consumer (a)"
    )
    assert bottleneck(producer(loader_wait=0.1, slot_wait=0.1, publish_time=5.0)) == (
        "the producer itself (writing batches into shared memory)"
    )
    assert bottleneck(producer(ended=True)) == "none: the stream has ended"
    assert bottleneck(producer(published=0)).startswith("none yet: nothing published")
    assert bottleneck(producer(published=0, starts_with=3)) == (
        "none yet: the stream starts once 3 consumer(s) joined (min_consumers, or after a restart its "
        "predecessor's consumers that rejoin; a group counts once all its ranks joined), 2 connected"
    )
    assert bottleneck(producer(consumers=[])).startswith("none: no consumer is connected")
    # Nothing published since the previous look: a wait in progress.
    stuck = producer(uptime_s=13.0)
    assert bottleneck(stuck, producer()) == "the loader: no batch published for 3.0 s"
    full = producer(uptime_s=13.0, consumers=[consumer("a", lag=1, held=3), consumer("b")])
    assert (
        bottleneck(full, producer())
        == "the slowest consumer (a): no batch published for 3.0 s, the window is full"
    )
    replaying = producer(uptime_s=13.0, consumers=[consumer("j", catching_up=True, held=2)])
    assert bottleneck(replaying, producer()).endswith("the window is full")
    # The previous snapshot of another producer is ignored: shares since start.
    assert bottleneck(producer(pid=43, uptime_s=13.0), producer()) == "the loader"


def test_a_wait_for_a_free_slot_counts_while_it_lasts() -> None:
    """A consumer that holds every slot and takes no more: the producer's wait for a place is
    in slot_wait while it lasts, so one snapshot names that consumer, not the loader (the wait
    was counted only once it ended: a stall looked idle, and the loader was blamed)."""
    name = unique_name("status")
    producer = Producer(NestedLoader(8), name=name, slots=2, replay=0)
    with serving(producer, 1), Consumer(name=name, timeout=10, label="holder") as consumer:
        it = iter(consumer)
        held = [next(it), next(it)]  # both slots: the producer waits for one
        wait_until(lambda: producer.status()["slot_wait"] > 0.5, 10, "the wait to count", interval=0.05)
        status = producer.status()
        assert status["published"] == 2 and status["publish_time"] >= status["slot_wait"]
        assert bottleneck(status) == "the slowest consumer (holder)"
        del held
        assert sum(1 for _ in it) == 6


def test_a_wait_for_a_place_ending_while_the_status_is_taken_is_no_error(monkeypatch) -> None:
    """The publishing thread clears ``place_wait_since`` without the lock when its wait for a
    place ends, which may fall between status()'s test of it and its use: status() read it
    twice, and the TypeError (a float minus None) killed the producer's I/O thread answering
    a STATUS (`tensorsocket status`), ending the stream."""
    name = unique_name("status")
    producer = Producer(NestedLoader(2), name=name, slots=2, replay=0)
    try:
        reads = []

        def ending(shared: Any) -> float | None:
            reads.append(shared)
            return 1.0 if len(reads) == 1 else None  # waiting at the first read, over at the next

        monkeypatch.setattr(
            Shared, "place_wait_since", property(ending, lambda shared, value: None), raising=False
        )
        status = producer.status()
        assert status["slot_wait"] > 0
    finally:
        monkeypatch.undo()
        producer.close()


def test_a_sweeps_trial_is_known_by_its_name(name, monkeypatch):
    """`tensorsocket sweep` sets TENSORSOCKET_TRIAL: without a label, that is the consumer's
    (status and the producer's log showed "pid N" for every trial); a label given wins.

    More batches than slots: a stream that fits the slots can end before status() is asked,
    and a consumer whose I/O thread has read the end leaves the producer at once (35 of ~1,900
    runs under load, before)."""
    producer = Producer(NestedLoader(8), name=name, slots=4, replay=0, min_consumers=2)
    monkeypatch.setenv("TENSORSOCKET_TRIAL", "lr-0.1")
    with serving(producer, 1), Consumer(name=name, timeout=10) as trial:
        with Consumer(name=name, timeout=10, label="mine") as labelled:
            labels = sorted(c["label"] for c in producer.status()["consumers"])
            assert trial.label == "lr-0.1" and labels == ["lr-0.1", "mine"]
            assert sum(1 for _ in zip(trial, labelled, strict=True)) == 8


def test_check_names_missing_keys() -> None:
    assert check(producer()) == producer()
    partial: dict[str, Any] = dict(producer())
    del partial["slot_wait"]
    partial["consumers"] = [{k: v for k, v in consumer("a").items() if k != "lag"}]
    with pytest.raises(ValueError, match=r"lacks consumers\[\]\.lag, slot_wait"):
        check(partial)
    with pytest.raises(ValueError, match="no list of consumers"):
        check({"pid": 1})


# ---------------------------------------------------------------------------- the real thing


def test_records_declare_exactly_the_keys_a_producer_reports() -> None:
    name = unique_name("status")
    batches = [torch.full((4, 2), float(i)) for i in range(3)]
    with Producer(batches, name=name, slots=2, replay=0, linger=5.0) as p:
        alone = p.status()
        assert set(alone) == keys(ProducerStatus) and alone["consumers"] == []
        c = Consumer(name=name, timeout=10.0, label="keys")
        try:
            status = p.status()
            assert set(status) == keys(ProducerStatus)
            (record,) = status["consumers"]
            assert record["label"] == "keys"
            assert set(record) == keys(ConsumerStatus)
            assert keys(ConsumerRates) <= keys(ConsumerStatus)
            # The same dict over the socket, as `tensorsocket status` reads it.
            remote = query_status(p.endpoint, timeout=5.0)
            assert set(remote) == keys(ProducerStatus)
            assert set(remote["consumers"][0]) == keys(ConsumerStatus)
            # Host shared memory: no GPU memory to report.
            assert status["transport"] == "shm" and status["gpu_mib"] is None and record["gpu_mib"] is None
            assert remote["gpu_mib"] is None and remote["consumers"][0]["gpu_mib"] is None
        finally:
            c.close()


# ---------------------------------------------------------------------------- GPU memory


def test_gpu_memory_is_none_on_the_cpu_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """device="cuda:0" over the CPU stand-in: the cuda transport, but its GPUs are not real,
    so the producer and its consumer report no GPU memory (and status() does not fail)."""
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    name = unique_name("status-gpu")
    with Producer(NestedLoader(3), name=name, device="cuda:0", slots=2, replay=0, linger=5.0) as p:
        assert p.status()["gpu_mib"] is None
        with Consumer(name=name, device="cuda:0", timeout=10.0, label="fake") as c:
            with serving(p, epochs=1) as (_, errors):
                batches = iter(c)
                # Held, with the other batch published: the last one waits for a place, so the
                # stream cannot end (and the consumer leave at its end) before status() is read.
                first = next(batches)
                status = p.status()
                assert status["transport"] == "cuda" and status["device"] == "cuda:0"
                assert status["gpu_mib"] is None
                (record,) = status["consumers"]
                assert set(record) == keys(ConsumerStatus) and record["gpu_mib"] is None
                assert "GPU memory of the producer" not in format_status(status, gpu=([], {}))
                del first
                assert sum(1 for _ in batches) == 2
            assert errors == []


def test_gpu_memory_unknown_gpu_and_failing_nvml_give_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """process_mib never raises: no GPU, a GPU NVML does not know (the stand-in's UUID), and
    nvidia-ml-py missing all give None, and a failed NVML start is not retried per call."""
    assert gpu_memory.process_mib(None) is None
    assert gpu_memory.process_mib("GPU-00000000-0000-4000-8000-000000000000") is None  # the stand-in's
    # Start over in a process state where nvidia-ml-py cannot be imported (restored after).
    monkeypatch.setattr(gpu_memory, "_pid", None)
    monkeypatch.setattr(gpu_memory, "_nvml", None)
    monkeypatch.setattr(gpu_memory, "_failed", False)
    monkeypatch.setattr(gpu_memory, "_handles", {})
    monkeypatch.setattr(gpu_memory, "_recent", {})
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_memory.process_mib("GPU-00000000-0000-4000-8000-000000000000") is None
    assert gpu_memory._failed and gpu_memory._pid == os.getpid()
    monkeypatch.delitem(sys.modules, "pynvml")  # importable again, if installed: not tried
    assert gpu_memory.process_mib("GPU-00000000-0000-4000-8000-000000000000") is None
    assert gpu_memory._nvml is None


def _gpu_consumer(name: str, ready: Any, done: Any) -> None:
    """Take one batch on cuda:0, signal ``ready``, hold it until ``done``."""
    consumer = Consumer(name=name, device="cuda:0", timeout=60.0, label="gpu")
    try:
        batch = next(iter(consumer))
        ready.set()
        done.wait(120)
        del batch
    finally:
        consumer.close()


@pytest.mark.gpu
def test_gpu_memory_per_process_on_a_real_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producer(device="cuda:0") and one GPU consumer process: NVML gives the producer's GPU
    memory (its arenas and context) and the consumer's, by pid, in status() and over the socket."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py")
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    name = unique_name("status-gpu")
    ready, done = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=_gpu_consumer, args=(name, ready, done))
    with Producer(NestedLoader(6), name=name, device="cuda:0", slots=2, replay=0, linger=5.0) as p:
        child.start()
        try:
            with serving(p, epochs=1):
                assert ready.wait(120), "the GPU consumer got no batch"

                def reported() -> ProducerStatus | None:
                    status = p.status()
                    consumers = status["consumers"]
                    found = (
                        status["gpu_mib"] is not None and consumers and consumers[0]["gpu_mib"] is not None
                    )
                    return status if found else None

                status = wait_until(reported, 30, lambda: f"GPU memory in {p.status()}")
                assert status["transport"] == "cuda"
                assert status["gpu_mib"] is not None and status["gpu_mib"] > 0
                (record,) = status["consumers"]
                assert record["pid"] == child.pid and isinstance(record["gpu_mib"], float)
                assert "GPU memory of the producer on cuda:0" in format_status(status, gpu=([], {}))
                assert query_status(p.endpoint, timeout=5.0)["consumers"][0]["gpu_mib"] is not None
                done.set()  # the consumer leaves before the producer closes
                child.join(60)
        finally:
            done.set()
            child.join(60)
            if child.is_alive():
                child.kill()
