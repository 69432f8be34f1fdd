"""The producer calls set_epoch as a training loop would; node_sampler shards a dataset across
nodes, one producer per node."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from tensorsocket import Consumer, Producer, node_sampler
from tensorsocket.sharding import epoch_targets
from tests.support import SPAWN, join_or_fail, serving

SIZE = 24


class Recording(DistributedSampler):
    """A DistributedSampler that records the epochs it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        super().set_epoch(epoch)


class RecordingBatches(BatchSampler):
    """Batches of 4 in order, rotated by the epoch it was given last."""

    def __init__(self, n: int) -> None:
        super().__init__(SequentialSampler(range(n)), batch_size=4, drop_last=False)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        batches = list(super().__iter__())
        shift = self.epochs[-1] % len(batches) if self.epochs else 0
        return iter(batches[shift:] + batches[:shift])


class RecordingDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class EpochStream(IterableDataset):
    """Yields 100 * epoch + i: what it yields says which epoch it was told."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        epoch = self.epochs[-1] if self.epochs else -1
        return iter(range(100 * epoch, 100 * epoch + self.n))


def consume(name: str, epochs: int, **options: Any) -> list[list[int]]:
    """Each epoch's samples, in the order one consumer received them."""
    with Consumer(name=name, timeout=20, **options) as consumer:
        return [[x for batch in consumer for x in batch.tolist()] for _ in range(epochs)]


def reference(sampler_args: dict[str, Any], epoch: int, batch_size: int = 4) -> list[int]:
    """What a training loop reads in ``epoch``: set_epoch on a fresh identical sampler, then
    iterate a fresh identical DataLoader."""
    sampler = DistributedSampler(**sampler_args)
    sampler.set_epoch(epoch)
    loader = DataLoader(sampler_args["dataset"], sampler=sampler, batch_size=batch_size)
    return [x for batch in loader for x in batch.tolist()]


# ---------------------------------------------------------------- set_epoch in the producer


def test_a_distributed_sampler_gets_a_new_order_each_epoch_as_in_a_training_loop(name):
    args = {"dataset": list(range(SIZE)), "num_replicas": 1, "rank": 0, "shuffle": True, "seed": 3}
    sampler = Recording(**args)
    producer = Producer(
        DataLoader(args["dataset"], sampler=sampler, batch_size=4), name=name, slots=2, replay=0
    )
    with serving(producer, epochs=3) as (_, errors):
        got = consume(name, 3)
    assert errors == []
    assert got == [reference(args, e) for e in range(3)]
    assert len({tuple(order) for order in got}) == 3  # a new order every epoch
    assert sorted(got[0]) == list(range(SIZE))
    assert sampler.epochs == [0, 1, 2]  # once per epoch, though it is also batch_sampler.sampler


def test_a_batch_sampler_and_a_dataset_with_set_epoch_are_each_called_once_per_epoch(name):
    dataset, batches = RecordingDataset(12), RecordingBatches(12)
    producer = Producer(DataLoader(dataset, batch_sampler=batches), name=name, slots=2, replay=0)
    with serving(producer, epochs=3) as (_, errors):
        got = consume(name, 3)
    assert errors == []
    assert batches.epochs == [0, 1, 2] and dataset.epochs == [0, 1, 2]
    in_order = list(range(12))
    assert got == [in_order, in_order[4:] + in_order[:4], in_order[8:] + in_order[:8]]


def test_an_iterable_dataset_is_told_the_epoch_before_it_is_iterated(name):
    stream = EpochStream(6)
    producer = Producer(DataLoader(stream, batch_size=4), name=name, slots=2, replay=0)
    with serving(producer, epochs=3) as (_, errors):
        got = consume(name, 3)
    assert errors == []
    assert stream.epochs == [0, 1, 2]
    assert got == [list(range(100 * e, 100 * e + 6)) for e in range(3)]


def test_an_epoch_left_early_counts_and_the_next_is_told_its_number(name):
    stream = EpochStream(6)
    seen: list[list[int]] = []
    reader = threading.Thread(target=lambda: seen.extend(consume(name, 2)), name="test-consumer")
    with Producer(DataLoader(stream, batch_size=2), name=name, slots=2, replay=0) as producer:
        reader.start()
        for _ in producer:
            break  # epoch 0 ends after its first batch
        assert [int(x) for batch in producer for x in batch] == list(range(100, 106))
    join_or_fail(reader)
    assert stream.epochs == [0, 1]
    assert seen == [[0, 1], list(range(100, 106))]


