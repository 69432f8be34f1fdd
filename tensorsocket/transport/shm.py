"""Host shared-memory arenas: the producer creates and unlinks them, consumers only map them.

Ownership: a segment is created by exactly one producer process and named
``tensorsocket-<uid>-<pid>-<token>-<place>-<generation>`` in /dev/shm. The producer unlinks
its segments at close; because ``atexit`` does not run on SIGKILL, every producer also
sweeps, at start, the segments of its own uid whose owner pid is gone. Consumers open a
segment once per (place, generation), map it shared, and never unlink it; a mapping stays
valid after the name is unlinked, so views a user still holds never dangle.

We use files under /dev/shm with ``mmap`` rather than ``multiprocessing.shared_memory``:
on Python < 3.13 attaching a SharedMemory registers it with the resource tracker, which
unlinks the producer's segment when a consumer exits (CPython gh-82300).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import fingerprints, layout
from ..errors import ProtocolError
from ..host import boot_id, pid_alive
from .base import Lease, Reader, Receipt, Room, Store, check_descriptor, grown_size

log = logging.getLogger("tensorsocket")

KIND = "shm"
SHM_DIR = "/dev/shm"
PREFIX = "tensorsocket-"
_PAGE = mmap.PAGESIZE
# Linux's number, where Python has no name for it
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_PIECE = 16 << 20  # bytes populated per madvise() call (a multiple of the page size)
# What a consumer accepts as an announced segment name: one file directly in SHM_DIR.
_SEGMENT_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_.-]{1,200}")


@dataclass(frozen=True)
class ArenaInfo:
    """What a consumer needs to open an arena: its place, segment name and size in bytes."""

    place: int
    name: str
    size: int

    def encode(self) -> list[Any]:
        return [KIND, self.place, self.name, self.size]

    @classmethod
    def decode(cls, descriptor: Any) -> ArenaInfo:
        _, place, name, size = check_descriptor(descriptor, KIND, (str, int))
        if len(name) > 255 or not 0 <= size <= 1 << 48:
            raise ProtocolError(f"bad {KIND} arena descriptor {descriptor!r:.120}")
        return cls(place, name, size)


def _owner_pid(name: str) -> int | None:
    parts = name[len(PREFIX) :].split("-")
    if len(parts) != 5 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[1]) if int(parts[0]) == os.getuid() else None


def sweep_stale() -> list[str]:
    """Unlink segments of this uid whose owner process is dead; return their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = _owner_pid(name)
        if pid is None or pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d stale shared-memory segments of dead producers", len(removed))
    return removed


def _arena_size(current: int | None, nbytes: int) -> int:
    """The bytes of a new arena for ``nbytes`` replacing one of ``current`` bytes (or none):
    the shared growth rule, in whole pages."""
    return (grown_size(current, nbytes) + _PAGE - 1) // _PAGE * _PAGE


