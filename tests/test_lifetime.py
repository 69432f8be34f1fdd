"""A batch lives as long as any view of it; in-place writes fault in the writer (or, with
check_writes=True, are caught); hoarding is an error."""

from __future__ import annotations

import gc
import io
import logging
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from tensorsocket import BatchModified, Closed, Consumer, Producer, TensorSocketError
from tests.support import SPAWN, NestedLoader, expected_batch, same, start_consumers, wait_until


def serving(producer: Producer, epochs: int = 1) -> threading.Thread:
    thread = threading.Thread(target=producer.serve, kwargs={"epochs": epochs}, daemon=True)
    thread.start()
    return thread


def test_slot_is_released_when_the_last_derived_view_dies(name):
    producer = Producer(NestedLoader(4), name=name, slots=1, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name) as consumer:
            it = iter(consumer)
            batch = next(it)
            row = batch[0][1]  # a view derived from the batch
            del batch
            gc.collect()
            time.sleep(0.3)
            # With one slot, batch 1 cannot be written while a view of batch 0 lives.
            assert producer.status()["published"] == 1
            assert same(row, expected_batch(0, 4)[0][1])
            del row
            wait_until(lambda: producer.status()["published"] == 2, 10, "batch 2 to be published")
            rest = []
            for b in it:  # one slot: the previous batch must be gone before the next
                rest.append(b[1]["meta"][2])
                del b
            assert rest == [1, 2, 3]
    finally:
        producer.close()
        server.join(timeout=10)


WRITER = """\
import sys
from tensorsocket import Consumer
with Consumer(name=sys.argv[1], label="writer") as consumer:
    for index, batch in enumerate(consumer):
        if index == 2:
            batch[0].sub_(0.5)  # the mistake: normalising a shared batch in place
        del batch
"""


def test_an_in_place_write_faults_in_the_writer_at_its_line_and_the_others_never_see_it(
    name, tmp_path, caplog
):
    batches = 8
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    writer = subprocess.Popen([sys.executable, str(script), name], stderr=subprocess.PIPE, text=True)
    others, results = start_consumers(name, 2, 1, batches)
    with caplog.at_level(logging.INFO, logger="tensorsocket"):
        Producer(NestedLoader(batches), name=name, slots=3, replay=0, min_consumers=3).serve(epochs=1)
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == -signal.SIGSEGV, err[-3000:]
    assert "Segmentation fault" in err and f'File "{script}", line 6' in err, err[-3000:]
    for report in [results.get(timeout=60) for _ in others]:
        assert report["error"] is None and report["bad"] == [], report  # nothing changed, nothing said
        assert report["seen"] == [(0, i) for i in range(batches)]
    for p in others:
        p.join(timeout=30)
    assert "'writer'" in caplog.text and "died; evicted" in caplog.text


def test_with_check_writes_an_in_place_write_raises_batch_modified_and_is_logged(name, caplog):
    producer = Producer(NestedLoader(8), name=name, slots=2, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, label="sloppy-trainer", check_writes=True) as consumer:
            it = iter(consumer)
            batch = next(it)
            batch[0].sub_(0.5)  # the mistake: normalising a shared batch in place
            del batch
            with pytest.raises(BatchModified, match="sloppy-trainer.*copy=True"):
                for _ in it:
                    pass
    finally:
        producer.close()
        server.join(timeout=10)
    wait_until(
        lambda: "sloppy-trainer" in caplog.text and "changed in shared memory" in caplog.text,
        2,
        "the producer's log line naming the trainer that wrote in place",
    )


def test_batch_modified_names_the_first_batch_changed_not_the_last(name):
    producer = Producer(NestedLoader(8), name=name, slots=4, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, label="sloppy-trainer", check_writes=True) as consumer:
            it = iter(consumer)
            first, second = next(it), next(it)
            first[0].sub_(0.5)
            second[0].sub_(0.5)
            del first, second  # both released together: both found changed before the next check
            time.sleep(0.3)
            with pytest.raises(BatchModified, match=r"^batch 0 of epoch 0 .*\(1 more changed since"):
                for _ in it:
                    pass
    finally:
        producer.close()
        server.join(timeout=10)


def test_copy_true_gives_private_batches_and_no_error(name):
    producer = Producer(NestedLoader(5), name=name, slots=2, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, copy=True) as consumer:
            assert consumer.delivery == "copy"  # (it said "views", the reader's way, before)
            seen = 0
            for i, batch in enumerate(consumer):
                expected = expected_batch(i, 5)
                assert same(batch, expected)
                batch[0].mul_(2)  # private: allowed
                seen += 1
            assert seen == 5
    finally:
        producer.close()
        server.join(timeout=10)