def test_epoch_targets_are_the_objects_with_set_epoch_each_once():
    sampler = DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    loader = DataLoader(list(range(8)), sampler=sampler, batch_size=2)
    assert epoch_targets(loader) == [sampler]

    class Loader:
        def __init__(self) -> None:
            self.sampler = sampler
            self.dataset = RecordingDataset(3)

        def __iter__(self):
            return iter([])

        def set_epoch(self, epoch: int) -> None:
            pass

    custom = Loader()
    assert epoch_targets(custom) == [custom, sampler, custom.dataset]
    batches = BatchSampler(sampler, batch_size=2, drop_last=False)  # the sampler inside a batch sampler
    assert epoch_targets(DataLoader(list(range(8)), batch_sampler=batches)) == [sampler]

    def generator():
        yield 1

    assert epoch_targets(generator) == [] and epoch_targets([1, 2]) == []
    assert epoch_targets(DataLoader(list(range(4)))) == []  # a plain DataLoader has none


# ---------------------------------------------------------------- two simulated nodes

NODES, NODE_SEED, NODE_SIZE = 2, 11, 48  # 24 samples a node: 6 batches, 3 for each of its 2 ranks


def serve_node(name: str, node_rank: int, results: Any) -> None:
    """Producer process of one node: its rank comes from torchrun's environment."""
    os.environ.update(GROUP_RANK=str(node_rank), WORLD_SIZE=str(2 * NODES), LOCAL_WORLD_SIZE="2")
    try:
        dataset = list(range(NODE_SIZE))
        loader = DataLoader(dataset, sampler=node_sampler(dataset, seed=NODE_SEED), batch_size=4)
        Producer(loader, name=name, slots=2, replay=0, min_consumers=2).serve(epochs=2)
        results.put((node_rank, None))
    except BaseException as exc:
        results.put((node_rank, f"{type(exc).__name__}: {exc}"))


