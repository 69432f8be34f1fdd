"""DataLoader workers collating into reused shared memory (tensorsocket.pooled_collate): real
DataLoader worker processes, real shared memory; batches compared bit for bit with torch's
own ``default_collate``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from tensorsocket.pooled_collate import MAGIC, PooledCollate, Reclaimer, for_loader, installed

from .support import SPAWN, run_in_64_mib_dev_shm, same, serving, small_shm_works, unique_name

SAMPLES, BATCH = 96, 8


class Frames(Dataset):
    """Sample ``i``: an image-like float tensor, a uint8 array, an int label and a small
    tensor, all a pure function of ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.rand(3, 128, 128, generator=g),  # a batch of 8: 1.5 MiB, pooled by default
            "pixels": torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g).numpy(),  # 96 KiB
            "label": i,
            "small": torch.full((2,), float(i)),
        }  # fmt: skip


def expected(index: int) -> dict[str, Any]:
    """Batch ``index`` of an unshuffled loader of Frames, as torch's default_collate makes it."""
    return default_collate([Frames()[i] for i in range(index * BATCH, (index + 1) * BATCH)])


def pooled_storages(batch: dict[str, Any]) -> set[int]:
    out = set()
    for leaf in batch.values():
        storage = leaf.untyped_storage()
        if leaf.storage_offset() and storage.nbytes() >= 16:
            head = torch.empty(0, dtype=torch.int64).set_(storage, 0, (2,))
            if (int(head[0]), int(head[1])) == MAGIC:
                out.add(storage.data_ptr())
    return out


def loader(
    context: str | None = None, workers: int = 2, buffers: int = 2, persistent: bool = True
) -> DataLoader:
    return DataLoader(
        Frames(), batch_size=BATCH, num_workers=workers, persistent_workers=persistent,
        multiprocessing_context=context, collate_fn=PooledCollate(buffers=buffers, min_bytes=64 << 10),
    )  # fmt: skip


def iterate(data: DataLoader, reclaimer: Reclaimer, epochs: int, keep: list[Any] | None = None) -> list[str]:
    """Pull ``epochs`` epochs as the producer does (hand back, pull, track); return what
    differed from default_collate's batch."""
    bad = []
    for epoch in range(epochs):
        for index, batch in enumerate(data):
            reclaimer.track(batch.values())
            if not same(batch, expected(index)):
                bad.append(f"epoch {epoch} batch {index}")
            if keep is not None:
                keep.append((index, batch))
            del batch
            reclaimer.reclaim()
    return bad


@pytest.mark.parametrize("context,persistent", [(None, True), ("spawn", True), (None, False)])
def test_batches_match_default_collate_and_buffers_are_reused(context: str | None, persistent: bool) -> None:
    reclaimer, seen = Reclaimer(), set()
    data = loader(context, persistent=persistent)
    bad = []
    for epoch in range(3):
        for index, batch in enumerate(data):
            seen |= pooled_storages(batch)
            reclaimer.track(batch.values())
            if not same(batch, expected(index)):
                bad.append((epoch, index))
            del batch
            reclaimer.reclaim()
    assert bad == []
    # 36 batches of 2 pooled leaves each (the image and the uint8 array; the labels and the
    # small tensor are below min_bytes), from at most 2 workers x 2 buffers x 2 leaves (an
    # epoch's worth: workers that are not persistent start afresh each epoch)
    assert 0 < len(seen) <= 8 * (1 if persistent else 3), seen
    assert 0 < len(reclaimer) <= 8 * (1 if persistent else 3)


def test_a_held_batch_is_never_written_again_and_reuse_resumes_when_it_is_dropped() -> None:
    reclaimer, data = Reclaimer(), loader()
    kept: list[Any] = []
    assert iterate(data, reclaimer, 1, keep=kept) == []  # every batch of the first epoch held
    assert iterate(data, reclaimer, 2) == []
    assert [i for i, b in kept if not same(b, expected(i))] == []  # none was overwritten
    held = set().union(*(pooled_storages(b) for _, b in kept))
    assert len(held) <= 8  # the pool's worth; the rest of the epoch fell back to fresh memory
    del kept
    handed = reclaimer.reclaim()
    assert handed == len(held)  # all handed back at once when dropped
    seen: set[int] = set()
    for index, batch in enumerate(data):
        seen |= pooled_storages(batch)
        reclaimer.track(batch.values())
        assert same(batch, expected(index))
        del batch
        reclaimer.reclaim()
    assert seen and seen <= held, "the workers took the buffers handed back"


def test_a_view_of_a_batch_keeps_its_buffer() -> None:
    reclaimer, data = Reclaimer(), loader(buffers=1)
    it = iter(data)
    first = next(it)
    reclaimer.track(first.values())
    crop = first["image"][2:4, :, 8:16]  # a derived view is as good as the batch
    want = crop.clone()
    del first
    assert reclaimer.reclaim() == 1  # (the uint8 array's buffer: nothing references it)
    for batch in it:
        reclaimer.track(batch.values())
        del batch
        reclaimer.reclaim()
    assert torch.equal(crop, want)


