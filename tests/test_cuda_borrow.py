"""The same-process borrow of a CUDA arena (``transport/cuda_ipc.py``), on the CPU: CUDA's
runtime is replaced by a recorder, since no GPU is here. The real runtime runs it on the
device (``test_device_backend.py``'s borrow test and the CUDA-path tests with a consumer in the
producer's process, ``scripts/gpu.sh``). What is checked here is the bookkeeping: when the
memory is freed, that it is freed once, and what a late open gets."""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
from typing import Any

import pytest
import torch

from tensorsocket.transport import cuda_ipc


class Runtime:
    """The few cudart calls the arena makes, recorded; an IPC open of this process's own
    handle fails as CUDA's does."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.freed: list[int] = []
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def malloc(self, nbytes: int) -> int:
        with self._lock:
            ptr = next(self._next) << 32
            self.live[ptr] = nbytes
        return ptr

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        return ptr.to_bytes(64, "little")

    def free(self, ptr: int) -> None:
        with self._lock:
            assert ptr in self.live, f"cudaFree of {ptr:#x}, which is not allocated (a double free?)"
            del self.live[ptr]
            self.freed.append(ptr)

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        raise RuntimeError("cudaErrorDeviceUninitialized: invalid device context")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    fake = Runtime()
    monkeypatch.setattr(cuda_ipc, "_runtime", lambda: fake)
    monkeypatch.setattr(cuda_ipc, "_as_tensor", lambda ptr, nbytes, device, owner: torch.empty(0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return fake


def test_an_own_handle_is_borrowed_and_the_free_waits_for_the_last_borrower(runtime: Runtime) -> None:
    arena = cuda_ipc.DeviceArena(3 << 20, 0)
    first, second = cuda_ipc.opened(arena.handle, 0), cuda_ipc.opened(arena.handle, 0)
    assert isinstance(first, cuda_ipc.Borrowed) and first.ptr == second.ptr == arena.ptr
    arena.free()
    assert runtime.live and not runtime.freed  # borrowed: not yet
    del first
    gc.collect()
    assert runtime.live and not runtime.freed
    del second
    gc.collect()
    assert not runtime.live and len(runtime.freed) == 1 and arena.ptr == 0
    arena.free()  # again: nothing more
    assert len(runtime.freed) == 1


def test_an_unborrowed_arena_is_freed_at_once_and_not_lent_after(runtime: Runtime) -> None:
    arena = cuda_ipc.DeviceArena(1, 0)
    handle = arena.handle
    arena.free()
    assert runtime.freed == [int.from_bytes(handle, "little")]
    with pytest.raises(RuntimeError, match="freed before this process's consumer opened it"):
        cuda_ipc.Borrowed(arena)
    with pytest.raises(RuntimeError, match="cudaErrorDeviceUninitialized"):
        cuda_ipc.opened(handle, 0)  # no longer this process's: CUDA's own answer


class _CollectsWhenDropped:
    def __del__(self) -> None:
        gc.collect()


def test_a_borrower_collected_inside_the_free_neither_deadlocks_nor_frees_twice(runtime: Runtime) -> None:
    """A borrower in a reference cycle dies when the collector runs, which can be inside
    ``free()`` on the thread that holds the arena's lock (here: as the arena drops its own
    tensor); its ``__del__`` then takes that lock again."""
    arena = cuda_ipc.DeviceArena(1, 0)
    cycle: list[Any] = [cuda_ipc.Borrowed(arena)]
    cycle.append(cycle)
    del cycle
    arena.tensor = _CollectsWhenDropped()  # type: ignore[assignment]
    gc.disable()  # (the cycle waits for the collection inside free())
    try:
        freeing = threading.Thread(target=arena.free, daemon=True)
        freeing.start()
        freeing.join(10)
    finally:
        gc.enable()
    assert not freeing.is_alive(), "free() deadlocked on its own lock"
    assert not runtime.live and len(runtime.freed) == 1


def _borrow_and_drop(arena: cuda_ipc.DeviceArena, start: threading.Barrier) -> None:
    start.wait()
    for _ in range(20):
        with contextlib.suppress(RuntimeError):  # lent after the free was asked
            cuda_ipc.Borrowed(arena)


def test_threads_lending_against_a_free_never_free_twice_or_leak(runtime: Runtime) -> None:
    for _ in range(20):
        arena = cuda_ipc.DeviceArena(1, 0)
        start = threading.Barrier(3)
        threads = [threading.Thread(target=_borrow_and_drop, args=(arena, start)) for _ in range(2)]
        for t in threads:
            t.start()
        start.wait()
        arena.free()
        for t in threads:
            t.join(10)
        assert not runtime.live, "an arena was never freed"  # (borrowers die by reference count)
    assert len(runtime.freed) == 20
