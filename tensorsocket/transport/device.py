"""The device primitives the ``cuda`` transport is built on, behind one small API with two
implementations: the real one (torch + CuPy, :mod:`.cuda_real`) and a CPU stand-in over host
shared memory (:mod:`.fake_cuda`, chosen by ``TENSORSOCKET_FAKE_CUDA=1``).

Why a seam here: the transport's logic (announce after completion, release by the last
view's finalizer, fingerprints, UUID-to-ordinal matching, dead peers) is what breaks, and
CI has no GPU. With the stand-in, that logic runs in real processes over real shared
memory, with asynchronous FIFO "streams" and events that fire late (or never), so its
tests can fail the way they would on a GPU. Only the mechanics below differ between the
two; :mod:`.cuda` calls nothing else.

Semantics both implementations keep (and the tests check):

* An allocation is rounded up to 2 MiB (``ARENA_ALIGN``), so its exported handle exposes no
  unrelated memory; its handle is 64 bytes and opened once per arena per consumer process.
* A consumer's mapping is writable (GPU memory cannot be protected), so in-place writes by
  a consumer are caught by fingerprints, not by the MMU.
* ``region()`` returns a new tensor and a new owner object per call: the owner is collected
  exactly when that tensor and everything derived from it are dead, so a
  ``weakref.finalize(owner, ...)`` is the release signal; the mapping stays open while any
  region lives, even after :meth:`DeviceMapping.close` and the producer's ``free()``.
* ``copy`` is asynchronous on a stream; an event recorded after it fires when it landed.
  Streams run their work in order; ``wait_stream`` orders one stream after another.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .gpu_topology import GpuPathError  # what backend() raises; re-exported for callers

__all__ = [
    "DeviceAllocation",
    "DeviceBackend",
    "DeviceEvent",
    "DeviceMapping",
    "GpuPathError",
    "Stream",
    "backend",
    "check_visible",
    "fake_requested",
    "no_cuda_reason",
]

FAKE_ENV = "TENSORSOCKET_FAKE_CUDA"

# A stream is opaque to the transport: torch.cuda.Stream on the real backend, a FIFO worker
# (fake_cuda.FakeStream, which also has ``enqueue(fn)`` for tests) in the stand-in.
Stream = Any


@runtime_checkable
class DeviceEvent(Protocol):
    """A local event (real: ``torch.cuda.Event(blocking=True)``). Never recorded: fired."""

    def record(self, stream: Stream) -> None:
        """Fire when the work queued on ``stream`` so far has run; re-recording resets it."""

    def synchronize(self) -> None:
        """Block the host, without spinning and with the GIL released, until the last record
        fired. A record queued behind work that never runs never fires."""

    def query(self) -> bool:
        """Whether the last record fired (never blocks)."""


@runtime_checkable
class DeviceAllocation(Protocol):
    """Producer side: one arena ("place") of device memory and its exported handle."""

    size: int  # bytes, rounded up to ARENA_ALIGN
    handle: bytes  # 64 bytes, exported once
    ordinal: int
    tensor: torch.Tensor  # flat uint8 over the whole allocation

    def free(self) -> None:
        """Give the memory back; idempotent. Consumers that still map it keep it valid
        (driver semantics; in the stand-in, an unlinked file stays mapped)."""


@runtime_checkable
class DeviceMapping(Protocol):
    """Consumer side: a producer's arena, opened once in this process."""

    size: int
    tensor: torch.Tensor | None  # flat uint8 over the whole mapping; None after close()

    def region(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A new flat uint8 tensor over the first ``nbytes`` and its owner, a new weakref-able
        object collected exactly when that tensor and all its derivatives are dead."""

    def close(self) -> None:
        """Drop the mapping's own reference; idempotent. Live regions keep it mapped."""


@runtime_checkable
class DeviceBackend(Protocol):
    fake: bool
    open_count: int  # open() calls in this process: "opened once per arena" is checked on it

    def visible_uuids(self) -> list[str]:
        """``GPU-...`` UUID of each visible ordinal, in ordinal order."""

    def ordinal(self, uuid: str) -> int | None:
        """This process's ordinal of that GPU (ordinals differ under CUDA_VISIBLE_DEVICES)."""

    def alloc(self, nbytes: int, ordinal: int) -> DeviceAllocation: ...

    def free_memory(self, ordinal: int) -> int:
        """Bytes the device can still allocate (real: the driver's free memory; the stand-in's
        arenas are /dev/shm files, so its free space)."""

    def open(self, handle: bytes, size: int, ordinal: int) -> DeviceMapping: ...

    def new_stream(self, ordinal: int) -> Stream:
        """A stream that is not the default one, for the transport's own work. Real: one raw
        non-blocking CUDA stream per device and process, shared by its stores and readers
        (their work is ordered by events), never torch's stream pool, whose first use costs
        ~70 MiB of GPU memory per process. Stand-in: a new FIFO worker per call."""

    def current_stream(self, ordinal: int) -> Stream:
        """The calling thread's current stream on that device (cheap: called per batch)."""

    def use_stream(self, stream: Stream) -> AbstractContextManager[Any]:
        """Make ``stream`` current in this thread for the block."""

    def copy(self, dst: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], stream: Stream) -> None:
        """Enqueue on ``stream``, for each ``(offset, src)``, a copy of the flat uint8 ``src``
        into ``dst[offset:]``, after the work queued so far on the calling thread's current
        stream if a source is in device memory (the work that made it); returns at once. The
        caller keeps the sources alive until an event recorded after it has fired."""

    def download(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Copy the device tensor ``src`` into the host tensor ``dst`` (same shape) on
        ``stream``, after the work queued there, and wait for it."""

    def samples(self, region: torch.Tensor, stride: int, count: int, stream: Stream) -> np.ndarray:
        """Bytes ``0, stride, ..., (count - 1) x stride`` of a flat uint8 device tensor, read
        on ``stream`` after the work queued there (a strided copy to the host, no kernel and
        no allocation on the device); waits for them."""

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        """``stream`` waits, on the device, for the work queued on ``other`` so far."""

    def event(self) -> DeviceEvent: ...


_cache: dict[bool, DeviceBackend] = {}
_lock = threading.Lock()


def fake_requested() -> bool:
    return os.environ.get(FAKE_ENV) == "1"


def backend() -> DeviceBackend:
    """This process's backend: the stand-in when ``TENSORSOCKET_FAKE_CUDA=1`` (read at each
    call), else the real one. One instance per process and mode, so ``open_count`` and the
    stand-in's per-thread streams are shared by every caller. Raises :class:`GpuPathError`
    when the real one cannot work here (no CUDA, no CuPy); that is not cached."""
    fake = fake_requested()
    with _lock:
        instance = _cache.get(fake)
        if instance is None:
            make: Callable[[], DeviceBackend]
            if fake:
                from .fake_cuda import FakeBackend as make
            else:
                why = no_cuda_reason()
                if why is not None:
                    raise GpuPathError(
                        f"the cuda transport needs a CUDA GPU: {why}. Install a CUDA build of torch and "
                        "pip install 'tensorsocket[gpu]' ('tensorsocket[gpu-cuda13]' for CUDA 13), or use "
                        "device='cpu' (host shared memory); tests can set TENSORSOCKET_FAKE_CUDA=1 for a CPU stand-in"
                    )
                from .cuda_real import RealBackend as make
            instance = _cache[fake] = make()
        return instance


def no_cuda_reason() -> str | None:
    """Why this torch cannot use a CUDA GPU here, or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "torch built for CUDA finds no usable GPU (driver, CUDA_VISIBLE_DEVICES, container?)"


def check_visible(device: torch.device) -> None:
    """A consumer's ``device``, if a GPU, is one this process sees; else GpuPathError saying
    why, as the Consumer is made. (Before, a host producer's batches failed to copy there in
    the I/O thread, after the producer had counted the consumer in: the stream ended for it
    with a ProducerLost blaming the producer.) Only torch is asked: copies from host memory
    need no CuPy."""
    if device.type != "cuda":
        return
    if fake_requested():
        seen = len(backend().visible_uuids())
    else:
        why = no_cuda_reason()
        if why is not None:
            raise GpuPathError(
                f"Consumer(device={str(device)!r}) needs a CUDA GPU: {why}; or use device='cpu'"
            )
        seen = torch.cuda.device_count()
    if (device.index or 0) >= seen:
        raise GpuPathError(
            f"Consumer(device={str(device)!r}) but this process sees {seen} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
