"""The device primitive layer (tensorsocket.transport.device): the CPU stand-in
(TENSORSOCKET_FAKE_CUDA=1) in real processes over real /dev/shm, and, GPU-marked, the real
backend on an NVIDIA GPU. Each test has a way to fail: the orderings are shown both with
and without the ordering primitive, lifetimes both before and after the last view dies."""

from __future__ import annotations

import gc
import os
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

from tensorsocket import fingerprints
from tensorsocket.transport import device
from tensorsocket.transport.device import DeviceAllocation, DeviceBackend, DeviceMapping
from tensorsocket.transport.fake_cuda import FakeBackend, fake_uuid, visible_physical
from tensorsocket.transport.gpu_topology import GpuPathError
from tensorsocket.transport.shm import SHM_DIR, sweep_stale
from tests.support import SPAWN

MiB = 1 << 20


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA_GPUS", raising=False)
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA_DELAY", raising=False)
    return FakeBackend()


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return path in f.read()


# ----------------------------------------------------------------------------- backend()


def test_backend_follows_the_env_at_call_time(monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    first = device.backend()
    assert first.fake and isinstance(first, FakeBackend) and device.backend() is first
    assert isinstance(first, DeviceBackend)
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "0")
    if torch.cuda.is_available():
        assert device.backend().fake is False
    else:
        with pytest.raises(GpuPathError, match=r"CUDA GPU.*pip install 'tensorsocket\[gpu\]'.*FAKE_CUDA=1"):
            device.backend()


