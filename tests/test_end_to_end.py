"""Several consumer processes over two epochs of nested, ragged batches, checked bit for bit."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset

from tensorsocket import Producer
from tests.support import NestedLoader, expected_batch, shm_segments, start_consumers

EPOCHS = 2


def collect(procs, results, n):
    reports = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    return reports


def assert_exact(report, batches, epochs=EPOCHS):
    assert report["error"] is None, report["error"]
    assert report["bad"] == []
    assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]


def test_three_consumers_two_epochs_bit_exact(name):
    batches = 7
    procs, results = start_consumers(name, 3, EPOCHS, batches)
    with Producer(NestedLoader(batches), name=name, slots=3, min_consumers=3) as producer:
        pid = os.getpid()
        producer.serve(epochs=EPOCHS)
    for report in collect(procs, results, 3):
        assert_exact(report, batches)
        assert report["len"] == batches
        assert report["after_end"] == 0 and report["finished"] is True
    assert shm_segments(pid) == []


def test_consumers_that_hold_batches_past_next_see_them_intact(name):
    batches = 9
    procs, results = start_consumers(name, 2, EPOCHS, batches, hold=2)
    Producer(NestedLoader(batches), name=name, slots=3, min_consumers=2).serve(epochs=EPOCHS)
    for report in collect(procs, results, 2):
        assert_exact(report, batches)


class _Indexed(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((2, 3), float(i)), i


def test_dataloader_with_worker_processes(name):
    loader = DataLoader(_Indexed(), batch_size=6, num_workers=2)  # ragged last batch of 4
    from tensorsocket import Consumer

    with Producer(loader, name=name, slots=2) as producer:
        import threading

        server = threading.Thread(target=producer.serve, kwargs={"epochs": 2})
        server.start()
        with Consumer(name=name, timeout=10) as consumer:
            assert len(consumer) == 7
            for _ in range(2):
                got = [(x.clone(), y.clone()) for x, y in consumer]
                assert [len(y) for _, y in got] == [6] * 6 + [4]
                assert torch.equal(torch.cat([y for _, y in got]), torch.arange(40))
                assert torch.equal(torch.cat([x for x, _ in got])[:, 0, 0], torch.arange(40.0))
        server.join(timeout=30)
        assert not server.is_alive()


def test_generator_function_and_list_loaders(name):
    from tensorsocket import Consumer

    def batches():
        for i in range(3):
            yield {"i": torch.tensor([i])}

    for loader, expect in ((batches, [0, 1, 2]), ([torch.tensor([5]), torch.tensor([6])], [5, 6])):
        producer = Producer(loader, name=name, slots=2)
        import threading

        server = threading.Thread(target=producer.serve, kwargs={"epochs": 1})
        server.start()
        with Consumer(name=name) as consumer:
            got = [int(b["i"] if isinstance(b, dict) else b) for b in consumer]
        server.join(timeout=30)
        assert got == expect


def test_expected_batch_is_ragged_and_nested():
    first, last = expected_batch(0, 5), expected_batch(4, 5)
    assert first[0].shape[0] == 8 and last[0].shape[0] == 3
    assert first[0].shape[-1] != expected_batch(1, 5)[0].shape[-1]
