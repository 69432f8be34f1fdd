"""The real device primitives (see :mod:`.device`): torch for streams, events, copies and
pinned memory; CuPy's runtime bindings (through :mod:`.cuda_ipc`) for the allocations and
their IPC handles, never on the per-batch path.

Consumer views go through ``__cuda_array_interface__`` (CAI) rather than DLPack because
torch's import of a CAI object keeps exactly that object alive for as long as the storage
lives, and nothing else: ``torch/csrc/utils/tensor_numpy.cpp``,
``tensor_from_cuda_array_interface``, does ``Py_INCREF(obj)`` and builds the tensor with
``at::from_blob(data_ptr, sizes, strides, [obj](void*) { gil_scoped_acquire; Py_DECREF(obj); },
...)``. Slices, ``.view(dtype)`` and reshapes share that storage, so the owner object dies
with the last of them, and a ``weakref.finalize`` on it is the release signal. The same
function reads only ``shape``, ``typestr``, ``data`` and ``strides``: the ``stream`` key is
ignored by torch; we set it to None, which CAI v3 defines as "no synchronization needed"
(ordering is ours: the consumer only sees a batch after its write has completed).

``from_blob`` takes the tensor's device from the pointer (``getDeviceFromPtr``, i.e.
``cudaPointerGetAttributes``), and ``torch.as_tensor`` then moves it to the ``device``
argument, copying if they differ (and, on old torch without one, to the CPU: pytorch issue
54139). So we pass the pointer's own device and check that no copy was made.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .cuda_ipc import Borrowed, DeviceArena, _Mapping, _runtime, opened
from .gpu_topology import GpuPathError

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class RealAllocation:
    """One ``cudaMalloc``'d arena (2 MiB aligned) and its IPC handle."""

    def __init__(self, nbytes: int, ordinal: int) -> None:
        self._arena = DeviceArena(nbytes, ordinal)
        self.size = self._arena.size
        self.handle = self._arena.handle
        self.ordinal = ordinal
        self.tensor = self._arena.tensor

    def free(self) -> None:
        """``cudaFree`` (which waits for the device). The producer's own views must be gone;
        consumers may still map it (see :meth:`.cuda_ipc.DeviceArena.free`)."""
        self.tensor = None  # type: ignore[assignment]
        self._arena.free()


class _Region:
    """The owner of one region's tensor: a CAI object that keeps the IPC mapping open."""

    def __init__(self, mapping: _Mapping | Borrowed, nbytes: int) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "version": 3,
            "typestr": "|u1",
            "shape": (nbytes,),
            "strides": None,
            "data": (mapping.ptr, False),
            "stream": None,
        }


class RealMapping:
    """A producer's arena opened with ``cudaIpcOpenMemHandle`` (or borrowed, in the
    producer's own process); the handle is closed when the mapping is closed and the last
    region's tensor is gone (``_Mapping.__del__``, ``Borrowed.__del__``)."""

    def __init__(self, handle: bytes, size: int, ordinal: int) -> None:
        self.size = size
        self._ipc: _Mapping | Borrowed | None = opened(handle, ordinal)
        # Opened in ordinal's context; on another GPU than the memory's (peer access), the
        # tensor's device is the memory's: ask the driver rather than assume.
        self._device = torch.device("cuda", _runtime().pointerGetAttributes(self._ipc.ptr).device)
        self.tensor: torch.Tensor | None = self.region(size)[0]

    def region(self, nbytes: int) -> tuple[torch.Tensor, object]:
        ipc = self._ipc
        if ipc is None:
            raise RuntimeError("the mapping is closed")
        if not 0 <= nbytes <= self.size:
            raise ValueError(f"a region of {nbytes} bytes does not fit a mapping of {self.size}")
        owner = _Region(ipc, nbytes)
        tensor = torch.as_tensor(owner, device=self._device)
        if tensor.data_ptr() != ipc.ptr or tensor.device != self._device:
            raise RuntimeError(
                f"torch copied the mapped arena instead of viewing it ({tensor.device}, "
                f"{tensor.data_ptr():#x} vs {self._device}, {ipc.ptr:#x})"
            )
        return tensor, owner

    def close(self) -> None:
        self.tensor = None
        self._ipc = None