def test_copy_true_copies_numpy_leaves_too(name):
    """copy=True copied the tensors only: a NumPy leaf stayed a read-only view of the place, so
    an in-place op on it raised and, held, it pinned the place (with slots=1, Hoarding)."""
    batches = [{"x": torch.full((4,), float(i)), "n": np.arange(3) + i} for i in range(4)]
    producer = Producer(batches, name=name, slots=1, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, copy=True, timeout=5) as consumer:
            kept = list(consumer)  # copies: holding them all pins no place
            assert [int(b["x"][0]) for b in kept] == [0, 1, 2, 3]
            for i, batch in enumerate(kept):
                assert batch["n"].flags.writeable and batch["n"].base is None
                batch["n"] += 1  # private: allowed
                assert batch["n"].tolist() == [i + 1, i + 2, i + 3]
    finally:
        producer.close()
        server.join(timeout=10)


def test_a_batch_saves_with_torch_save_as_a_dataloader_batch_does(name):
    """Leaves of several dtypes: the first batch of a layout (built the long way) and later
    ones (compiled) save and load bit for bit. torch.save refused the first when its leaves
    were slices of one storage; a leaf saved alone holds only its own bytes."""
    producer = Producer(NestedLoader(3), name=name, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name) as consumer:
            for i, batch in enumerate(consumer):
                saved = io.BytesIO()
                torch.save(batch, saved)
                saved.seek(0)
                assert same(torch.load(saved, weights_only=False), expected_batch(i, 3))
                image = batch[0][0]
                alone = io.BytesIO()
                torch.save(image, alone)
                assert alone.tell() < image.nbytes + 4096
    finally:
        producer.close()
        server.join(timeout=10)


@pytest.mark.parametrize(
    ("prefetch", "held", "bound"), [(None, 2, r"the producer's slots=2"), (1, 1, r"prefetch=1")]
)
def test_holding_every_slot_and_asking_for_more_raises_instead_of_hanging(name, prefetch, held, bound):
    producer = Producer(NestedLoader(6), name=name, slots=2, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, prefetch=prefetch) as consumer:
            kept = []
            with pytest.raises(
                TensorSocketError, match=rf"holds {held} batches, all it may hold \({bound}\)"
            ):
                for batch in consumer:
                    kept.append(batch)
            assert len(kept) == held
    finally:
        producer.close()
        server.join(timeout=10)


def test_nothing_is_pulled_before_min_consumers_join(name):
    loader = NestedLoader(3)
    producer = Producer(loader, name=name, slots=2, replay=0, min_consumers=2)
    server = serving(producer)
    try:
        with Consumer(name=name) as first:
            time.sleep(0.5)
            assert loader.pulled == 0
            with Consumer(name=name) as second:
                # Lockstep: under the default policy the slowest consumer sets the pace.
                pairs = [(a[1]["meta"][2], b[1]["meta"][2]) for a, b in zip(first, second, strict=True)]
                assert pairs == [(0, 0), (1, 1), (2, 2)]
    finally:
        producer.close()
        server.join(timeout=10)


def test_a_consumer_waiting_for_min_consumers_says_why(name, caplog):
    """The first consumer of a producer waiting for two used to wait in silence (86 s in the
    CLI audit, with nothing in its log): after its timeout it says what the producer waits
    for, once; the producer's status says it too, until the stream starts."""
    caplog.set_level(logging.WARNING)
    producer = Producer(NestedLoader(3), name=name, slots=2, replay=0, min_consumers=2)
    server = serving(producer)
    said = "starts its stream once 2 consumers joined"
    try:
        with Consumer(name=name, timeout=0.5) as first:
            it, got = iter(first), []
            waiter = threading.Thread(target=lambda: got.append(next(it)[1]["meta"][2]), daemon=True)
            waiter.start()
            wait_until(lambda: said in caplog.text, 10, "the first consumer's warning")
            time.sleep(1.0)  # (two more timeouts: it is said once)
            assert caplog.text.count(said) == 1 and not got
            assert producer.status()["starts_with"] == 2
            with Consumer(name=name, timeout=0.5) as second:
                waiter.join(10)
                second_it = iter(second)
                assert got == [0] and next(second_it)[1]["meta"][2] == 0
                pairs = [(a[1]["meta"][2], b[1]["meta"][2]) for a, b in zip(it, second_it, strict=True)]
                assert pairs == [(1, 1), (2, 2)]
            assert producer.status()["starts_with"] is None
        assert caplog.text.count(said) == 1
    finally:
        producer.close()
        server.join(timeout=10)


