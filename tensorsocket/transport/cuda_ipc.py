"""CUDA IPC primitives for the ``cuda`` transport: device arenas and interprocess events
that another process on the same node opens once and then uses without copies.

Only the mechanics live here; which slot may be overwritten when is the flow's business.

* :class:`DeviceArena` (producer): one ``cudaMalloc`` per slot, rounded up to 2 MiB so
  that the exported handle exposes no unrelated allocation; its IPC handle is exported once.
* :func:`open_arena` (consumer): open a handle once and get a flat ``uint8`` tensor over the
  producer's memory (a view: no copy). The mapping is closed when the last view dies.
* :class:`IpcEvent`: an interprocess event (``cudaEventInterprocess``, no timing). The
  producer records ``ready[k]`` on its stream after writing slot k and a consumer's stream
  waits on it; the consumer records ``done`` on its stream when it releases the slot.
  Measured on an H100 (``tests/test_cuda_ipc.py``): a stream waiting on an interprocess
  event whose process died before reaching the record never moves on. So the producer must
  never queue a wait on a consumer's ``done``: the consumer's I/O thread waits for its own
  ``done`` (off the training thread) before it sends RELEASE, and a consumer that dies
  first never releases (the flow drops its holds).

We use CuPy's thin runtime bindings (the ``gpu`` extra): torch exposes CUDA IPC only
through its multiprocessing reductions, which tie the memory's lifetime to the sending
tensor and reopen handles per message.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

ARENA_ALIGN = 2 << 20  # 2 MiB: cudaMalloc's granularity for large blocks

# This process's arenas by IPC handle. CUDA refuses to open a handle in the process that
# exported it (cudaIpcOpenMemHandle: cudaErrorDeviceUninitialized, seen on an H200), so a
# consumer in the producer's own process borrows the arena instead (:class:`Borrowed`).
_EXPORTED: weakref.WeakValueDictionary[bytes, DeviceArena] = weakref.WeakValueDictionary()


def _runtime() -> Any:
    try:
        from cupy.cuda import runtime
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "the cuda transport needs CuPy: pip install 'tensorsocket[gpu]' for a torch built for CUDA 12, "
            "'tensorsocket[gpu-cuda13]' for CUDA 13 (torch.version.cuda says which)"
        ) from exc
    return runtime


def _as_tensor(ptr: int, nbytes: int, device: int, owner: Any) -> torch.Tensor:
    """A flat uint8 tensor over device memory at ``ptr``; ``owner`` lives as long as it does."""
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=device)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)


class DeviceArena:
    """Producer side: one slot's device memory and its IPC handle (bytes, exported once)."""

    def __init__(self, nbytes: int, device: int) -> None:
        runtime = _runtime()
        self.device = device
        self.size = max(ARENA_ALIGN, -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN)
        with torch.cuda.device(device):
            self.ptr = runtime.malloc(self.size)
            self.handle: bytes = bytes(runtime.ipcGetMemHandle(self.ptr))
        self.tensor = _as_tensor(self.ptr, self.size, device, self)
        self._lock = threading.RLock()  # (re-entered by a borrower's __del__ under GC)
        self._borrowers = 0
        self._free_asked = False
        _EXPORTED[self.handle] = self

    def free(self) -> None:
        """Free the memory, which consumers may still map (a place that grew; at the end of
        a stream, with batches they read ahead). NVIDIA's cuIpcOpenMemHandle documentation
        calls a free before every importer closed its handle undefined; the driver keeps the
        memory until the last importer closes it (reported in ai-dynamo/nixl#1066 and
        openucx/ucx#11753; ``tests/test_cuda_ipc.py`` passed on an H200, 2026-12-01). A
        borrower in this process has no such guard: the free waits for the last one."""
        with self._lock:
            self.tensor = None  # type: ignore[assignment]
            self._free_asked = True
            if not self._borrowers:
                self._free_now()

    def _free_now(self) -> None:
        ptr, self.ptr = self.ptr, 0  # (runs only once no borrower is left: see free, _give_back)
        if ptr:
            if _EXPORTED.get(self.handle) is self:
                del _EXPORTED[self.handle]
            with torch.cuda.device(self.device):
                _runtime().free(ptr)

    def _lend(self) -> int:
        with self._lock:
            if not self.ptr or self._free_asked:
                raise RuntimeError("the arena was freed before this process's consumer opened it")
            self._borrowers += 1
            return self.ptr

    def _give_back(self) -> None:
        with self._lock:
            self._borrowers -= 1
            if not self._borrowers and self._free_asked:
                self._free_now()


class Borrowed:
    """Consumer side, in the producer's own process: the arena's pointer, lent until this
    object dies (with the last tensor over it), where another process opens the handle."""

    def __init__(self, arena: DeviceArena) -> None:
        self.device = arena.device
        self.ptr = arena._lend()
        self._arena: DeviceArena | None = arena

    def __del__(self) -> None:
        arena, self._arena = getattr(self, "_arena", None), None
        if arena is not None:
            try:
                arena._give_back()
            except Exception:  # interpreter shutdown, or the context is gone: nothing to do
                pass


def opened(handle: bytes, device: int) -> _Mapping | Borrowed:
    """The arena behind ``handle``: borrowed if this process exported it, else opened."""
    arena = _EXPORTED.get(handle)
    return _Mapping(handle, device) if arena is None else Borrowed(arena)


class _Mapping:
    """Consumer side: an opened IPC handle, closed when the last tensor over it is gone."""

    def __init__(self, handle: bytes, device: int) -> None:
        runtime = _runtime()
        self.device = device
        with torch.cuda.device(device):
            self.ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                with torch.cuda.device(self.device):
                    _runtime().ipcCloseMemHandle(ptr)
            except Exception:  # interpreter shutdown, or the context is gone: nothing to do
                pass


def open_arena(handle: bytes, size: int, device: int) -> torch.Tensor:
    """Open a producer's arena (once per arena and process) as a flat uint8 tensor view."""
    if len(handle) != 64:
        raise ValueError(f"a CUDA IPC memory handle has 64 bytes, got {len(handle)}")
    mapping = opened(handle, device)
    return _as_tensor(mapping.ptr, size, device, mapping)


class IpcEvent:
    """An interprocess CUDA event: create one (``handle=None``) or open another process's."""

    def __init__(self, device: int, handle: bytes | None = None) -> None:
        runtime = _runtime()
        self.device = device
        with torch.cuda.device(device):
            if handle is None:
                flags = runtime.eventDisableTiming | runtime.eventInterprocess
                self.event = runtime.eventCreateWithFlags(flags)
                self.handle: bytes = bytes(runtime.ipcGetEventHandle(self.event))
            else:
                self.event = runtime.ipcOpenEventHandle(handle)
                self.handle = handle

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        """Record on ``stream`` (default: the current one): it fires when the work queued
        there so far is done."""
        stream = stream or torch.cuda.current_stream(self.device)
        _runtime().eventRecord(self.event, stream.cuda_stream)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the last record, on the GPU."""
        stream = stream or torch.cuda.current_stream(self.device)
        _runtime().streamWaitEvent(stream.cuda_stream, self.event, 0)

    def synchronize(self) -> None:
        """Block the host until the last record fired (tests and shutdown only)."""
        _runtime().eventSynchronize(self.event)

    def close(self) -> None:
        event, self.event = self.event, 0
        if event:
            with torch.cuda.device(self.device):
                _runtime().eventDestroy(event)
