"""A CPU stand-in for the device primitives (``TENSORSOCKET_FAKE_CUDA=1``), so that CI, which
has no GPU, runs the whole ``cuda`` transport in real processes over real shared memory.

* GPUs: ``TENSORSOCKET_FAKE_CUDA_GPUS`` physical ones (default 2), UUID of physical ``i``
  ``GPU-00000000-0000-4000-8000-{i:012x}``, selected and ordered by ``CUDA_VISIBLE_DEVICES``
  as CUDA does (read once, when the backend is made, like CUDA at init).
* Memory: a /dev/shm file per allocation, named like the shm transport's segments
  (``tensorsocket-<uid>-<pid>-<token>-cuda<physical>-<n>``), so ``shm.sweep_stale()`` removes
  a dead owner's; the handle is the name, NUL-padded to 64 bytes. Consumers map it
  read-write, as GPU memory cannot be protected.
* Streams: a daemon worker thread per stream runs queued work in FIFO order; copies first
  sleep ``TENSORSOCKET_FAKE_CUDA_DELAY`` seconds (read when the stream is made), so a test
  can show that reading a place before its copy's event fired sees old bytes.
* Events: a marker queued on a stream, fired when the worker reaches it; one queued behind
  work that never finishes never fires, like a dead process's event on a GPU.

Every wait loops on a timeout: Ctrl-C works, and a worker exits soon after its stream is
collected.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import queue
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .cuda_ipc import ARENA_ALIGN
from .gpu_topology import GpuPathError
from .shm import _SEGMENT_NAME, PREFIX, SHM_DIR, _map

log = logging.getLogger("tensorsocket")

HANDLE_BYTES = 64
# tensorsocket-<uid>-<pid>-<token>-cuda<physical>-<serial>: five parts, as shm.sweep_stale() reads
_FAKE_NAME = re.compile(re.escape(PREFIX) + r"[0-9]+-[0-9]+-[0-9a-f]+-cuda([0-9]+)-[0-9]+")
_TICK = 0.1  # seconds: how often a blocked wait looks up (Ctrl-C, a collected stream)


def fake_uuid(physical: int) -> str:
    return f"GPU-00000000-0000-4000-8000-{physical:012x}"


def visible_physical(count: int, spec: str | None) -> list[int]:
    """The physical fake GPUs that CUDA_VISIBLE_DEVICES=``spec`` makes visible, in ordinal
    order (None: all). Like CUDA, parsing stops at the first entry that is not a valid,
    new device, so ``"1,x,0"`` means ``[1]``."""
    if spec is None:
        return list(range(count))
    uuids = [fake_uuid(i) for i in range(count)]
    visible: list[int] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit():
            index = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if entry.startswith("GPU-") and u.startswith(entry)]
            index = matches[0] if len(matches) == 1 else count
        if index >= count or index in visible:
            break
        visible.append(index)
    return visible


def _wait(marker: threading.Event, stop: threading.Event | None = None) -> None:
    while not marker.wait(_TICK):
        if stop is not None and stop.is_set():
            return


class FakeStream:
    """A FIFO of work run by a daemon worker thread, in order, one item at a time."""

    def __init__(self, ordinal: int, delay: float = 0.0) -> None:
        self.ordinal = ordinal
        self.delay = delay
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        # The worker holds the queue and stop flag, not the stream: a stream nobody holds is
        # collected, which stops its worker (and abandons whatever was still queued).
        worker = threading.Thread(
            target=_run, args=(self._queue, self._stop), name=f"fake-cuda-stream-{ordinal}", daemon=True
        )
        worker.start()
        finalizer = weakref.finalize(self, self._stop.set)
        finalizer.atexit = False

    def enqueue(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (a simulated kernel, say) behind everything queued so far."""
        self._queue.put(fn)


