"""GPU memory shared by CUDA IPC: each place is one device allocation that every consumer on
the machine opens once and reads in place.

Producer (:class:`CudaStore`). Each leaf is copied into the place at its aligned offset on
the producer's own stream: host leaves straight from the loader's memory (no staging copy of
our own: measured on an H100, staging a 256 MiB batch through a pinned buffer cost ~50 ms of
producer CPU for a 5 ms transfer), leaves the loader made on the GPU device to device after
the work that made them (the loader's tensors are never exported, and stay referenced until
the copy is done). The write's receipt waits for an event recorded after the copies
(blocking sync, no spin), and the producer announces a batch only then: *announce after
completion*. So no consumer stream ever waits on a producer event, and a producer that dies
cannot leave a consumer's GPU waiting forever (measured on an H100: a stream wait on a dead
process's event never fires).

Consumer (:class:`CudaReader`). Devices are matched by GPU UUID, never by ordinal (each
process's CUDA_VISIBLE_DEVICES numbers them its own way). On the producer's GPU a batch is
views of the mapped memory; on another GPU or ``device="cpu"``, a copy there (peer access or
staged through the host, as the driver allows), released at once. When a batch's last view
dies, an event is recorded on the stream its work was queued on (the current stream when it
was handed out, or ``Consumer(stream=...)``); a waiter thread synchronizes it (blocking,
no spin) and only then is the place released, so the producer never overwrites memory a
queued kernel still reads, and never waits on a consumer's event either.

GPU memory cannot be write-protected, so in-place writes are caught by the fingerprint: the
producer once its copies are done, the consumer at release, each copies the same ~1 KiB of
sampled bytes to the host with one strided copy on a stream of its own (no kernel, no device
allocation: ~14 us on an H100, against ~43 us and 2 MiB of caching-allocator memory for
torch ops) and applies the host formula (``fingerprints.of_samples``).

``TENSORSOCKET_TEST_UNORDERED=announce|release|1`` (tests only) skips the producer's wait, the
consumer's, or both, to show each is needed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import fingerprints, layout
from ..errors import ProtocolError
from ..host import boot_id
from . import device as devices
from .base import Lease, Reader, Receipt, Room, Store, check_descriptor, grown_size
from .cuda_ipc import ARENA_ALIGN
from .gpu_topology import GpuPathError

if TYPE_CHECKING:
    from .shm import ShmStore

log = logging.getLogger("tensorsocket")

KIND = "cuda"
MIRROR_KIND = "shm"  # what a consumer that cannot open CUDA IPC handles reads instead
_HANDLE_BYTES = 64
_WAITER_JOIN_S = 10.0  # its waits are on this process's own streams: they end


def _ordered(wait: str) -> bool:
    """False when a test disabled this wait ("announce", "release", or "1": both)."""
    return os.environ.get("TENSORSOCKET_TEST_UNORDERED") not in ("1", wait)


class _Write(Receipt):
    """Copies in flight on the producer's stream; ``plan`` holds their sources until they are
    done. Then the fingerprint's samples are copied to the host on the same stream (no kernel,
    no device allocation), and the batch is written to the host mirror if there is one.
    Waiting on the event sleeps in the driver with the GIL released."""

    def __init__(self, store: CudaStore, place: int, plan: layout.Plan) -> None:
        super().__init__(None)
        self._store, self._place, self._plan = store, place, plan
        self._event = store._event
        self._region = store._arenas[place].tensor[: plan.nbytes]

    def wait(self) -> int | None:
        store, region, self._region = self._store, self._region, None
        if not _ordered("announce"):  # (tests) reading the samples would wait for the copies too
            return None
        self._event.synchronize()
        with store._mirror_lock:
            if store._mirror is not None:
                store._mirror.write(self._place, self._plan, False)  # (the fingerprint is taken here)
        self._plan = None  # type: ignore[assignment]
        return _fingerprint(store._dev, region, region.shape[0], store._stream)


def _fingerprint(dev: Any, region: torch.Tensor, nbytes: int, stream: Any) -> int:
    """``fingerprints.of`` of the first ``nbytes`` of a device region, read on ``stream``."""
    stride, count = fingerprints.sampling(nbytes)
    return fingerprints.of_samples(dev.samples(region, stride, count, stream), nbytes)


class CudaStore(Store):
    """Producer side: one device allocation per place, on ``cuda:<ordinal>``."""

    kind = KIND

    def __init__(self, ordinal: int | None) -> None:
        self._dev = devices.backend()
        uuids = self._dev.visible_uuids()
        if not uuids:
            raise GpuPathError("device='cuda' but this process sees no CUDA GPU: check CUDA_VISIBLE_DEVICES")
        if ordinal is None:
            ordinal = _current_ordinal(self._dev)
        if not 0 <= ordinal < len(uuids):
            raise ValueError(f"device='cuda:{ordinal}' but this process sees {len(uuids)} GPU(s)")
        if self._dev.fake:
            from .shm import sweep_stale

            sweep_stale()  # the stand-in's arenas are shared-memory segments
        self.ordinal = ordinal
        self.gpu = uuids[ordinal]
        self.device = f"cuda:{ordinal}"
        self.bytes = 0
        self._stream = self._dev.new_stream(ordinal)
        self._event = self._dev.event()  # one: each write is waited for before the next
        self._arenas: dict[int, Any] = {}
        self._closed = False
        # A host copy of every place for consumers that cannot open CUDA IPC handles (another
        # PID namespace): made when the first one joins, written after each GPU write.
        self._mirror: ShmStore | None = None
        self._mirror_lock = threading.Lock()

    def prepare(self, place: int, nbytes: int) -> tuple[int, Any] | None:
        if self._closed:
            raise RuntimeError("the cuda store is closed")
        current = self._arenas.get(place)
        if current is not None and current.size >= nbytes:
            return None
        return place, self._dev.alloc(grown_size(current.size if current else None, nbytes), self.ordinal)

    def room(self, nbytes: int) -> Room:
        """How many more arenas for ``nbytes`` the GPU can allocate now, so a window or replay
        budget that does not fit is known at the first batch rather than as an out-of-memory
        error some batches later (and the trainers on that GPU need memory too)."""
        size = max(ARENA_ALIGN, -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN)  # as an allocation rounds
        free = self._dev.free_memory(self.ordinal)
        where = f"{self.device} ({'the CPU stand-in, in /dev/shm' if self._dev.fake else self.gpu})"
        remedy = (
            "free memory on that GPU (its other processes use it too), or serve from host shared memory "
            "(device='cpu')"
        )
        return Room(free // size, size, free, where, remedy)

    def held(self) -> tuple[int, int]:
        return len(self._arenas), max((a.size for a in self._arenas.values()), default=0)

    def region(self, place: int) -> torch.Tensor:
        return self._arenas[place].tensor

    def install(self, prepared: tuple[int, Any]) -> list[list[Any]]:
        place, allocation = prepared
        if self._closed:
            allocation.free()
            raise RuntimeError("the cuda store is closed")
        current = self._arenas.pop(place, None)
        if current is not None:
            self.bytes -= current.size
            current.free()  # (consumers may still map it: see DeviceArena.free)
        self._arenas[place] = allocation
        self.bytes += allocation.size
        descriptors = [self._descriptor(place, allocation)]
        if self._mirror is not None:
            descriptors += self._mirror_place(self._mirror, place, allocation)
        return descriptors

    def _descriptor(self, place: int, allocation: Any) -> list[Any]:
        return [KIND, place, allocation.handle, allocation.size, self.gpu]

    def describe(self) -> list[list[Any]]:
        mirrored = [] if self._mirror is None else self._mirror.describe()
        return [self._descriptor(place, a) for place, a in self._arenas.items()] + mirrored

    def admit(self, hello: dict[str, Any], local: bool) -> str:
        if hello["boot_id"] != boot_id():
            raise ProtocolError(
                "consumer runs on another machine: GPU batches are shared within one machine only"
            )
        if local:
            return KIND
        if self._mirror is None:
            self._start_mirror()
        log.warning(
            "consumer %r (pid %s) runs in another PID namespace (another container?), where CUDA IPC "
            "handles cannot be opened: it reads a host shared-memory copy of every batch",
            hello["label"],
            hello["pid"],
        )
        return MIRROR_KIND

    def _start_mirror(self) -> None:
        """Mirror every place to host shared memory from now on (under the producer's lock).
        The mirror is visible to writes before the places are copied, so each place's bytes
        are right whichever comes first: a write that waited before sees no mirror, but its
        copy completed before this one's download is queued on the same stream; one that waits
        after writes the mirror itself."""
        from .shm import ShmStore

        with self._mirror_lock:
            mirror = self._mirror = ShmStore()
            for place, allocation in self._arenas.items():
                self._mirror_place(mirror, place, allocation)
                self._dev.download(mirror.region(place)[: allocation.size], allocation.tensor, self._stream)

    @staticmethod
    def _mirror_place(mirror: ShmStore, place: int, allocation: Any) -> list[list[Any]]:
        prepared = mirror.prepare(place, allocation.size)
        return [] if prepared is None else mirror.install(prepared)

    def write(self, place: int, plan: layout.Plan, fingerprint: bool = True) -> Receipt:
        """Queue one copy per leaf into the place on the producer's stream: host leaves
        straight from the loader's memory (asynchronous when it is pinned, as a DataLoader
        with pin_memory=True makes it; the driver stages pageable memory itself), GPU leaves
        device to device after the work that made them. The fingerprint is always taken: a
        consumer cannot map GPU memory read-only, so every GPU consumer checks it."""
        if self._closed:
            raise RuntimeError("the cuda store is closed")
        dst = self._arenas[place].tensor
        pieces = [
            (leaf.offset, layout.leaf_bytes(src))
            for leaf, src in zip(plan.leaves, plan.sources, strict=True)
            if leaf.nbytes
        ]
        self._dev.copy(dst, pieces, self._stream)
        self._event.record(self._stream)
        return _Write(self, place, plan)

    def close(self) -> None:
        self._closed = True
        for allocation in self._arenas.values():
            allocation.free()
        self._arenas.clear()
        self.bytes = 0
        with self._mirror_lock:
            if self._mirror is not None:
                self._mirror.close()


class _Use:
    """A leased region's token: its mapping (kept open until the release check) and the
    stream the user's work on it was queued on."""

    __slots__ = ("mapping", "stream")

    def __init__(self, mapping: Any) -> None:
        self.mapping = mapping
        self.stream: Any = None