def test_a_held_storage_object_keeps_its_buffer() -> None:
    """The batch's storage object itself, not a tensor: it holds no reference of its own in
    torch's count, only in Python's."""
    reclaimer, data = Reclaimer(), loader(buffers=1)
    it = iter(data)
    first = next(it)
    reclaimer.track(first.values())
    image = first["image"]
    storage, offset, shape, want = image.untyped_storage(), image.storage_offset(), image.shape, image.clone()
    del first, image
    assert reclaimer.reclaim() == 1  # (the uint8 array's buffer: nothing references it)
    for batch in it:
        reclaimer.track(batch.values())
        del batch
        reclaimer.reclaim()
    assert torch.equal(torch.empty(0).set_(storage, offset, shape), want)


def test_buffers_of_batches_discarded_by_an_epoch_left_early_are_taken_back() -> None:
    """A persistent worker's batches on their way when an epoch is left early are dropped by
    torch when the next epoch starts, unseen: their buffers must not stay claimed for good."""
    data = DataLoader(Frames(), batch_size=BATCH, num_workers=2, persistent_workers=True)
    collate, reclaimer = for_loader(data), Reclaimer()  # 4 a worker for the image, the one pooled leaf
    bad, pooled, storages = [], [], set()
    for epoch in range(8):
        with installed(data, collate):
            batches = iter(data)
        pooled.append(0)
        for index, batch in enumerate(batches):
            reclaimer.track(batch.values())
            if not same(batch, expected(index)):
                bad.append((epoch, index))
            pooled[-1] += bool(pooled_storages(batch))
            storages |= pooled_storages(batch)
            del batch
            reclaimer.reclaim()
            if epoch < 7 and index == 1:
                break  # left early: the batches on their way are discarded at the next iter()
    assert bad == []
    assert len(storages) <= 2 * 4, storages
    # the last epoch, in full: most of its 12 batches still pooled (a worker may still be
    # making a discarded batch when the epoch changes: that buffer comes back one epoch later)
    assert pooled[-1] >= 6, pooled


def test_no_worker_processes_collate_as_torch_does() -> None:
    batch = PooledCollate(min_bytes=0)([Frames()[i] for i in range(BATCH)])  # (in this process)
    assert same(batch, expected(0)) and pooled_storages(batch) == set()


@pytest.mark.parametrize("buffers,min_bytes", [(0, 1), (1.5, 1), (2, -1), (True, 1)])
def test_bad_arguments_are_refused(buffers: Any, min_bytes: Any) -> None:
    with pytest.raises(ValueError, match="buffers|min_bytes"):
        PooledCollate(buffers, min_bytes)


def test_installed_only_for_a_dataloader_with_workers_and_default_collate() -> None:
    plain = DataLoader(Frames(), batch_size=BATCH, num_workers=2, prefetch_factor=3)
    with installed(plain, for_loader(plain)) as on:
        assert on and isinstance(plain.collate_fn, PooledCollate) and plain.collate_fn.buffers == 5
    assert plain.collate_fn is default_collate  # the loader is left as it was
    pooled = for_loader(plain)
    assert pooled is not None
    pooled.new_epoch = lambda: _raise(KeyboardInterrupt)  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), installed(plain, pooled):
        pass
    assert plain.collate_fn is default_collate  # (a Ctrl-C as it began, too: before, it stayed pooled)
    for other in (
        DataLoader(Frames(), batch_size=BATCH),  # no workers
        DataLoader(Frames(), batch_size=BATCH, num_workers=1, collate_fn=lambda b: b),  # its own collate
        DataLoader(Frames(), batch_size=None, num_workers=1),  # no batching
        DataLoader(Frames(), batch_size=BATCH, num_workers=1, pin_memory=True),  # copied, never handed back
        [1, 2, 3],
    ):
        before = getattr(other, "collate_fn", None)
        assert for_loader(other) is None
        with installed(other, PooledCollate()) as on:
            assert not on
        assert getattr(other, "collate_fn", None) is before


def _consume(name: str, epochs: int, results: Any) -> None:
    from tensorsocket import Consumer

    bad, count = [], 0
    with Consumer(name=name, timeout=60) as consumer:
        for epoch in range(epochs):
            for index, batch in enumerate(consumer):
                count += 1
                if not same(batch, expected(index)):
                    bad.append((epoch, index))
    results.put({"pid": os.getpid(), "bad": bad, "count": count})


def test_a_raised_limit_reaches_workers_already_running() -> None:
    reclaimer, data = Reclaimer(), loader("spawn", buffers=1)
    kept: list[Any] = []
    assert iterate(data, reclaimer, 1, keep=kept) == []
    first = set().union(*(pooled_storages(b) for _, b in kept))
    assert 0 < len(first) <= 4  # 2 workers x 1 buffer x 2 leaves, all held
    data.collate_fn.allow(3)
    assert iterate(data, reclaimer, 1, keep=kept) == []  # (the first epoch's still held)
    assert [i for i, b in kept if not same(b, expected(i))] == []
    more = set().union(*(pooled_storages(b) for _, b in kept)) - first
    assert 0 < len(more) <= 8  # each worker made 2 more a leaf: 3 in all