def _map(path: str, size: int, create: bool, writable: bool = True) -> mmap.mmap:
    """Map a segment shared; ``writable=False`` maps it read-only (``PROT_READ``), so a write
    through any view of it faults in the writer instead of changing everyone's batch."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            # Reserve the pages now: on a full /dev/shm, ftruncate succeeds and the first
            # write then kills the process with SIGBUS; this raises ENOSPC instead.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                raise OSError(
                    exc.errno, f"cannot allocate {size} bytes of shared memory in {SHM_DIR}: {exc.strerror}"
                ) from None
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"shared-memory segment {path} is smaller than announced ({size} bytes)")
        # Take the page faults now, once, instead of on the first write (in the producer) or
        # the first read (in a training step); for 64 MiB that is ~100 ms.
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        if create:
            # A new segment we are about to write: MADV_POPULATE_WRITE (Linux 5.14) made a
            # 19 MB one in 11.3 ms of CPU against MAP_POPULATE's 14.0, the copy after it the
            # same (benchmarks.new_place).
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
            try:
                # A piece at a time: madvise() holds the GIL, and a 2 GiB segment took ~1 s
                # here, during which the I/O thread sent no heartbeat (a consumer with a short
                # timeout gave the producer up for lost).
                for start in range(0, size, _POPULATE_PIECE):
                    mm.madvise(_MADV_POPULATE_WRITE, start, min(_POPULATE_PIECE, size - start))
                return mm
            except OSError:  # an older kernel: MAP_POPULATE below
                mm.close()
        return mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot)
    finally:
        os.close(fd)


class _Arena:
    """One producer-owned segment and a flat uint8 tensor over it."""

    def __init__(self, info: ArenaInfo) -> None:
        self.info = info
        self.path = os.path.join(SHM_DIR, info.name)
        self.mm = _map(self.path, info.size, create=True)
        # The tensor goes through NumPy on purpose: a NumPy array holds a buffer export, so
        # mmap.close() refuses while any view lives; torch.frombuffer holds none, and an
        # unmap under a live tensor is a segfault.
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)

    def close(self) -> None:
        # Drop our own views first; mmap.close() refuses while buffers are exported.
        self.tensor = self.array = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def room(nbytes: int) -> Room | None:
    """How many more shared-memory arenas for ``nbytes`` fit in /dev/shm now; None if unknown."""
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        return None
    size = _arena_size(None, nbytes)
    remedy = (
        "give the container more shared memory (docker run --shm-size=..., Kubernetes: an emptyDir "
        "with medium: Memory)"
    )
    return Room(free // size, size, free, SHM_DIR, remedy)


class ShmStore(Store):
    """Producer side: one arena per place, allocated when first needed.

    A place's arena grows (a new segment and name, the old one unlinked) when a batch larger
    than it arrives; :meth:`install` returns the new descriptor so the caller can announce it
    before the batch that uses it.
    """

    kind = KIND

    def __init__(self) -> None:
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(
                f"{SHM_DIR} does not exist: the host shared-memory transport needs Linux POSIX shared memory"
            )
        sweep_stale()
        self._token = secrets.token_hex(4)
        self._arenas: dict[int, _Arena] = {}
        self._closed = False
        self._generation = 0
        self.bytes = 0

    def describe(self) -> list[list[Any]]:
        return [a.info.encode() for a in self._arenas.values()]

    def admit(self, hello: dict[str, Any], local: bool) -> str:
        if not local and hello["boot_id"] != boot_id():
            raise ProtocolError(
                "consumer runs on another host; host shared memory needs consumers on the producer's machine"
            )
        return self.kind

    def prepare(self, place: int, nbytes: int) -> _Arena | None:
        """A new, larger arena for ``place`` if it cannot hold ``nbytes`` (else None), not yet
        in use. Allocating is slow (pages are reserved and mapped), so the producer calls this
        outside its lock and :meth:`install` under it."""
        if self._closed:
            raise RuntimeError("the shared-memory store is closed")
        current = self._arenas.get(place)
        if current is not None and current.info.size >= nbytes:
            return None
        size = _arena_size(current.info.size if current else None, nbytes)
        self._generation += 1
        name = f"{PREFIX}{os.getuid()}-{os.getpid()}-{self._token}-{place}-{self._generation}"
        return _Arena(ArenaInfo(place, name, size))

    def install(self, prepared: _Arena) -> list[list[Any]]:
        """Put a prepared arena in its place, unlinking the one it replaces; its descriptor."""
        if self._closed:
            prepared.close()
            raise RuntimeError("the shared-memory store is closed")
        current = self._arenas.get(prepared.info.place)
        if current is not None:
            self.bytes -= current.info.size
            current.close()
        self._arenas[prepared.info.place] = prepared
        self.bytes += prepared.info.size
        return [prepared.info.encode()]

    def held(self) -> tuple[int, int]:
        return len(self._arenas), max((a.info.size for a in self._arenas.values()), default=0)

    def room(self, nbytes: int) -> Room | None:
        """How many more arenas for ``nbytes`` fit in /dev/shm now (a container's is often
        64 MiB: better to know at the first batch than to hit ENOSPC a few batches later)."""
        return room(nbytes)

    def region(self, place: int) -> torch.Tensor:
        """``place``'s whole arena, flat uint8 (a GPU store fills its host mirror through it)."""
        return self._arenas[place].tensor

    def write(self, place: int, plan: layout.Plan, fingerprint: bool = True) -> Receipt:
        """Write a planned batch into ``place`` (already prepared); done when this returns.
        Its fingerprint only if asked: a consumer that maps batches read-only needs none."""
        if self._closed:
            raise RuntimeError("the shared-memory store is closed")
        arena = self._arenas[place]
        layout.write(plan, arena.tensor)
        return Receipt(fingerprints.of(arena.array[: plan.nbytes]) if fingerprint else None)

    def fingerprint(self, place: int, nbytes: int) -> int | None:
        return fingerprints.of(self._arenas[place].array[:nbytes])

    def close(self) -> None:
        """Unlink every segment; idempotent. A write still running keeps its mapping (and
        finishes harmlessly) until its views are gone."""
        self._closed = True
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self.bytes = 0


