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

import torch

from .cuda_ipc import DeviceArena, _Mapping, _runtime
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
        consumers' mappings keep the memory valid until they close."""
        self.tensor = None  # type: ignore[assignment]
        self._arena.free()


class _Region:
    """The owner of one region's tensor: a CAI object that keeps the IPC mapping open."""

    def __init__(self, mapping: _Mapping, nbytes: int) -> None:
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
    """A producer's arena opened with ``cudaIpcOpenMemHandle``; the handle is closed when the
    mapping is closed and the last region's tensor is gone (``_Mapping.__del__``)."""

    def __init__(self, handle: bytes, size: int, ordinal: int) -> None:
        self.size = size
        self._ipc: _Mapping | None = _Mapping(handle, ordinal)
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
        if not torch.cuda.is_available():
            built = torch.version.cuda
            why = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if built is None
                else "torch built for CUDA finds no usable GPU (driver, CUDA_VISIBLE_DEVICES, container?)"
            )
            raise GpuPathError(
                f"the cuda transport needs a CUDA GPU: {why}. Install a CUDA build of torch and "
                "pip install 'tensorsocket[gpu]', or use device='cpu' (host shared memory); "
                "tests can set TENSORSOCKET_FAKE_CUDA=1 for a CPU stand-in"
            )
        try:
            _runtime()
        except RuntimeError as exc:
            raise GpuPathError(f"{exc}") from None
        self.open_count = 0
        self._lock = threading.Lock()

    def visible_uuids(self) -> list[str]:
        return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]

    def ordinal(self, uuid: str) -> int | None:
        uuids = self.visible_uuids()
        return uuids.index(uuid) if uuid in uuids else None

    def alloc(self, nbytes: int, ordinal: int) -> RealAllocation:
        return RealAllocation(nbytes, ordinal)

    def open(self, handle: bytes, size: int, ordinal: int) -> RealMapping:
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC memory handle has {HANDLE_BYTES} bytes, got {handle!r:.100}")
        mapping = RealMapping(handle, size, ordinal)
        with self._lock:
            self.open_count += 1
        return mapping

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_stream(self, ordinal: int) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=ordinal)

    def current_stream(self, ordinal: int) -> torch.cuda.Stream:
        return torch.cuda.current_stream(ordinal)

    def use_stream(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def event(self) -> torch.cuda.Event:
        # blocking=True: cudaEventBlockingSync, so synchronize() sleeps in the driver instead
        # of spinning a core; torch's Event.synchronize releases the GIL while it waits
        # (torch/csrc/cuda/Event.cpp, THCPEvent_synchronize: gil_scoped_release).
        return torch.cuda.Event(blocking=True)