def _run(work: queue.SimpleQueue[Callable[[], None]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            fn = work.get(timeout=_TICK)
        except queue.Empty:
            continue
        try:
            fn()
        except Exception:  # like a faulting kernel: reported, and the stream goes on
            log.exception("work queued on a fake CUDA stream failed")
        del fn


class FakeEvent:
    """Fires when its stream's worker reaches the record; never recorded counts as fired."""

    def __init__(self) -> None:
        self._marker = threading.Event()
        self._marker.set()

    def record(self, stream: FakeStream) -> None:
        # A new marker per record: a late earlier record cannot fire the new one.
        marker = self._marker = threading.Event()
        stream.enqueue(marker.set)

    def synchronize(self) -> None:
        _wait(self._marker)

    def query(self) -> bool:
        return self._marker.is_set()


class FakeAllocation:
    """A /dev/shm file standing in for one device allocation."""

    def __init__(self, name: str, size: int, ordinal: int) -> None:
        self.name, self.size, self.ordinal = name, size, ordinal
        self.handle = name.encode("ascii").ljust(HANDLE_BYTES, b"\0")
        self.path = os.path.join(SHM_DIR, name)
        self._mm: mmap.mmap | None = _map(self.path, size, create=True)
        # Through NumPy as in shm.py: the array holds a buffer export, so mmap.close() refuses
        # while any view lives instead of unmapping under it.
        self.tensor = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8))
        self._lock = threading.Lock()

    def free(self) -> None:
        with self._lock:
            mm, self._mm = self._mm, None
            if mm is None:
                return
            self.tensor = None  # type: ignore[assignment]
            with contextlib.suppress(BufferError):  # else a view of ours lives: unmapped with it
                mm.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class FakeMapping:
    """An opened fake handle: the segment mapped read-write."""

    def __init__(self, path: str, size: int) -> None:
        self.size = size
        self._mm: mmap.mmap | None = _map(path, size, create=False)
        self.tensor: torch.Tensor | None = torch.from_numpy(np.frombuffer(self._mm, np.uint8, count=size))

    def region(self, nbytes: int) -> tuple[torch.Tensor, object]:
        if self._mm is None:
            raise RuntimeError("the mapping is closed")
        if not 0 <= nbytes <= self.size:
            raise ValueError(f"a region of {nbytes} bytes does not fit a mapping of {self.size}")
        # The array is the owner: torch.from_numpy keeps it (and it the mmap) alive for as
        # long as the tensor's storage lives, and every view, .view(dtype) or .numpy() of the
        # tensor shares that storage; so the array dies with the last of them.
        owner = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes)
        return torch.from_numpy(owner), owner

    def close(self) -> None:
        mm, self._mm, self.tensor = self._mm, None, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # else regions live: unmapped with the last
                mm.close()