def test_real_backend_without_cuda_says_what_to_do(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    with pytest.raises(GpuPathError) as info:
        device.backend()
    message = str(info.value)
    assert "built without CUDA" in message and "tensorsocket[gpu]" in message and "device='cpu'" in message


# ----------------------------------------------------------------------------- memory across processes


def _open_and_write(handles: list[bytes], size: int, out: Any) -> None:
    try:
        b = device.backend()
        maps = [b.open(h, size, 0) for h in handles]
        sums = [int(m.tensor.view(torch.int64).sum()) for m in maps]
        maps[0].tensor[:8].fill_(7)  # read-write, as device memory is
        out.put({"fake": b.fake, "sums": sums, "open_count": b.open_count, "size": maps[0].tensor.numel()})
    except Exception as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def test_an_allocation_is_shared_both_ways_with_another_process(fake):
    a, b = fake.alloc(3 * MiB, 0), fake.alloc(1, 1)
    try:
        assert isinstance(a, DeviceAllocation)
        assert (a.size, b.size) == (4 * MiB, 2 * MiB) and len(a.handle) == len(b.handle) == 64
        assert os.path.exists(os.path.join(SHM_DIR, a.handle.rstrip(b"\0").decode()))
        n = a.size // 8
        a.tensor.view(torch.int64).copy_(torch.arange(n))
        b.tensor.view(torch.int64).fill_(3)
        out = SPAWN.Queue()
        child = SPAWN.Process(target=_open_and_write, args=([a.handle, b.handle], 2 * MiB, out))
        child.start()
        report = out.get(timeout=60)
        child.join(30)
        assert "error" not in report, report["error"]
        half = 2 * MiB // 8  # opened with a smaller size: only that much is mapped
        assert report == {
            "fake": True,
            "sums": [half * (half - 1) // 2, 3 * half],
            "open_count": 2,
            "size": 2 * MiB,
        }
        assert a.tensor[:8].tolist() == [7] * 8  # the consumer's write is visible here
    finally:
        a.free()
        b.free()
        a.free()  # idempotent
    assert not os.path.exists(os.path.join(SHM_DIR, a.handle.rstrip(b"\0").decode()))


def test_open_counts_each_open(fake):
    a = fake.alloc(MiB, 0)
    try:
        maps = [fake.open(a.handle, a.size, 0), fake.open(a.handle, a.size, 1)]
        assert fake.open_count == 2 and all(isinstance(m, DeviceMapping) for m in maps)
    finally:
        a.free()


# ----------------------------------------------------------------------------- region lifetime


def test_a_regions_owner_dies_with_its_last_derived_view(fake):
    a = fake.alloc(MiB, 0)
    a.tensor[:64] = torch.arange(64, dtype=torch.uint8)
    m = fake.open(a.handle, a.size, 0)
    fired: list[str] = []
    tensor, owner = m.region(64)
    other, other_owner = m.region(64)
    assert owner is not other_owner and tensor.numel() == 64
    weakref.finalize(owner, fired.append, "first")
    weakref.finalize(other_owner, fired.append, "second")
    del owner, other_owner
    words = tensor[16:].view(torch.int32).reshape(4, 3)
    array = words.numpy()[1:]
    del tensor, words
    gc.collect()
    assert fired == []  # a slice's numpy view still holds it
    del other
    gc.collect()
    assert fired == ["second"]  # regions are independent
    assert array[0, 0] == int.from_bytes(bytes(range(28, 32)), "little")
    del array
    gc.collect()
    assert fired == ["second", "first"]
    m.close()
    a.free()


def test_a_live_region_keeps_the_mapping_after_close_and_free(fake):
    a = fake.alloc(MiB, 0)
    path = os.path.join(SHM_DIR, a.handle.rstrip(b"\0").decode())
    a.tensor[:4] = 9
    m = fake.open(a.handle, a.size, 0)
    region, owner = m.region(4)
    fired: list[int] = []
    weakref.finalize(owner, fired.append, 1)
    del owner
    m.close()
    m.close()  # idempotent
    a.free()
    assert not os.path.exists(path)  # unlinked ...
    assert _mapped(path)  # ... but still mapped, under the live region
    assert region.tolist() == [9] * 4 and fired == []
    with pytest.raises(RuntimeError, match="closed"):
        m.region(4)
    del region
    gc.collect()
    assert fired == [1] and not _mapped(path)  # the last region took the mapping with it


def test_a_region_must_fit(fake):
    a = fake.alloc(MiB, 0)
    m = fake.open(a.handle, a.size, 0)
    with pytest.raises(ValueError, match="does not fit"):
        m.region(a.size + 1)
    assert m.region(0)[0].numel() == 0
    a.free()


def test_the_stand_ins_free_memory_is_dev_shms_and_an_allocation_takes_from_it(fake):
    before = fake.free_memory(0)
    a = fake.alloc(64 * MiB, 0)
    a.tensor.fill_(1)  # (tmpfs pages count once written)
    assert before - fake.free_memory(0) >= 32 * MiB  # (other processes may use /dev/shm meanwhile)
    a.free()
    with pytest.raises(GpuPathError):
        fake.free_memory(5)


# ----------------------------------------------------------------------------- streams and events


def test_a_copy_lands_only_when_its_event_fires(fake, monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "1.0")  # (long enough that the reads below come first)
    stream = fake.new_stream(0)
    a = fake.alloc(MiB, 0)
    src = torch.full((4096,), 5, dtype=torch.uint8)
    event = fake.event()
    assert event.query()  # never recorded: fired, as on CUDA
    start = time.monotonic()
    fake.copy(a.tensor, [(0, src)], stream)
    event.record(stream)
    assert not event.query()
    assert int(a.tensor[:4096].sum()) == 0  # read before the event: old bytes
    event.synchronize()
    assert time.monotonic() - start >= 0.95 and event.query()
    assert int(a.tensor[:4096].sum()) == 5 * 4096
    with pytest.raises(RuntimeError, match="cannot copy"):
        fake.copy(a.tensor[:8], [(0, src)], stream)
    with pytest.raises(RuntimeError, match="cannot copy"):
        fake.copy(a.tensor, [(a.size - 8, src[:16])], stream)
    a.free()


def test_a_stream_runs_its_work_in_order(fake, monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "0.05")
    stream = fake.new_stream(0)
    dst = torch.zeros(8, dtype=torch.uint8)
    seen: list[int] = []
    for value in (1, 2, 3):
        fake.copy(dst, [(0, torch.full((8,), value, dtype=torch.uint8))], stream)
        stream.enqueue(lambda: seen.append(int(dst[0])))
    event = fake.event()
    event.record(stream)
    event.synchronize()
    assert seen == [1, 2, 3] and dst.tolist() == [3] * 8


def test_an_event_behind_work_that_never_finishes_never_fires(fake):
    stream = fake.new_stream(0)
    gate = threading.Event()
    stream.enqueue(lambda: gate.wait(60))  # a kernel that does not end (a dead peer's wait)
    event = fake.event()
    event.record(stream)
    waiter = threading.Thread(target=event.synchronize, daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not event.query()
    gate.set()  # only now does the stream reach the record
    waiter.join(5.0)
    assert not waiter.is_alive() and event.query()


def test_rerecording_resets_the_event(fake):
    stream = fake.new_stream(0)
    event = fake.event()
    event.record(stream)
    event.synchronize()
    gate = threading.Event()
    stream.enqueue(lambda: gate.wait(60))
    event.record(stream)
    assert not event.query()
    gate.set()
    event.synchronize()
    assert event.query()


@pytest.mark.parametrize("nbytes", [0, 1, 1000, 4097, MiB + 3])
def test_samples_read_the_fingerprints_bytes_after_the_streams_work(fake, monkeypatch, nbytes):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "0.2")
    stream = fake.new_stream(0)
    a = fake.alloc(max(nbytes, 1), 0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    fake.copy(a.tensor, [(0, src)], stream)  # lands 0.2 s later, on the same stream
    stride, count = fingerprints.sampling(nbytes)
    got = fake.samples(a.tensor, stride, count, stream)
    assert got.dtype == np.uint8 and got.shape == (count,)
    assert fingerprints.of_samples(got, nbytes) == fingerprints.of(src.numpy())
    a.free()


@pytest.mark.parametrize("ordered", [True, False], ids=["wait_stream", "no-ordering"])
def test_wait_stream_orders_one_stream_after_another(fake, monkeypatch, ordered):
    # (no-ordering: long enough that the read comes before the copy lands)
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "1.0")
    producer = fake.new_stream(0)
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "0")
    consumer = fake.new_stream(0)
    place = torch.zeros(16, dtype=torch.uint8)
    seen: list[int] = []
    fake.copy(place, [(0, torch.full((16,), 4, dtype=torch.uint8))], producer)
    if ordered:
        fake.wait_stream(consumer, producer)
    consumer.enqueue(lambda: seen.append(int(place.sum())))  # a kernel reading the place
    event = fake.event()
    event.record(consumer)
    event.synchronize()
    assert seen == ([64] if ordered else [0])


def test_current_stream_is_per_thread_and_use_stream_swaps_it(fake):
    current = fake.current_stream(0)
    assert fake.current_stream(0) is current and fake.current_stream(1) is not current
    elsewhere: list[Any] = []
    worker = threading.Thread(target=lambda: elsewhere.append(fake.current_stream(0)))
    worker.start()
    worker.join(10)
    assert elsewhere and elsewhere[0] is not current
    mine = fake.new_stream(0)
    with fake.use_stream(mine):
        assert fake.current_stream(0) is mine and fake.current_stream(1) is not mine
    assert fake.current_stream(0) is current


def test_a_collected_streams_worker_exits(fake):
    before = set(threading.enumerate())
    stream = fake.new_stream(0)
    (worker,) = set(threading.enumerate()) - before
    assert worker.daemon  # never keeps the process from exiting
    worker.join(0.3)
    assert worker.is_alive()  # idle, waiting for work
    del stream
    gc.collect()
    worker.join(5)
    assert not worker.is_alive()


def test_stuck_streams_do_not_keep_the_process_from_exiting():
    code = (
        "import threading\n"
        "from tensorsocket.transport.device import backend\n"
        "b = backend()\n"
        "s, t = b.new_stream(0), b.new_stream(0)\n"
        "t.enqueue(threading.Event().wait)\n"  # t never gets past this
        "b.wait_stream(s, t)\n"  # s waits for t forever
        "e = b.event()\n"
        "e.record(s)\n"
        "print('queued', e.query())\n"
    )
    env = {**os.environ, "TENSORSOCKET_FAKE_CUDA": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "queued False" and time.monotonic() - start < 30


# ----------------------------------------------------------------------------- GPU visibility


def test_cuda_visible_devices_is_parsed_as_cuda_does():
    assert visible_physical(3, None) == [0, 1, 2]
    assert visible_physical(3, "2,0") == [2, 0]
    assert visible_physical(3, f"{fake_uuid(1)},0") == [1, 0]
    assert visible_physical(3, "GPU-00000000-0000-4000-8000-000000000002") == [2]
    assert visible_physical(3, "GPU-00000000,1") == []  # ambiguous prefix: invalid, stops
    assert visible_physical(3, "1,x,0") == [1]  # stops at the first invalid entry
    assert visible_physical(3, "0,7,1") == [0]
    assert visible_physical(3, "1,1,0") == [1]
    assert visible_physical(3, "") == [] and visible_physical(3, "-1") == []


def _visible_report(handle: bytes, uuid: str, out: Any) -> None:
    try:
        b = FakeBackend()
        report: dict[str, Any] = {"uuids": b.visible_uuids(), "ordinal": b.ordinal(uuid)}
        if report["ordinal"] is not None:
            m = b.open(handle, 2 * MiB, report["ordinal"])
            report["first"] = int(m.tensor[0])
        else:
            try:
                b.open(handle, 2 * MiB, 0)
            except GpuPathError as exc:
                report["error"] = str(exc)
        out.put(report)
    except Exception as exc:
        out.put({"crash": f"{type(exc).__name__}: {exc}"})


def test_uuids_map_to_each_processs_own_ordinals(monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_GPUS", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    producer = FakeBackend()
    assert producer.visible_uuids() == [fake_uuid(2), fake_uuid(1)]
    assert producer.ordinal(fake_uuid(1)) == 1 and producer.ordinal(fake_uuid(0)) is None
    arena = producer.alloc(MiB, 1)  # physical GPU 1
    arena.tensor[0] = 42
    try:
        reports = {}
        for visible in ("1,0", fake_uuid(0)):
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
            out = SPAWN.Queue()
            child = SPAWN.Process(target=_visible_report, args=(arena.handle, fake_uuid(1), out))
            child.start()
            reports[visible] = out.get(timeout=60)
            child.join(30)
    finally:
        arena.free()
    assert reports["1,0"] == {"uuids": [fake_uuid(1), fake_uuid(0)], "ordinal": 0, "first": 42}
    hidden = reports[fake_uuid(0)]
    assert hidden["uuids"] == [fake_uuid(0)] and hidden["ordinal"] is None
    assert fake_uuid(1) in hidden["error"] and "not visible" in hidden["error"]


# ----------------------------------------------------------------------------- handles and stale segments


@pytest.mark.parametrize(
    "handle",
    [
        b"tensorsocket-0-1-ab-cuda0-1",  # not 64 bytes
        b"/etc/passwd".ljust(64, b"\0"),
        b"tensorsocket-../../etc/passwd".ljust(64, b"\0"),
        b"tensorsocket-1-2-abcd-cuda0-1/x".ljust(64, b"\0"),
        b"tensorsocket-1-2-abcd-3-1".ljust(64, b"\0"),  # an shm transport segment, not a fake arena
        b"tensorsocket-1-2-abcd-cudax-1".ljust(64, b"\0"),
        b"tensorsocket-1-2-ab\0cd-cuda0-1".ljust(64, b"\0"),
        "tensorsocket-1-2-äbcd-cuda0-1".encode().ljust(64, b"\0"),
    ],
)
def test_a_foreign_handle_is_refused_by_name(fake, handle):
    with pytest.raises(ValueError, match="fake CUDA"):
        fake.open(handle, MiB, 0)
    assert fake.open_count == 0


def _allocate_and_hang(conn: Any) -> None:
    arena = FakeBackend().alloc(MiB, 0)
    conn.send(arena.handle.rstrip(b"\0").decode())
    time.sleep(120)


def test_a_killed_owners_fake_arenas_are_swept(monkeypatch):
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_allocate_and_hang, args=(theirs,))
    child.start()
    try:
        assert mine.poll(60), "the child did not allocate"
        name = mine.recv()
        assert os.path.exists(os.path.join(SHM_DIR, name))
        assert name not in sweep_stale()  # its owner is alive
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    sweep_stale()  # (a Producer made in another xdist worker may have swept it already)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


# ----------------------------------------------------------------------------- the real backend (GPU)


def _real_consumer(handle: bytes, size: int, expected: int, conn: Any) -> None:
    try:
        b = device.backend()
        m = b.open(handle, size, 0)
        report: dict[str, Any] = {"fake": b.fake, "open_count": b.open_count}
        report["sum"] = int(m.tensor.view(torch.int64).sum().item())
        region, owner = m.region(1024)
        fired: list[int] = []
        weakref.finalize(owner, fired.append, 1)
        report["same_memory"] = region.data_ptr() == m.tensor.data_ptr() and region.device.index == 0
        del owner
        words = region[8:].view(torch.int32)
        del region
        gc.collect()
        report["alive_under_view"] = fired == []
        m.tensor[:8].fill_(7)  # read-write: the producer sees it
        torch.cuda.synchronize()
        m.close()
        conn.send("holding")
        conn.recv()  # the producer has freed its allocation
        report["after_free"] = int(words[:4].sum().item())  # still mapped: the driver keeps it
        del words
        gc.collect()
        report["fired_after_last_view"] = fired == [1]
        report["expected"] = expected
        conn.send(report)
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


@pytest.mark.gpu
def test_real_allocation_is_opened_in_another_process_and_regions_live_by_reference(monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    a = b.alloc(3 * MiB, 0)
    assert not b.fake and a.size == 4 * MiB and len(a.handle) == 64 and a.tensor.is_cuda
    n = a.size // 8
    a.tensor.view(torch.int64).copy_(torch.arange(n, device="cuda:0"))
    torch.cuda.synchronize()
    first_words = int(a.tensor[8:24].view(torch.int32).sum().item())
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_real_consumer, args=(a.handle, a.size, n * (n - 1) // 2, theirs))
    child.start()
    try:
        assert mine.poll(120), "the consumer did not start"
        message = mine.recv()
        assert message == "holding", message
        assert a.tensor[:8].tolist() == [7] * 8
        a.free()
        mine.send("freed")
        assert mine.poll(60), "no report"
        report = mine.recv()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert "error" not in report, report["error"]
    assert report["fake"] is False and report["open_count"] == 1
    assert report["sum"] == report["expected"] and report["same_memory"]
    assert report["alive_under_view"] and report["fired_after_last_view"]
    assert report["after_free"] == first_words


@pytest.mark.gpu
def test_real_allocation_opened_in_its_own_process_is_borrowed_and_freed_after_its_last_view(monkeypatch):
    """CUDA refuses to open an IPC handle in the process that exported it (an H200 said
    cudaErrorDeviceUninitialized to a consumer in its producer's process): such a consumer
    borrows the arena, and the producer's free waits for the last view over it."""
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    a = b.alloc(3 * MiB, 0)
    a.tensor.view(torch.int64).copy_(torch.arange(a.size // 8, device="cuda:0"))
    torch.cuda.synchronize()
    m = b.open(a.handle, a.size, 0)
    assert m.tensor.data_ptr() == a.tensor.data_ptr()
    region, owner = m.region(1024)
    words = region.view(torch.int64)
    del region, owner
    m.close()
    gc.collect()
    a.free()  # (its own tensor is gone; the borrowed view is not)
    free_while_viewed = torch.cuda.mem_get_info(0)[0]
    assert words.tolist() == list(range(128))
    del words
    gc.collect()
    assert torch.cuda.mem_get_info(0)[0] - free_while_viewed >= a.size  # freed with the last view


@pytest.mark.gpu
def test_real_pinned_copy_event_and_wait_stream(monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    src = torch.full((1 << 20,), 3, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()  # the zero fill ran on the default stream
    stream = b.new_stream(0)
    assert stream != torch.cuda.default_stream(0)
    with b.use_stream(stream):
        assert b.current_stream(0) == stream
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time ahead of the copy
    b.copy(dst, [(0, src)], stream)
    event = b.event()
    event.record(stream)
    assert not event.query()
    assert b.new_stream(0) is stream  # one per device and process
    reader = torch.cuda.Stream(0)
    b.wait_stream(reader, stream)
    with b.use_stream(reader):
        total = dst.sum()  # queued behind the copy by wait_stream
    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    before = ticks[0]
    event.synchronize()  # blocking sync with the GIL released: the counter runs meanwhile
    during = ticks[0] - before
    stop.set()
    counter.join(10)
    assert event.query() and during > 10_000, during
    assert torch.equal(dst.cpu(), src)
    reader.synchronize()
    assert int(total.item()) == 3 * (1 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [0, 1, 4097, (64 << 20) + 5])
def test_real_samples_give_the_host_fingerprint(monkeypatch, nbytes):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    region = torch.empty(nbytes + 4096, dtype=torch.uint8, device="cuda:0")
    stream = b.new_stream(0)
    with b.use_stream(stream):
        torch.cuda._sleep(100_000_000)  # the copy lands well after the call returns
        region[:nbytes].copy_(host.pin_memory(), non_blocking=True)
    stride, count = fingerprints.sampling(nbytes)
    assert fingerprints.of_samples(b.samples(region, stride, count, stream), nbytes) == fingerprints.of(host)


@pytest.mark.gpu
def test_real_current_stream_follows_the_threads_stream(monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    assert b.current_stream(0) == torch.cuda.current_stream(0)
    mine, pooled = b.new_stream(0), torch.cuda.Stream(0)
    for stream in (mine, pooled, mine):
        with torch.cuda.stream(stream):
            assert b.current_stream(0) == stream == torch.cuda.current_stream(0)
    assert b.current_stream(0) == torch.cuda.default_stream(0)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(b.current_stream(0)))
    with torch.cuda.stream(mine):
        worker.start()
        worker.join(30)
    assert seen == [torch.cuda.default_stream(0)]  # current streams are per thread


@pytest.mark.gpu
def test_real_free_memory_falls_by_an_allocation(monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    b = device.backend()
    before = b.free_memory(0)
    assert 0 < before <= torch.cuda.mem_get_info(0)[1]
    a = b.alloc(512 * MiB, 0)
    try:
        assert before - b.free_memory(0) >= 256 * MiB
    finally:
        a.free()


@pytest.mark.gpu
def test_real_visible_uuids_match_nvml(monkeypatch):
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    pynvml = pytest.importorskip("pynvml")
    b = device.backend()
    uuids = b.visible_uuids()
    assert len(uuids) == torch.cuda.device_count() >= 1
    pynvml.nvmlInit()
    try:
        nvml = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            value = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            nvml.add(value.decode() if isinstance(value, bytes) else value)
    finally:
        pynvml.nvmlShutdown()
    assert set(uuids) <= nvml, (uuids, nvml)
    assert [b.ordinal(u) for u in uuids] == list(range(len(uuids)))
    assert b.ordinal("GPU-00000000-0000-0000-0000-000000000000") is None
