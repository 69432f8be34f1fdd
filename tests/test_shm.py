"""Shared-memory segments: allocation failures are clean, stale segments are swept, live
ones are not, and consumers map only tensorsocket segments."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from tensorsocket import fingerprints, layout, layout_table
from tensorsocket.errors import ProtocolError
from tensorsocket.transport import shm
from tensorsocket.transport.shm import PREFIX, SHM_DIR, ArenaInfo, ShmReader, ShmStore, sweep_stale
from tests.support import run_in_64_mib_dev_shm, small_shm_works


def test_a_too_large_arena_fails_cleanly_and_leaves_nothing():
    pool = ShmStore()
    try:
        with pytest.raises(OSError, match="cannot allocate .* shared memory"):
            pool.prepare(0, 1 << 50)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getuid()}-{os.getpid()}-")]
    finally:
        pool.close()


def test_sweep_removes_segments_of_dead_owners_only(tmp_path, monkeypatch):
    # A directory of its own: a Producer made in another xdist worker sweeps /dev/shm too,
    # and could take the stale segment first.
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{PREFIX}{os.getuid()}-{dead_pid}-deadbeef-0-1"
    live = tmp_path / f"{PREFIX}{os.getuid()}-{os.getpid()}-cafef00d-0-1"
    for path in (stale, live):
        path.write_bytes(b"x")
    assert sweep_stale() == [stale.name]
    assert not stale.exists() and live.exists()


def test_producer_and_consumer_views_share_memory_and_regrowth_is_announced():
    pool = ShmStore()
    try:
        small = layout.plan(torch.arange(10))
        (descriptor,) = pool.install(pool.prepare(0, small.nbytes))  # one transport: one descriptor
        info = ArenaInfo.decode(descriptor)
        assert info.size % 4096 == 0
        assert pool.prepare(0, small.nbytes) is None  # fits: no new arena
        big = layout.plan(torch.arange(1 << 20))
        grown = ArenaInfo.decode(pool.install(pool.prepare(0, big.nbytes))[0])
        assert grown.name != info.name and grown.size >= big.nbytes
        assert not os.path.exists(os.path.join(SHM_DIR, info.name))  # the old one is unlinked
        assert_read_back(pool, grown, big, torch.arange(1 << 20))
    finally:
        pool.close()


def assert_read_back(pool: ShmStore, info: ArenaInfo, plan: layout.Plan, expected: torch.Tensor) -> None:
    """Write ``plan`` into place 0 of ``pool`` (whose arena ``info`` describes) and check that a
    consumer reads it back: the same fingerprint and the same tensor."""
    fingerprint = pool.write(0, plan).wait()
    arenas = ShmReader(torch.device("cpu"))
    arenas.announce(info.encode())
    region = arenas.region(0, plan.nbytes)
    assert fingerprints.of(region) == fingerprint
    tree, leaves = layout.check(plan.encode(), info.size)
    assert torch.equal(layout.build(tree, leaves, region), expected)


@pytest.mark.parametrize("advice", [shm._MADV_POPULATE_WRITE, 9999])  # 9999: refused, as by a kernel < 5.14
def test_a_new_arena_is_written_and_read_with_or_without_madvise_populate(monkeypatch, advice):
    monkeypatch.setattr(shm, "_MADV_POPULATE_WRITE", advice)
    pool = ShmStore()
    try:
        batch = layout.plan(torch.arange(1 << 16, dtype=torch.float64))
        info = ArenaInfo.decode(pool.install(pool.prepare(0, batch.nbytes))[0])
        assert_read_back(pool, info, batch, torch.arange(1 << 16, dtype=torch.float64))
    finally:
        pool.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "/tmp/x", "other-segment", f"{PREFIX}a/../../b"])
def test_consumer_maps_only_tensorsocket_segments(name):
    arenas = ShmReader(torch.device("cpu"))
    arenas.announce(ArenaInfo(0, name, 4096).encode())
    with pytest.raises(ValueError):
        arenas.region(0, 16)


@pytest.mark.parametrize(
    "descriptor",
    [["shm", 0, "x"], ["cuda", 0, "x", 4096], ["shm", -1, "x", 4096], ["shm", 0, b"x", 4096], "shm", []],
)
def test_consumer_decodes_shm_descriptors_strictly(descriptor):
    with pytest.raises(ProtocolError):
        ShmReader(torch.device("cpu")).announce(descriptor)


# ------------------------------------------------------------- a /dev/shm of a container's size

FIT = """\
import json, logging, sys
import torch
from tensorsocket import Consumer, Producer
from tests.support import FORK

MIB = 1 << 20