class FakeBackend:
    """The stand-in backend; one per process (see :func:`device.backend`)."""

    fake = True

    def __init__(self) -> None:
        count = int(os.environ.get("TENSORSOCKET_FAKE_CUDA_GPUS", "2"))
        self._physical = visible_physical(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._token = secrets.token_hex(4)
        self._serial = itertools.count(1)
        self._local = threading.local()
        self.open_count = 0

    def visible_uuids(self) -> list[str]:
        return [fake_uuid(p) for p in self._physical]

    def ordinal(self, uuid: str) -> int | None:
        uuids = self.visible_uuids()
        return uuids.index(uuid) if uuid in uuids else None

    def _check(self, ordinal: int) -> int:
        if not 0 <= ordinal < len(self._physical):
            raise GpuPathError(f"no fake GPU has ordinal {ordinal} here {_visibility(self._physical)}")
        return self._physical[ordinal]

    def alloc(self, nbytes: int, ordinal: int) -> FakeAllocation:
        physical = self._check(ordinal)
        size = max(ARENA_ALIGN, -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN)
        name = f"{PREFIX}{os.getuid()}-{os.getpid()}-{self._token}-cuda{physical}-{next(self._serial)}"
        return FakeAllocation(name, size, ordinal)

    def free_memory(self, ordinal: int) -> int:
        self._check(ordinal)
        return shutil.disk_usage(SHM_DIR).free

    def open(self, handle: bytes, size: int, ordinal: int) -> FakeMapping:
        name, physical = _handle_name(handle)
        self._check(ordinal)
        if physical not in self._physical:
            raise GpuPathError(
                f"the arena {name} is on {fake_uuid(physical)}, not visible here {_visibility(self._physical)}"
            )
        mapping = FakeMapping(os.path.join(SHM_DIR, name), size)
        self.open_count += 1
        return mapping

    def new_stream(self, ordinal: int) -> FakeStream:
        self._check(ordinal)
        return FakeStream(ordinal, float(os.environ.get("TENSORSOCKET_FAKE_CUDA_DELAY", "0") or 0))

    def _current(self) -> dict[int, FakeStream]:
        return self._local.__dict__.setdefault("current", {})

    def current_stream(self, ordinal: int) -> FakeStream:
        streams = self._current()
        stream = streams.get(ordinal)
        if stream is None:
            stream = streams[ordinal] = self.new_stream(ordinal)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        streams = self._current()
        previous = streams.get(stream.ordinal)
        streams[stream.ordinal] = stream
        try:
            yield stream
        finally:
            if previous is None:
                streams.pop(stream.ordinal, None)
            else:
                streams[stream.ordinal] = previous

    def copy(self, dst: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], stream: FakeStream) -> None:
        # Bounds errors surface here, at enqueue time, as copy_ raises them on a GPU. The
        # stand-in cannot tell a loader's "device" tensors from host ones, so it always
        # orders the copies after the caller's current stream, as a GPU source needs.
        for offset, src in pieces:
            if src.dim() != 1 or not 0 <= offset <= offset + src.shape[0] <= dst.shape[0]:
                raise RuntimeError(
                    f"cannot copy {tuple(src.shape)} bytes to offset {offset} of {tuple(dst.shape)}"
                )
        self.wait_stream(stream, self.current_stream(stream.ordinal))
        delay = stream.delay

        def run() -> None:
            if delay:
                time.sleep(delay)
            for offset, src in pieces:
                dst[offset : offset + src.shape[0]].copy_(src)

        stream.enqueue(run)

    def download(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        self._run_and_wait(stream, lambda: dst.copy_(src))

    def samples(self, region: torch.Tensor, stride: int, count: int, stream: FakeStream) -> np.ndarray:
        return self._run_and_wait(
            stream, lambda: region.numpy()[: max(count - 1, 0) * stride + 1 : stride][:count].copy()
        )

    @staticmethod
    def _run_and_wait(stream: FakeStream, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on ``stream`` after the work queued there; wait for and return its result."""
        out: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                out.append(fn())
            finally:
                done.set()

        stream.enqueue(run)
        _wait(done)
        if not out:
            raise RuntimeError("work queued on a fake CUDA stream failed (logged above)")
        return out[0]

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        marker = threading.Event()
        other.enqueue(marker.set)
        stop = stream._stop  # the waiting worker gives up when its own stream is collected
        stream.enqueue(lambda: _wait(marker, stop))

    def event(self) -> FakeEvent:
        return FakeEvent()


def _visibility(physical: list[int]) -> str:
    return f"({len(physical)} fake GPUs visible, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"


def _handle_name(handle: bytes) -> tuple[str, int]:
    """The segment name in a fake handle and its physical GPU, checked strictly: a hostile or
    confused producer must not make a consumer map some other file of its user's."""
    if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
        raise ValueError(f"a fake CUDA handle has {HANDLE_BYTES} bytes, got {handle!r:.100}")
    name = handle.rstrip(b"\0").decode("ascii", "replace")
    match = _FAKE_NAME.fullmatch(name)
    if match is None or not _SEGMENT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"the handle {name!r:.100} does not name a fake CUDA arena ({PREFIX}*) in {SHM_DIR}")
    return name, int(match.group(1))