class RealBackend:
    """torch + CuPy on a real NVIDIA GPU."""

    fake = False

    def __init__(self) -> None:
        """Made by :func:`.device.backend`, which first checks that torch can use CUDA here."""
        try:
            _runtime()
        except RuntimeError as exc:
            raise GpuPathError(f"{exc}") from None
        self.open_count = 0
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}
        self._own: dict[int, torch.cuda.ExternalStream] = {}
        self._local = threading.local()  # each thread's pinned buffer for fingerprint samples

    def visible_uuids(self) -> list[str]:
        return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]

    def ordinal(self, uuid: str) -> int | None:
        uuids = self.visible_uuids()
        return uuids.index(uuid) if uuid in uuids else None

    def alloc(self, nbytes: int, ordinal: int) -> RealAllocation:
        return RealAllocation(nbytes, ordinal)

    def free_memory(self, ordinal: int) -> int:
        return torch.cuda.mem_get_info(ordinal)[0]

    def open(self, handle: bytes, size: int, ordinal: int) -> RealMapping:
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC memory handle has {HANDLE_BYTES} bytes, got {handle!r:.100}")
        mapping = RealMapping(handle, size, ordinal)
        with self._lock:
            self.open_count += 1
        return mapping

    def new_stream(self, ordinal: int) -> torch.cuda.ExternalStream:
        # One raw non-blocking stream per device, made once and kept for the process's life
        # (as torch keeps its own): torch.cuda.Stream() would make torch create its stream
        # pool on the device, measured at 70 MiB of GPU memory per process on an H100. Work
        # on it is ordered by events, so the stores and readers of a process can share it.
        with self._lock:
            stream = self._own.get(ordinal)
            if stream is None:
                runtime = _runtime()
                with torch.cuda.device(ordinal):
                    raw = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
                stream = self._own[ordinal] = torch.cuda.ExternalStream(
                    raw, device=torch.device("cuda", ordinal)
                )
        return stream

    def current_stream(self, ordinal: int) -> torch.cuda.Stream:
        # Per batch, in the training thread: the raw (id, device, type) triple and a dict
        # lookup, instead of torch.cuda.current_stream's Python layers (~4 us warm, ~50 us
        # after a sleep on a VM).
        key = _current_stream_key(ordinal)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) > 64:  # streams made and dropped by the user: forget them
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        return stream

    def use_stream(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def copy(
        self, dst: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], stream: torch.cuda.Stream
    ) -> None:
        if any(src.is_cuda for _, src in pieces):
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for offset, src in pieces:
                dst[offset : offset + src.shape[0]].copy_(src, non_blocking=True)

    def download(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src)  # blocking: synchronizes the stream once the copy is queued

    def samples(self, region: torch.Tensor, stride: int, count: int, stream: torch.cuda.Stream) -> np.ndarray:
        buffer = getattr(self._local, "samples", None)
        if buffer is None or buffer.shape[0] < count:
            buffer = self._local.samples = torch.empty(
                max(count, 1 << 11), dtype=torch.uint8, pin_memory=True
            )
        if count:
            runtime = _runtime()
            with torch.cuda.device(region.device):
                runtime.memcpy2DAsync(
                    buffer.data_ptr(), 1, region.data_ptr(), stride, 1, count,
                    runtime.memcpyDeviceToHost, stream.cuda_stream,
                )  # fmt: skip
                runtime.streamSynchronize(stream.cuda_stream)
        return buffer.numpy()[:count].copy()

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def event(self) -> torch.cuda.Event:
        # blocking=True: cudaEventBlockingSync, so synchronize() sleeps in the driver instead
        # of spinning a core; torch's Event.synchronize releases the GIL while it waits
        # (torch/csrc/cuda/Event.cpp, THCPEvent_synchronize: gil_scoped_release).
        return torch.cuda.Event(blocking=True)


_get_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)


def _current_stream_key(ordinal: int) -> tuple[int, int, int]:
    """(stream id, device index, device type) of this thread's current stream: what
    ``torch.cuda.current_stream`` reads, without its Python layers."""
    if _get_current_stream is None:  # pragma: no cover - a torch without it
        stream = torch.cuda.current_stream(ordinal)
        return stream.stream_id, stream.device_index, stream.device_type
    return tuple(_get_current_stream(ordinal))  # type: ignore[return-value]