def consume(name, device, out):
    try:
        with Consumer(name=name, device=device, timeout=30) as consumer:
            out.put({"sums": [int(x.sum()) for x, in consumer]})
    except Exception as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def loader(count, mib, shared):
    # made one at a time, as a DataLoader does; "shared": in shared memory, as its workers' are
    def batches():
        for i in range(count):
            x = torch.full((mib * MIB,), i, dtype=torch.uint8)
            yield (x.share_memory_() if shared else x,)
    return batches


if __name__ == "__main__":
    name, slots, replay, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    count, mib, shared = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "shared"
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
    out = FORK.Queue()
    consumer = FORK.Process(target=consume, args=(name, device, out))
    consumer.start()
    report = {}
    try:
        Producer(loader(count, mib, shared), name=name, slots=slots, replay=replay, device=device).serve(epochs=1)
    except OSError as exc:
        report["producer_error"] = f"{exc.errno}: {exc.strerror}"
    report["consumer"] = out.get(timeout=60)
    consumer.join(timeout=30)
    print("REPORT " + json.dumps(report), flush=True)
"""


def _in_a_64_mib_dev_shm(
    tmp_path: Any,
    name: str,
    slots: int,
    replay: int,
    device: str = "cpu",
    batches: tuple[int, int, bool] = (6, 16, False),
) -> tuple[dict[str, Any], str]:
    """Run FIT (a producer and a consumer of ``batches``: how many, MiB each, made in shared
    memory or not) in a 64 MiB /dev/shm. ``device="cuda:0"`` runs it on the CPU stand-in for
    a GPU, whose device memory is that /dev/shm."""
    args = [name, str(slots), str(replay), device, str(batches[0]), str(batches[1])]
    args.append("shared" if batches[2] else "private")
    env = {"TENSORSOCKET_FAKE_CUDA": "1"} if device != "cpu" else {}
    return run_in_64_mib_dev_shm(FIT, args, tmp_path, env)


needs_mount = pytest.mark.skipif(
    not small_shm_works(), reason="mounting a private tmpfs needs root (CI runs as root)"
)


@needs_mount
def test_slots_that_do_not_fit_the_shared_memory_are_refused_at_the_first_batch(tmp_path, name):
    report, _ = _in_a_64_mib_dev_shm(tmp_path, name, slots=8, replay=0)
    error = report["producer_error"]
    assert error.startswith(f"{errno.ENOSPC}:"), report
    assert "8 x 16.0 MiB = 128 MiB" in error and "/dev/shm has 64 MiB free" in error, error
    assert "slots=" in error and "--shm-size" in error, error
    assert "16777216 bytes" in error and "at most 3 fit" in error, error
    assert "ProducerLost" in report["consumer"]["error"], report  # told why, not left waiting


@needs_mount
def test_a_replay_budget_of_batches_in_shared_memory_is_cut_to_half_what_is_left(tmp_path, name):
    """Kept batches stay where the loader made them: a DataLoader's workers make them in
    /dev/shm, so keeping more than it has room for would leave them short."""
    report, out = _in_a_64_mib_dev_shm(tmp_path, name, slots=2, replay=1 << 30, batches=(12, 4, True))
    assert "producer_error" not in report, report
    assert report["consumer"] == {"sums": [i * (4 << 20) for i in range(12)]}, report
    assert "replay buffer cut from 256 to 6 batches: /dev/shm has 5" in out, (
        out
    )  # (55.9 MiB after 8 for the window)


@needs_mount
def test_a_replay_budget_of_private_batches_is_not_cut(tmp_path, name):
    report, out = _in_a_64_mib_dev_shm(tmp_path, name, slots=2, replay=1 << 30)
    assert "producer_error" not in report, report
    assert report["consumer"] == {"sums": [i * (16 << 20) for i in range(6)]}, report
    assert "replay buffer cut" not in out, out


GPU_STAND_IN = "cuda:0 (the CPU stand-in, in /dev/shm)"


@needs_mount
def test_gpu_places_that_do_not_fit_the_gpu_memory_are_refused_at_the_first_batch(tmp_path, name):
    """The same check for GPU memory (here the stand-in's, which is that /dev/shm): an
    out-of-memory error some batches in would come too late, and with no remedy."""
    report, _ = _in_a_64_mib_dev_shm(tmp_path, name, slots=8, replay=0, device="cuda:0")
    error = report["producer_error"]
    assert error.startswith(f"{errno.ENOSPC}:"), report
    assert f"8 x 16.0 MiB = 128 MiB for slots=8, but {GPU_STAND_IN} has 64 MiB free" in error, error
    assert "free memory on that GPU" in error and "device='cpu'" in error, error
    assert "--shm-size" not in error, error  # a container's shared memory is not what is short
    assert "ProducerLost" in report["consumer"]["error"], report


@needs_mount
def test_a_gpu_producers_replay_takes_no_gpu_memory(tmp_path, name):
    """Two places fit the 64 MiB (stand-in) GPU, and the 1 GiB replay budget needs none of it:
    kept batches stay in the loader's host memory."""
    report, out = _in_a_64_mib_dev_shm(tmp_path, name, slots=2, replay=1 << 30, device="cuda:0")
    assert "producer_error" not in report, report
    assert report["consumer"] == {"sums": [i * (16 << 20) for i in range(6)]}, report
    assert "replay buffer cut" not in out, out


def test_a_fingerprint_taken_after_the_write_is_the_one_the_write_takes():
    """A batch written without one (no consumer checked) gets it at publish if one joined."""
    with ShmStore() as store:
        plan = layout.plan((torch.rand(8, 4), torch.arange(3)))
        store.install(store.prepare(0, plan.nbytes))
        taken = store.write(0, plan).wait()
        assert taken is not None and store.write(0, plan, False).wait() is None
        assert store.fingerprint(0, plan.nbytes) == taken


def test_every_view_of_a_leased_batch_keeps_its_owner_alive():
    """The release finalizer hangs on the lease's owner: a view that skipped it (NumPy collapses
    a view's base past arrays that do not own their memory) would let the batch be released,
    and its place rewritten, while the view still reads it."""
    pool = ShmStore()
    try:
        batch = {
            "x": torch.arange(64, dtype=torch.float32).reshape(8, 8),  # a tensor with a NumPy twin
            "h": torch.arange(8, dtype=torch.bfloat16),  # one without
            "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        }
        plan = layout.plan(batch)
        info = ArenaInfo.decode(pool.install(pool.prepare(0, plan.nbytes))[0])
        pool.write(0, plan).wait()
        reader = ShmReader(torch.device("cpu"))
        reader.announce(info.encode())
        recipe = layout_table.Recipe(plan.encode())
        for key in batch:
            lease = reader.lease(0, plan.nbytes)
            owner = weakref.ref(lease.owner)
            view = recipe.build(lease.region)[key][1:]  # derived from one leaf; the batch dropped
            del lease
            gc.collect()
            assert owner() is not None, key
            assert np.array_equal(as_float64(view), as_float64(batch[key][1:])), key
            del view
            gc.collect()
            assert owner() is None, key
        reader.close()
    finally:
        pool.close()


def as_float64(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values.double().numpy() if isinstance(values, torch.Tensor) else values.astype(np.float64)


def test_a_read_only_reader_builds_batches_without_a_warning():
    """torch warns once per process about a tensor over read-only memory; a recipe spends that
    warning quietly when it is made, so views over a read-only mapping are made with
    ``torch.from_numpy`` directly and nobody sees it. In a fresh process: the warning is once."""
    script = """
import warnings
import torch
from tensorsocket import layout, layout_table
from tensorsocket.transport.shm import ArenaInfo, ShmReader, ShmStore
warnings.simplefilter("error")  # any warning fails the script
batch = (torch.arange(64, dtype=torch.float32).reshape(8, 8), torch.arange(8, dtype=torch.bfloat16))
pool = ShmStore()
try:
    plan = layout.plan(batch)
    info = ArenaInfo.decode(pool.install(pool.prepare(0, plan.nbytes))[0])
    pool.write(0, plan).wait()
    reader = ShmReader(torch.device("cpu"))
    reader.announce(info.encode())
    lease = reader.lease(0, plan.nbytes)
    views = layout_table.Recipe(plan.encode()).build(lease.region)
    assert not lease.region.flags.writeable
    assert all(torch.equal(v, b) for v, b in zip(views, batch, strict=True))
    torch.from_numpy(lease.region)  # (and no later one either)
    print("quiet")
finally:
    pool.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["quiet"], done.stderr[-2000:]


def test_other_threads_run_while_a_large_place_is_made():
    """Populating a new segment holds the GIL in madvise(): in one call, a 2 GiB place kept the
    producer's I/O thread (its heartbeats) waiting ~1 s. It is populated a piece at a time, so
    another Python thread runs between the pieces. (Relative, not a speed figure: the longest
    the other thread waited against the time the whole mapping took.)"""
    import threading
    import time

    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    path = os.path.join(SHM_DIR, f"{PREFIX}test-populate-{os.getpid()}")
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.05)
        gaps.clear()
        started = time.monotonic()
        mm = shm._map(path, 512 << 20, create=True)
        took = time.monotonic() - started
        stop.set()
        ticker.join()
        mm.close()
    finally:
        stop.set()
        ticker.join()
        if os.path.exists(path):
            os.unlink(path)
    assert max(gaps) < 0.3 * took, (max(gaps), took)