class ShmReader(Reader):
    """Consumer side: open each announced arena once and lease batch regions.

    A region is a fresh uint8 NumPy array over the first ``nbytes`` of a place's arena (the
    owner the release finalizer hangs on) and a tensor over it; every view of the batch keeps
    it, and through it the mapping, alive. It must be an array straight over the mapping: a
    view of an array collapses its base to the first array that owns the memory or is over a
    non-array, so a region sliced from one array over the whole mapping would be skipped by
    its views, and die (releasing the batch) while they live.
    """

    kind = KIND
    at_once = True  # (retire calls back at once; handed_out is the base's, which does nothing)

    def __init__(self, device: torch.device, writable: bool = False) -> None:
        self.device = device
        self.delivery = "views" if device.type == "cpu" else "copy"
        # Read-only by default: a consumer never needs to write a producer's arena, and the MMU
        # then stops an in-place op in the process that does it, at its line (a segmentation
        # fault, with faulthandler's traceback), before any other consumer sees a changed byte.
        # Writable mappings (Consumer(check_writes=True)) rely on the fingerprint instead.
        self.writable = self.checks_writes = writable
        self._infos: dict[int, ArenaInfo] = {}
        self._maps: dict[int, mmap.mmap] = {}

    def announce(self, descriptor: list[Any]) -> None:
        info = ArenaInfo.decode(descriptor)
        if self._infos.get(info.place) != info:
            self._infos[info.place] = info
            self._maps.pop(info.place, None)  # reopened lazily; live views keep the old one

    def size(self, place: int) -> int:
        return self._infos[place].size

    def lease(self, place: int, nbytes: int) -> Lease:
        info = self._infos.get(place)
        if info is None:  # (a KeyError said only the number)
            raise ProtocolError(f"BATCH names place {place}, whose arena was never announced")
        if not 0 <= nbytes <= info.size:
            raise ValueError(f"region of {nbytes} bytes does not fit arena {info.name} ({info.size})")
        mm = self._maps.get(place)
        if mm is None:
            mm = self._maps[place] = open_segment(info.name, info.size, self.writable)
        # (np.frombuffer, not np.ndarray over the mapping, ~0.4 us quicker: that holds no export
        # of the mapping's buffer, so nothing would stop the mapping closing under the views)
        region = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # The token is the mapping, not the region: the release check reads the very memory
        # this batch lived in without keeping the region (and so the finalizer) from firing.
        return Lease(region, region, region.base)

    def region(self, place: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``place``'s arena, as :meth:`lease` gives them."""
        return self.lease(place, nbytes).region

    def deliver(self, views: Any, copy: bool) -> Any:
        # NumPy leaves (host only) are copied too: a view left in a copied batch would pin the
        # place for as long as it lives, read-only
        if self.device.type != "cpu":  # one copy, straight from shared memory to the device
            return layout.map_tensors(views, lambda t: t.to(self.device), np.copy)
        return layout.map_tensors(views, torch.clone, np.copy) if copy else views

    def retire(self, token: Any, then: Callable[[], None]) -> None:
        then()  # the CPU read it synchronously: nothing is in flight

    def fingerprint(self, token: mmap.mmap, nbytes: int) -> int:
        return fingerprints.of(np.frombuffer(token, dtype=np.uint8, count=nbytes))

    def close(self) -> None:
        """Forget the mappings; live views keep theirs until they die."""
        self._maps.clear()
        self._infos.clear()


def open_segment(name: str, size: int, writable: bool = True) -> mmap.mmap:
    """Map another process's segment; a hostile producer must not make us map another file."""
    if not _SEGMENT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"arena name {name!r:.80} is not a {PREFIX}* segment in {SHM_DIR}")
    return _map(os.path.join(SHM_DIR, name), size, create=False, writable=writable)
