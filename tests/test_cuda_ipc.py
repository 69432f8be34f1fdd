"""CUDA IPC primitives across real processes (GPU only; skipped without one): an arena and
its events opened in another process, and the stream ordering that makes reuse safe - shown
to fail when the ordering is left out, so the test can fail."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
SPAWN = mp.get_context("spawn")
SLOTS = 2
ROUNDS = 200
SLOT_BYTES = 8 << 20


def _reader(handle: bytes, size: int, ready: bytes, expected: int, out: Any) -> None:
    from tensorsocket.transport.cuda_ipc import IpcEvent, open_arena

    try:
        arena = open_arena(handle, size, 0)
        IpcEvent(0, ready).wait()  # on this process's current stream
        total = int(arena.view(torch.int64).sum().item())
        arena[:8].fill_(7)  # shared both ways
        torch.cuda.synchronize()
        out.put({"sum": total, "expected": expected, "size": arena.numel()})
    except Exception as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def test_an_arena_and_its_ready_event_are_opened_in_another_process():
    from tensorsocket.transport.cuda_ipc import ARENA_ALIGN, DeviceArena, IpcEvent

    arena = DeviceArena(3 << 20, 0)
    assert arena.size == 2 * ARENA_ALIGN and arena.ptr % ARENA_ALIGN == 0
    stream = torch.cuda.Stream()
    ready = IpcEvent(0)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the write lands late: the reader must wait for it
        arena.tensor.view(torch.int64).copy_(torch.arange(arena.size // 8, device="cuda"))
        ready.record(stream)
    n = arena.size // 8
    expected = n * (n - 1) // 2
    out = SPAWN.Queue()
    child = SPAWN.Process(target=_reader, args=(arena.handle, arena.size, ready.handle, expected, out))
    child.start()
    report = out.get(timeout=120)
    child.join(30)
    assert "error" not in report, report["error"]
    assert report["sum"] == expected and report["size"] == arena.size
    torch.cuda.synchronize()
    assert arena.tensor[:8].tolist() == [7] * 8  # the reader's write is visible here
    ready.close()
    arena.free()


def _ordered_consumer(handles: list[bytes], ready: list[bytes], ordered: bool, conn: Any) -> None:
    """Each round: wait for the producer's message, (ordered) make our stream wait for its
    ready event, then a long kernel and a check of the slot's contents, all queued on our
    stream; record done and release at once, before the check has run."""
    from tensorsocket.transport.cuda_ipc import IpcEvent, open_arena

    arenas = [open_arena(h, SLOT_BYTES, 0).view(torch.int32) for h in handles]
    ready_events = [IpcEvent(0, h) for h in ready]
    done = [IpcEvent(0) for _ in range(SLOTS)]
    conn.send([d.handle for d in done])
    stream = torch.cuda.Stream()
    ok = torch.zeros(ROUNDS, dtype=torch.bool, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(ROUNDS):
            k = conn.recv()
            slot = k % SLOTS
            if ordered:
                ready_events[slot].wait(stream)
            torch.cuda._sleep(2_000_000)  # a long training step's kernels before it reads
            ok[k] = (arenas[slot] == k).all()
            done[slot].record(stream)
            conn.send(k)  # released at once: the step is still queued
    stream.synchronize()
    conn.send(int((~ok).sum().item()))


@pytest.mark.parametrize("ordered", [True, False], ids=["events", "no-ordering"])
def test_stream_ordering_keeps_overwrites_away_from_batches_still_being_read(ordered):
    from tensorsocket.transport.cuda_ipc import DeviceArena, IpcEvent

    arenas = [DeviceArena(SLOT_BYTES, 0) for _ in range(SLOTS)]
    ready = [IpcEvent(0) for _ in range(SLOTS)]
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(
        target=_ordered_consumer,
        args=([a.handle for a in arenas], [r.handle for r in ready], ordered, theirs),
    )
    child.start()
    try:
        assert mine.poll(120), "the consumer did not start"
        done = [IpcEvent(0, h) for h in mine.recv()]
        stream = torch.cuda.Stream()
        released = 0
        with torch.cuda.stream(stream):
            for k in range(ROUNDS):
                slot = k % SLOTS
                if k >= SLOTS:  # the slot's previous batch must have been released
                    while released <= k - SLOTS:
                        assert mine.poll(60), "no release"
                        released = mine.recv() + 1
                    if ordered:
                        done[slot].wait(stream)  # and its readers' kernels must have run
                arenas[slot].tensor.view(torch.int32).fill_(k)
                ready[slot].record(stream)
                mine.send(k)
            while released < ROUNDS:
                assert mine.poll(60), "no release"
                released = mine.recv() + 1
        assert mine.poll(120), "no result"
        corrupted = mine.recv()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    stream.synchronize()
    if ordered:
        assert corrupted == 0, f"{corrupted} of {ROUNDS} batches were overwritten while being read"
    else:
        assert corrupted > 0, "without the events the test should see corruption; it cannot tell otherwise"
    for a in arenas:
        a.free()


def _doomed_consumer(ready: bytes, conn: Any) -> None:
    """Queue a long kernel, record ``done`` behind it, say so, and die before it runs."""
    import os
    import signal

    from tensorsocket.transport.cuda_ipc import IpcEvent

    done = IpcEvent(0)
    IpcEvent(0, ready).wait()
    torch.cuda._sleep(3_000_000_000)  # ~2 s of GPU time queued ahead of the record
    done.record()
    conn.send(done.handle)
    conn.recv()  # the producer has opened the handle
    os.kill(os.getpid(), signal.SIGKILL)


def _witness(conn: Any) -> None:
    """Open the consumer's ``done`` event while it lives; once told it died, queue a wait on
    it on a stream of our own and report whether the stream moved past it within 5 s. In a
    process of its own: a stream stuck for good stays in torch's stream pool, and a later
    test in the same process could be handed it."""
    import time

    from tensorsocket.transport.cuda_ipc import IpcEvent

    done = IpcEvent(0, conn.recv())
    conn.send("opened")
    conn.recv()  # the consumer is dead
    stream = torch.cuda.Stream()
    marker = torch.cuda.Event()
    with torch.cuda.stream(stream):
        done.wait(stream)
        marker.record(stream)
    deadline = time.monotonic() + 5  # the dead consumer's kernel alone would take ~2 s
    while time.monotonic() < deadline and not marker.query():
        time.sleep(0.01)
    conn.send(marker.query())
    conn.recv()  # killed by the test: exiting with a stuck stream may not return


def test_a_dead_consumers_pending_done_event_never_fires():
    """A fact the cuda transport's design rests on (seen on an H100, driver 580): a stream
    made to wait on an interprocess event whose recording process died before reaching the
    record never moves on. So the producer must never queue a wait on a consumer's ``done``
    event: the consumer's I/O thread waits for its own event, off the training thread, and
    only then sends RELEASE; a consumer that dies before that simply never releases, and the
    flow drops its holds. If this test starts failing, the driver changed the rule."""
    from tensorsocket.transport.cuda_ipc import IpcEvent

    ready = IpcEvent(0)
    ready.record()
    mine, theirs = SPAWN.Pipe()
    ours, its = SPAWN.Pipe()
    child = SPAWN.Process(target=_doomed_consumer, args=(ready.handle, theirs))
    witness = SPAWN.Process(target=_witness, args=(its,))
    child.start()
    witness.start()
    try:
        assert mine.poll(120), "the consumer did not start"
        ours.send(mine.recv())
        assert ours.poll(120), "the witness did not open the event"
        ours.recv()
        mine.send("opened")
        child.join(60)
        assert child.exitcode == -9
        ours.send("dead")
        assert ours.poll(120), "the witness did not report"
        moved_on = ours.recv()
    finally:
        for p in (child, witness):
            p.kill()
            p.join(30)
    assert not moved_on, "the stream moved on: the driver now completes a dead process's events"


def _reader_past_the_free(handle: bytes, size: int, conn: Any) -> None:
    """Open the arena, say so, then read it each time the producer says it did something."""
    from tensorsocket.transport.cuda_ipc import open_arena

    try:
        arena = open_arena(handle, size, 0).view(torch.int32)
        conn.send("opened")
        while conn.recv() != "done":
            conn.send(int(arena.sum(dtype=torch.int64).item()))
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")


def test_a_mapping_keeps_its_bytes_after_the_exporter_freed_the_arena():
    """What the cuda transport relies on, asked of the device: the producer frees a place's
    arena (a place that grew; every place at close) while consumers may still have it mapped,
    at the end of a stream even with batches they read ahead in hand. NVIDIA's documentation
    of cuIpcOpenMemHandle calls a free of an exported region before every importer closed its
    handle undefined behaviour. This checks that, on this device and driver, the importer
    still reads the old bytes after the free, and after new allocations of the same size
    (written with other bytes) were made where the old one might be reused."""
    from tensorsocket.transport.cuda_ipc import DeviceArena

    arena = DeviceArena(SLOT_BYTES, 0)
    arena.tensor.view(torch.int32).fill_(1)
    torch.cuda.synchronize()
    expected = arena.size // 4
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_reader_past_the_free, args=(arena.handle, arena.size, theirs))
    child.start()
    others: list[Any] = []

    def read() -> Any:
        mine.send("read")
        assert mine.poll(60), "the reader did not answer within 60 s"
        return mine.recv()

    try:
        assert mine.poll(120) and mine.recv() == "opened"
        assert read() == expected  # before the free
        arena.free()
        torch.cuda.synchronize()
        assert read() == expected  # after it
        for _ in range(8):
            other = DeviceArena(SLOT_BYTES, 0)
            other.tensor.view(torch.int32).fill_(-1)
            others.append(other)
        torch.cuda.synchronize()
        assert read() == expected  # after allocations that could have reused its memory
        mine.send("done")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        for other in others:
            other.free()