@pytest.mark.parametrize("replay,persistent", [(0, True), (None, True), (0, False)])
def test_a_producer_hands_its_loaders_buffers_back_and_every_batch_arrives_intact(
    replay: int | None, persistent: bool
) -> None:
    from tensorsocket import Producer

    data = DataLoader(Frames(), batch_size=BATCH, num_workers=2, persistent_workers=persistent)
    name, epochs = unique_name("pool"), 3
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_consume, args=(name, epochs, results)) for _ in range(2)]
    producer = Producer(data, name=name, slots=2, replay=replay, min_consumers=2)
    with producer:
        for p in procs:
            p.start()
        with serving(producer, epochs) as (thread, errors):
            reports = [results.get(timeout=120) for _ in procs]
            thread.join(60)
        assert errors == [], errors
        pool = producer._publisher.pool
        reclaimer = pool.reclaimer
        seen = (len(reclaimer), pool.collate.buffers, producer._shared.replay_batches, reports)
        # 2 workers x (prefetch 2 + the batch being published + the one its caller holds): the
        # pool grows only to what is held at once (1 pooled leaf: the images); with the default
        # replay budget, which keeps an epoch (12 batches), by up to 6 more a worker
        if replay == 0:  # (workers that are not persistent: new pools each epoch, the old ones
            # forgotten at its start but for the batch the caller still held then)
            assert 0 < len(reclaimer) <= 2 * 4 + (0 if persistent else 1), seen
        else:
            assert 2 * 4 < len(reclaimer) <= 2 * (4 + 6), seen
    for p in procs:
        p.join(30)
    assert data.collate_fn is default_collate
    assert [r["bad"] for r in reports] == [[], []], reports
    assert [r["count"] for r in reports] == [epochs * SAMPLES // BATCH] * 2, reports


def test_a_resumed_producer_pools_from_its_next_epoch_with_room_for_the_batches_it_keeps(name: str) -> None:
    """A successor resumed mid-epoch finishes that epoch on its predecessor's iterator, without
    the pool; from the next epoch on its workers pool, with room for what the replay budget keeps."""
    from tensorsocket import Consumer, Producer

    from .test_restart import _state_of_a_run

    def data() -> DataLoader:
        return DataLoader(Frames(), batch_size=BATCH, num_workers=2, persistent_workers=True)

    _state_of_a_run(name, data(), 5)  # a first life: 5 batches of epoch 0, then a "crash"
    producer = Producer(data(), name=name, resume=True, slots=4)
    bad, counts = [], []
    with producer, serving(producer, 2) as (thread, errors):
        with Consumer(name=name, late_join="now", timeout=60) as consumer:
            for epoch in range(2):
                counts.append(0)
                for index, batch in enumerate(consumer):
                    counts[-1] += 1
                    if epoch == 1 and not same(batch, expected(index)):
                        bad.append(index)
        thread.join(60)
        pool = producer._publisher.pool
        seen = (counts, pool.pooling, pool.collate and pool.collate.buffers, len(pool.reclaimer))
    assert errors == [], errors
    assert bad == [] and counts[1] == SAMPLES // BATCH, seen
    # prefetch 2 + 2, and each of the 2 workers' share of the 12 batches the default budget keeps
    assert pool.pooling and pool.collate.buffers == 4 + 6, seen
    assert 2 * 4 < len(pool.reclaimer) <= 2 * (4 + 6), seen


SMALL_SHM = """\
import json, sys
import torch
from torch.utils.data import DataLoader, Dataset
from tensorsocket.pooled_collate import PooledCollate, Reclaimer


class Rows(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.full((1 << 16,), i, dtype=torch.float32)  # 256 KiB: a batch of 32 is 8 MiB


if __name__ == "__main__":
    data = DataLoader(Rows(), batch_size=32, num_workers=2, persistent_workers=True, collate_fn=PooledCollate())
    reclaimer, bad, pooled = Reclaimer(), [], set()
    for epoch in range(2):
        for index, x in enumerate(data):
            reclaimer.track([x])
            if x.storage_offset():
                pooled.add(x.untyped_storage().data_ptr())
            if not torch.equal(x, torch.arange(index * 32, index * 32 + 32, dtype=torch.float32)[:, None].expand_as(x)):
                bad.append((epoch, index))
            del x
            reclaimer.reclaim()
    print("REPORT " + json.dumps({"bad": bad, "pooled": len(pooled)}), flush=True)
"""


def test_in_a_64_mib_dev_shm_the_pool_leaves_half_of_it_free(tmp_path: Any) -> None:
    """Docker's default /dev/shm: the workers' buffers never take more than half of it (here
    8 MiB batches: at most 4 of them, fewer while fresh ones are in flight), the rest of the
    batches are made afresh as torch makes them, and every batch is intact."""
    if not small_shm_works():
        pytest.skip("mounting a private tmpfs needs root (CI runs as root)")
    report, _ = run_in_64_mib_dev_shm(SMALL_SHM, [], tmp_path)
    assert report["bad"] == [], report
    assert 1 <= report["pooled"] <= 4, report


def _raise(exc: type[BaseException]) -> None:
    raise exc