class _CountedItems(torch.utils.data.Dataset):
    """Items ``i`` (a tensor of 4 i's), counting every ``__getitem__`` in every worker."""

    def __init__(self, items: int) -> None:
        self.items, self.calls = items, SPAWN.Value("i", 0)

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.calls.get_lock():
            self.calls.value += 1
        return torch.full((4,), float(i))


def test_no_loader_worker_starts_before_min_consumers_join(name):
    """Opening a DataLoader's epoch starts its workers, which fetch batches ahead at once:
    before, they did so before any consumer joined (16 items by the CLI helper's count)."""
    data = _CountedItems(8)
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1)  # (forked: starts at once)
    producer = Producer(loader, name=name, slots=2, replay=0, min_consumers=1)
    server = serving(producer)
    try:
        time.sleep(2)  # (a worker would have fetched 2 batches ahead by now)
        assert data.calls.value == 0
        with Consumer(name=name) as consumer:
            assert [batch[:, 0].tolist() for batch in consumer] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        producer.close()
        server.join(timeout=10)


def test_late_joiner_waits_for_the_next_epoch_when_this_one_is_gone(name, caplog):
    caplog.set_level(logging.WARNING)
    producer = Producer(NestedLoader(6), name=name, slots=2, replay=0)
    server = serving(producer, epochs=3)
    try:
        with Consumer(name=name) as leader:
            it = iter(leader)
            for _ in range(4):  # batches 0..3: batch 0's slot has been reused
                next(it)
            with Consumer(name=name) as late:
                rest = []
                for b in it:
                    rest.append(b[1]["meta"][2])
                    del b
                assert rest == [4, 5]
                # The late joiner starts at epoch 1's first batch and sees whole epochs, in
                # lockstep with the leader.
                for _ in range(2):
                    pairs = [(a[1]["meta"][2], b[1]["meta"][2]) for a, b in zip(leader, late, strict=True)]
                    assert pairs == [(i, i) for i in range(6)]
                assert list(late) == [] and late.finished
    finally:
        producer.close()
        server.join(timeout=10)


def test_a_consumer_may_keep_tensors_after_close_and_producer_exit(name):
    producer = Producer([torch.arange(1000)], name=name, slots=1, replay=0)
    server = serving(producer)
    with Consumer(name=name) as consumer:
        (batch,) = list(consumer)
    server.join(timeout=10)
    assert not server.is_alive()
    assert torch.equal(batch, torch.arange(1000))  # the mapping outlives the unlink


def test_close_with_a_stalled_consumer_gives_up_after_linger(name, caplog):
    producer = Producer(NestedLoader(20), name=name, slots=2, replay=0, linger=0.5)
    server = serving(producer)
    # Joins and never iterates; with prefetch=1 it cannot even be sent batch 1, so the END
    # that close() appends can never reach it.
    with Consumer(name=name, prefetch=1) as stalled:
        wait_until(lambda: producer.status()["published"] == 2, 10, "batch 2 to be published")
        start = time.monotonic()
        producer.close()
        assert time.monotonic() - start < 3.0
        assert "not finished after linger" in caplog.text
        server.join(timeout=10)
        assert not server.is_alive()
        del stalled


def test_a_consumer_dropped_mid_epoch_is_collected_with_the_batches_it_had_queued(name):
    """Dropped without close() while its I/O thread has batches queued: the Consumer, its
    shared record and those batches go (nothing a batch's release finalizer holds keeps them)."""
    producer = Producer(NestedLoader(40), name=name, slots=4, replay=0)
    server = serving(producer)
    try:
        consumer = Consumer(name=name, timeout=10)
        it = iter(consumer)
        next(it)  # (the first batch, dropped at once)
        gone = weakref.ref(consumer._shared)
        wait_until(lambda: gone().queue.qsize() >= 2, 10, "batches queued")  # type: ignore[union-attr]
        del it, consumer

        def collected() -> bool:
            gc.collect()
            return gone() is None

        wait_until(collected, 10, "the dropped consumer's shared record to be collected")
    finally:
        producer.close()
        server.join(timeout=10)