def test_two_nodes_with_one_producer_each_and_a_group_of_ranks_on_each_see_the_dataset_once_per_epoch(name):
    """A 2-node job of 2 ranks a node: each node's producer serves its shard, which its ranks
    (a group) split; the 4 ranks together read every sample once per epoch."""
    names = [f"{name}-node{r}" for r in range(NODES)]
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=serve_node, args=(names[r], r, results)) for r in range(NODES)]
    for p in procs:
        p.start()
    got: dict[tuple[int, int], list[list[int]]] = {}
    errors: list[BaseException] = []

    def trainer(node: int, local: int) -> None:
        try:
            got[node, local] = consume(names[node], 2, group="job", rank=local, world_size=2)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=trainer, args=(r, i), name=f"test-trainer-{r}-{i}")
        for r in range(NODES)
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        join_or_fail(t, 60)
    reports = dict(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert errors == [] and reports == {0: None, 1: None}
    assert [p.exitcode for p in procs] == [0, 0]

    dataset = list(range(NODE_SIZE))
    for node in range(NODES):
        shard = [
            reference({"dataset": dataset, "num_replicas": NODES, "rank": node, "seed": NODE_SEED}, e)
            for e in range(2)
        ]
        assert shard[0] != shard[1]  # a new order each epoch
        for local in range(2):  # rank r: the node's batches i with i % 2 == r (batch size 4)
            expected = [[x for i in range(local, 6, 2) for x in epoch[4 * i : 4 * i + 4]] for epoch in shard]
            assert got[node, local] == expected
    for epoch in range(2):
        union = [x for key in got for x in got[key][epoch]]
        assert sorted(union) == dataset  # every sample once per epoch across the 4 ranks


# ---------------------------------------------------------------- node_sampler


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_node_sampler_pads_an_uneven_dataset_like_distributed_sampler(no_launcher):
    dataset = list(range(5))
    for drop_last, per_node in ((False, 3), (True, 2)):
        shards = [list(node_sampler(dataset, node_rank=r, num_nodes=2, drop_last=drop_last)) for r in (0, 1)]
        assert [len(s) for s in shards] == [per_node, per_node]
        union = shards[0] + shards[1]
        if drop_last:
            assert len(set(union)) == 4  # one sample dropped, none repeated
        else:
            assert set(union) == set(dataset) and len(union) == 6  # one sample repeated as padding


def test_node_sampler_reads_torchrun_environment(no_launcher):
    dataset = list(range(10))
    no_launcher.setenv("GROUP_RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "8")
    no_launcher.setenv("LOCAL_WORLD_SIZE", "4")
    sampler = node_sampler(dataset, seed=5, shuffle=False)
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.seed, sampler.shuffle) == (1, 2, 5, False)
    assert list(sampler) == [1, 3, 5, 7, 9]
    no_launcher.setenv("NODE_RANK", "0")  # GROUP_RANK (the rendezvous's word) wins
    assert node_sampler(dataset).rank == 1
    no_launcher.delenv("GROUP_RANK")
    assert node_sampler(dataset).rank == 0
    assert (
        node_sampler(dataset, node_rank=2, num_nodes=3).rank,
        node_sampler(dataset, num_nodes=3).num_replicas,
    ) == (2, 3)


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        ({}, {"num_nodes": 2}, "node_rank=, run under torchrun (it sets GROUP_RANK), or set NODE_RANK"),
        ({"GROUP_RANK": ""}, {"num_nodes": 2}, "needs the node's rank"),
        ({}, {"node_rank": 0}, "not set: WORLD_SIZE, LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "4"}, {"node_rank": 0}, "not set: LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, {"node_rank": 0}, "WORLD_SIZE=6 is not a multiple"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "0"}, {"node_rank": 0}, "LOCAL_WORLD_SIZE='0' must be >= 1"),
        (
            {"WORLD_SIZE": "four", "LOCAL_WORLD_SIZE": "2"},
            {"node_rank": 0},
            "WORLD_SIZE='four' is not an integer",
        ),
        ({"GROUP_RANK": "x"}, {"num_nodes": 2}, "GROUP_RANK='x' is not an integer"),
        ({"NODE_RANK": "-1"}, {"num_nodes": 2}, "NODE_RANK='-1' must be >= 0"),
        (
            {"GROUP_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
            {},
            "node rank 2 (GROUP_RANK) must be below",
        ),
        (
            {},
            {"node_rank": 2, "num_nodes": 2},
            "node rank 2 (node_rank=) must be below the number of nodes 2",
        ),
        ({}, {"node_rank": -1, "num_nodes": 2}, "node_rank must be an int >= 0"),
        ({}, {"node_rank": 1.0, "num_nodes": 2}, "node_rank must be an int >= 0"),
        ({}, {"node_rank": "1", "num_nodes": 2}, "node_rank must be an int >= 0"),
        ({}, {"node_rank": True, "num_nodes": 2}, "node_rank must be an int >= 0"),
        ({}, {"node_rank": 0, "num_nodes": 0}, "num_nodes must be an int >= 1"),
        ({}, {"node_rank": 0, "num_nodes": 2.0}, "num_nodes must be an int >= 1"),
        ({}, {"node_rank": 0, "num_nodes": 2, "seed": "3"}, "seed must be an int"),
        ({}, {"node_rank": 0, "num_nodes": 2, "shuffle": 1}, "shuffle and drop_last must be bools"),
        ({}, {"node_rank": 0, "num_nodes": 2, "drop_last": None}, "shuffle and drop_last must be bools"),
    ],
)
def test_node_sampler_refuses_what_is_missing_or_inconsistent(no_launcher, env, kwargs, message):
    for var, value in env.items():
        no_launcher.setenv(var, value)
    with pytest.raises(ValueError) as info:
        node_sampler(list(range(4)), **kwargs)
    assert message in str(info.value)


def test_the_package_exports_node_sampler_and_importing_it_does_not_import_torch():
    import tensorsocket

    assert "node_sampler" in tensorsocket.__all__ and tensorsocket.node_sampler is node_sampler
    code = "import sys, tensorsocket; tensorsocket.node_sampler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"  # torch comes with the first call, not the import