class CudaReader(Reader):
    """Consumer side: opens each place's handle once, on the producer's GPU as this process
    numbers it, and leases regions of it."""

    kind = KIND

    def __init__(self, gpu: str | None, device: torch.device, stream: Any = None) -> None:
        self._dev = devices.backend()
        source = self._dev.ordinal(gpu) if gpu else None
        if source is None:
            raise GpuPathError(
                f"the producer's GPU {gpu} is not visible to this process "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): make it visible "
                "to read its batches, or serve them from host memory with Producer(device='cpu')"
            )
        if stream is not None and not isinstance(stream, type(self._dev.current_stream(source))):
            raise ValueError(f"stream must be a CUDA stream (torch.cuda.Stream) or None, got {stream!r}")
        self.gpu, self._source, self.stream = gpu, source, stream
        if device.type == "cuda":
            target = device.index if device.index is not None else _current_ordinal(self._dev)
            self._views = target == source
            self._target = torch.device("cuda", target)
        elif device.type == "cpu":
            self._views, self._target = False, device
        else:
            raise ValueError(f"device={str(device)!r}: GPU batches can go to 'cpu' or a 'cuda' device")
        self.delivery = "views" if self._views else "copy"
        self._infos: dict[int, tuple[bytes, int]] = {}
        self._maps: dict[int, Any] = {}
        self._side = self._dev.new_stream(source)  # for fingerprints: never behind the user's work
        self._retired: queue.SimpleQueue[tuple[Any, Callable[[], None]] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def announce(self, descriptor: list[Any]) -> None:
        _, place, handle, size, gpu = check_descriptor(descriptor, KIND, (bytes, int, str))
        if len(handle) != _HANDLE_BYTES or not 0 < size <= 1 << 48 or gpu != self.gpu:
            raise ProtocolError(f"bad {KIND} arena descriptor for place {place}")
        if self._infos.get(place) != (handle, size):
            self._infos[place] = (handle, size)
            old = self._maps.pop(place, None)
            if old is not None:
                old.close()  # unmapped once the last region leased from it is gone

    def size(self, place: int) -> int:
        return self._infos[place][1]

    def lease(self, place: int, nbytes: int) -> Lease:
        info = self._infos.get(place)
        if info is None:  # (a KeyError said only the number)
            raise ProtocolError(f"BATCH names place {place}, whose arena was never announced")
        handle, size = info
        if not 0 <= nbytes <= size:
            raise ValueError(f"region of {nbytes} bytes does not fit place {place}'s arena ({size})")
        mapping = self._maps.get(place)
        if mapping is None:
            mapping = self._maps[place] = self._dev.open(handle, size, self._source)
        region, owner = mapping.region(nbytes)
        return Lease(region, owner, _Use(mapping))

    def deliver(self, views: Any, copy: bool) -> Any:
        if self._views:
            return layout.map_tensors(views, torch.clone) if copy else views
        if self._dev.fake:  # the stand-in's "GPUs" are host memory: a copy is a clone
            return layout.map_tensors(views, torch.clone)
        return layout.map_tensors(views, lambda t: t.to(self._target))

    def handed_out(self, token: _Use) -> None:
        token.stream = self.stream if self.stream is not None else self._dev.current_stream(self._source)

    def retire(self, token: _Use, then: Callable[[], None]) -> None:
        if self._closed:  # the consumer left: nothing to release, and no CUDA work at exit
            return
        if not _ordered("release"):
            then()
            return
        stream = token.stream if token.stream is not None else self._dev.current_stream(self._source)
        event = self._dev.event()
        event.record(stream)
        self._retired.put((event, then))
        if self._waiter is None:
            with self._lock:
                if self._waiter is None:
                    self._waiter = threading.Thread(
                        target=_wait_then_release,
                        args=(self._retired,),
                        name="tensorsocket-release",
                        daemon=True,
                    )
                    self._waiter.start()

    def fingerprint(self, token: _Use, nbytes: int) -> int:
        return _fingerprint(self._dev, token.mapping.tensor, nbytes, self._side)

    def close(self) -> None:
        """Forget the arenas and stop the release waiter, waiting (boundedly) for it: a daemon
        thread still inside a CUDA call when the interpreter exits aborts the process
        ("terminate called without an active exception")."""
        self._closed = True
        self._retired.put(None)
        if self._waiter is not None:
            self._waiter.join(timeout=_WAITER_JOIN_S)
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
        self._infos.clear()


def _wait_then_release(retired: queue.SimpleQueue[tuple[Any, Callable[[], None]] | None]) -> None:
    """The release waiter: each retired region is released once the work queued on it ran.
    The waits are on this process's own streams, which always progress."""
    while True:
        item = retired.get()
        if item is None:
            return
        event, then = item
        event.synchronize()
        then()


def _current_ordinal(backend: Any) -> int:
    """The device "cuda" without an index means: torch's current device (the stand-in's 0)."""
    return 0 if backend.fake else torch.cuda.current_device()


def mig_reason(ordinal: int | None) -> str | None:
    """Why this GPU cannot share memory by CUDA IPC (MIG mode), or None. Needs nvidia-ml-py;
    without it the GPU is taken to be shareable (the cuda path then fails loudly if not)."""
    backend = devices.backend()
    if backend.fake:
        return None
    from . import gpu_topology

    uuids = backend.visible_uuids()
    index = _current_ordinal(backend) if ordinal is None else ordinal
    if not 0 <= index < len(uuids):
        return None  # CudaStore names the problem
    try:
        facts = gpu_topology.read_gpu(uuids[index])
    except GpuPathError as exc:
        log.debug("cannot check the GPU for MIG mode: %s", exc)
        return None
    return gpu_topology.producer_transport(facts)[1]