def test_a_consumer_dropped_without_close_leaves_instead_of_stalling_everyone(name):
    """A Consumer dropped mid-epoch, never closed: it is collected, its thread says BYE, and
    the consumer beside it gets every epoch (the places the dropped one held, the batches its
    I/O thread had queued, would otherwise fill the window and stall everyone)."""
    producer = Producer(NestedLoader(6), name=name, slots=4, replay=0, min_consumers=2)
    server = serving(producer, epochs=3)
    epochs: list[list[int]] = []

    def steady() -> None:
        with Consumer(name=name, timeout=10) as consumer:
            for _ in range(3):
                epochs.append([b[1]["meta"][2] for b in consumer])

    def dropped() -> None:
        it = iter(Consumer(name=name, timeout=10))
        next(it)  # one batch, then the consumer is dropped mid-epoch

    trainer = threading.Thread(target=steady, daemon=True)
    try:
        trainer.start()
        dropped()
        trainer.join(timeout=40)
        assert epochs == [list(range(6))] * 3
        server.join(timeout=10)
        assert not server.is_alive()
    finally:
        producer.close()


def test_a_forked_child_cannot_use_the_consumer_it_inherited_and_the_parent_stays_exact(name):
    """The child shares the parent's connection: reading it took the parent's next batch, and
    the parent then failed. Now the child's next(), iter() and close() refuse or do nothing."""
    import os

    producer = Producer(NestedLoader(6), name=name, replay=0)
    server = serving(producer)
    try:
        with Consumer(name=name, timeout=10) as consumer:
            it = iter(consumer)
            got = [next(it)]
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report what each call did, then leave at once
                said = []
                for call in (lambda: next(it), lambda: iter(consumer)):
                    try:
                        call()
                        said.append("took a batch")
                    except Closed as exc:
                        said.append("Closed: " + str(exc))
                    except BaseException as exc:
                        said.append(type(exc).__name__)
                consumer.close()
                os.write(write, "\n".join(said).encode())
                os._exit(0)
            os.close(write)
            _, status = os.waitpid(pid, 0)
            with os.fdopen(read) as pipe:
                said = pipe.read().split("\n")
            assert status == 0
            assert len(said) == 2 and all(s.startswith("Closed: ") for s in said), said
            assert "forked child cannot use it" in said[0] and str(os.getpid()) in said[0]
            got.extend(it)
            assert len(got) == 6 and all(same(b, expected_batch(i, 6)) for i, b in enumerate(got))
    finally:
        producer.close()
        server.join(timeout=10)


def _keep_two_then_break(name: str, results: Any) -> None:
    """A trainer that keeps its last two batches when it leaves its loop early (at batch 5),
    then runs the next epoch: what it saw of each."""
    try:
        with Consumer(name=name, timeout=10) as consumer:
            kept, seen = [], []
            for batch in consumer:
                kept = [*kept, batch][-2:]
                seen.append(int(batch[0, 0]))
                time.sleep(0.02)
                if len(seen) == 6:
                    break
            del batch
            results.put(("broke", seen))
            results.put(("next epoch", [int(b[0, 0]) for b in consumer]))
    except Exception as exc:  # reported by the test
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_consumers_that_hold_every_place_between_them_while_all_wait_get_one_more(name, caplog):
    """One trainer keeps 2 batches when it leaves its loop early and then runs through the
    rest of that epoch; the other keeps its previous batch besides its loop's. Neither holds
    all it may (4), but together they hold every place, and each waits for the next batch:
    everyone waited for ever. Now the producer, seeing them all wait, adds a place."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    batches = 20
    loader = [torch.full((4, 8), float(i)) for i in range(batches)]
    producer = Producer(loader, name=name, slots=4, replay=0, min_consumers=2)
    server = serving(producer, epochs=2)
    results = SPAWN.Queue()
    breaker = SPAWN.Process(target=_keep_two_then_break, args=(name, results))
    breaker.start()
    got: list[int] = []
    try:
        with Consumer(name=name, timeout=10) as other:

            def keep_previous() -> None:
                previous = last = None
                for _ in range(2):
                    for batch in other:  # holds the batch while it asks for the next
                        got.append(int(batch[0, 0]))
                        time.sleep(0.03)
                        previous, last = last, batch  # and the one before (gradient accumulation, say)
                del previous, last

            trainer = threading.Thread(target=keep_previous, daemon=True)
            trainer.start()
            trainer.join(60)
            assert not trainer.is_alive(), f"the trainer hung after {len(got)} batches: {got}"
        reports = dict(results.get(timeout=30) for _ in range(2))
        breaker.join(30)
    finally:
        if breaker.is_alive():
            breaker.kill()
        producer.close()
        server.join(timeout=30)
    assert got == list(range(batches)) * 2
    assert reports == {"broke": list(range(6)), "next epoch": list(range(batches))}, reports
    assert (
        "by consumers all waiting for the next batch" in caplog.text
        and "one place more, 5 now" in caplog.text
    )


def test_under_skip_stragglers_holding_every_place_do_not_pace_the_leader(name, caplog):
    """stragglers="skip" promises that a straggler's held batches never pace the others. Three
    trainers that stop in turn (an evaluation, a checkpoint), each holding 2 batches (the one
    it took and the one before it, whatever was read ahead), hold all 3 x slots = 6 places
    between them. Before: the leading
    trainer then waited until they went on (a fuzzing helper saw 8.8 s; here, until their 20 s
    stop ended). Now the producer adds places while it waits, and every trainer's batches seen
    plus skipped are the epoch, each once."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    batches = 60
    loader = [torch.full((4, 8), float(i)) for i in range(batches)]
    producer = Producer(loader, name=name, slots=2, max_lag=1, stragglers="skip", replay=0, min_consumers=4)
    server = serving(producer, epochs=1)
    go_on = threading.Event()  # the stragglers' stop ends
    seen: dict[str, list[int]] = {}
    skipped: dict[str, int] = {}
    stopped: list[str] = []  # the stragglers in their stop
    stopped_as_the_leader_ended: list[list[str]] = []

    def train(label: str, stop_at: int | None) -> None:
        seen[label] = []
        previous = None  # the batch before this one, held too: two places, read ahead or not
        with Consumer(name=name, timeout=30, label=label) as consumer:
            for batch in consumer:
                seen[label].append(int(batch[0, 0]))
                if stop_at is not None and seen[label][-1] >= stop_at and label not in stops:
                    stops[label] = seen[label][-2:]
                    stopped.append(label)
                    go_on.wait(20)  # (holding this batch and the one before it)
                    stopped.remove(label)
                previous = batch  # noqa: F841  (held until the next one is taken)
                time.sleep(0.005)
            skipped[label] = consumer.skipped
        if stop_at is None:
            stopped_as_the_leader_ended.append(sorted(stopped))

    # Each stops at the first batch it gets from this one on: far apart, so that the batches
    # they hold are 6 distinct ones however the load has them skip (max_lag=1) before it
    trainers = {"leader": None, "first": 2, "second": 12, "third": 24}
    stops: dict[str, list[int]] = {}  # what each straggler held in its stop
    threads = [threading.Thread(target=train, args=item, daemon=True) for item in trainers.items()]
    try:
        for t in threads:
            t.start()
        threads[0].join(40)
        go_on.set()
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads), seen
    finally:
        go_on.set()
        producer.close()
        server.join(timeout=30)
    assert stopped_as_the_leader_ended == [["first", "second", "third"]], (
        "the leader waited for the stragglers"
    )
    for label in trainers:
        assert seen[label] == sorted(set(seen[label])) and len(seen[label]) + skipped[label] == batches, label
    assert len({i for held in stops.values() for i in held}) == 6, stops  # every place held
    assert "with a consumer waiting for the next batch (stragglers=skip" in caplog.text


def test_a_consumer_that_is_only_slow_gets_no_more_places(name, caplog):
    """The same holds while one consumer trains (3 s) holding what it was sent: every place
    is held and the other waits, but the slow one is not waiting, so the producer waits for
    it as flow control says, and the places stay the window."""
    caplog.set_level(logging.INFO, logger="tensorsocket")
    producer = Producer(NestedLoader(6), name=name, slots=2, replay=0, min_consumers=2)
    server = serving(producer)
    seen: dict[str, list[int]] = {"slow": [], "fast": []}

    def train(label: str, consumer: Consumer) -> None:
        for index, _batch in enumerate(consumer):  # (held while it trains)
            seen[label].append(index)
            if label == "slow" and index == 1:
                time.sleep(3.0)

    try:
        with Consumer(name=name, timeout=10) as slow, Consumer(name=name, timeout=10) as fast:
            threads = [
                threading.Thread(target=train, args=(label, c))
                for label, c in (("slow", slow), ("fast", fast))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), seen
            assert producer.status()["places"] == 2
    finally:
        producer.close()
        server.join(timeout=30)
    assert seen == {"slow": list(range(6)), "fast": list(range(6))}
    assert "one place more" not in caplog.text
