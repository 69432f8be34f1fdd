"""DataLoader workers that collate into shared memory they reuse, instead of a new segment a batch.

Why: torch's ``default_collate`` makes every batch a worker builds in a new shared-memory
segment, which the main process maps, reads and frees. For a 19 MB image batch on the 2-core
VM, filling the fresh pages cost the workers ~17 ms a batch and mapping and freeing them cost
the main process ~6 ms (``benchmarks.pooled_collate``). A plain training loop cannot avoid it:
only the loop knows when it has let go of a batch. The producer does know, so it installs
:class:`PooledCollate` in the DataLoader it serves (:func:`installed`) and tells the workers,
through :class:`Reclaimer`, which buffers they may fill again.

How a buffer changes hands, with no lock: its state is one word in the buffer itself.

* A pooled buffer is one shared-memory tensor of bytes: a 256-byte header (a magic number
  and three 64-bit words: the *claim*, the *epoch* it was claimed in and *seen*), then the
  leaf. A worker fills only a buffer of its own whose claim is 0: it first stores 1 into the
  claim, then stacks the samples after the header, and the batch goes out as usual.
* The main process, given each batch it pulled (once: :meth:`Reclaimer.track`), notes each
  pooled storage and stores 1 into its *seen*. Later (:meth:`Reclaimer.reclaim`), a noted
  storage that nothing else references any more (its C++ use count is the Reclaimer's own
  two references, and no one else holds its Python storage object) goes back to its worker:
  the main process stores 0 into *seen*, then into the claim, once, and waits for the buffer
  to come back in a batch before it may hand it back again.
* So each claim has one writer at a time: the worker while it is 0, the main process from
  the batch's arrival until it hands the buffer back; and a batch on its way, filled after
  the hand-back, cannot be handed back before it has arrived and been dropped.
* A DataLoader whose epoch is left early discards the batches on their way (a persistent
  worker's, when the next epoch starts), so the main process never sees them. Each new
  iterator therefore starts a new *epoch* (:meth:`PooledCollate.new_epoch`, one more shared
  word); a worker that finds it changed takes back its own buffers claimed before it and
  never seen. (The main process stops pulling from the old iterator before the change, so
  such a batch can no longer be seen.)

Batches are bit-identical to ``default_collate``'s (the same ``torch.stack`` into shared
memory; only where the memory comes from differs). Anything but a large dense CPU tensor,
a worker with no free buffer that may not make another, or no Reclaimer at all: the batch
is collated by torch's own code, as before.

How many buffers: a worker makes a new one only when none of its own is free, up to
``buffers`` for each leaf it pools, and only while ``/dev/shm`` keeps at least half its size
free after it (Docker's 64 MiB default: a pool never takes the room the producer's places
need). The producer allows the loader's ``prefetch_factor`` + 2 (its batches in flight, the
one being published and the one its caller still holds) plus each worker's share of the
batches its replay budget keeps, which hold their buffers (by reference) until they are let
go: so a pool holds at most what ``default_collate`` would have had in use at once, for the
loader's life instead of freed and made again (beside it, the main process keeps mapped the
buffers it handed back, until they come back or for 64 batches; a loader whose workers are
not persistent gets new workers, and pools, each epoch, so the old ones are let go then).
(Capped at ``prefetch_factor`` + 2 alone, the kept batches took every buffer and most batches
were made afresh: ``benchmarks/FINDINGS.md``, *The loader's workers collating into reused
memory*.)
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

from . import sharding

__all__ = ["LoaderPool", "PooledCollate", "Reclaimer", "installed"]

HEADER = 256  # bytes before the leaf: keeps the leaf 256-byte aligned, as our places do
MAGIC = (0x54536F636B65742D, 0x506F6F6C65644231)  # "TSocket-", "PooledB1" (an unlikely pair)
SHM = "/dev/shm"  # where torch's shared memory (shm_open) lives
MIN_BYTES = 1 << 20  # smaller leaves are cheap to make afresh: not worth a buffer
_CLAIM, _EPOCH, _SEEN = 2, 3, 4  # the header's 64-bit words after the magic pair
_BUFFERS, _EPOCHS = 0, 1  # the shared words every worker reads: the limit, and the epoch
_STALE = 64  # reclaims after which a buffer handed back but not seen again is let go


class PooledCollate:
    """A DataLoader ``collate_fn``: ``default_collate``, except that in a worker each large
    dense CPU tensor leaf is stacked into one of that worker's reused buffers.

    ``buffers``: at most how many a worker keeps for each leaf it pools; :meth:`allow`
    changes it, for workers already running too. Outside a worker (``num_workers=0``) it is
    ``default_collate``.
    """

    def __init__(
        self, buffers: int = 4, min_bytes: int = MIN_BYTES, *, _shared: torch.Tensor | None = None
    ) -> None:
        if type(buffers) is not int or buffers < 1:
            raise ValueError(f"buffers must be an int >= 1, got {buffers!r}")
        if type(min_bytes) is not int or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        # the limit and the epoch, in shared memory: words the workers read (forked or spawned with them)
        if _shared is None:
            _shared = torch.tensor([buffers, 0], dtype=torch.int64).share_memory_()
        self._shared, self._words = _shared, _shared.numpy()
        self._pool: list[tuple[torch.Tensor, Any]] = []  # a worker's: (buffer, its header as a NumPy view)
        self._claimed: list[Any] = []  # the headers claimed for the batch being collated
        self._epoch = -1  # the epoch this worker last saw
        self._leaves = 0  # the most leaves one batch pooled so far
        self._fn_map = {**default_collate_fn_map, torch.Tensor: self._collate_tensor}

    @property
    def buffers(self) -> int:
        return int(self._words[_BUFFERS])

    def allow(self, buffers: int) -> None:
        """Let each worker keep up to ``buffers`` a leaf from now on (running ones too)."""
        if type(buffers) is not int or buffers < 1:
            raise ValueError(f"buffers must be an int >= 1, got {buffers!r}")
        self._words[_BUFFERS] = buffers

    def new_epoch(self) -> None:
        """Before a new iterator of the loader: the batches of the ones before that the main
        process has not seen are discarded (a DataLoader left early drops those on their way),
        so their workers may fill those buffers again."""
        self._words[_EPOCHS] += 1

    def __getstate__(self) -> dict[str, Any]:  # (sent to spawned workers: a fresh, empty pool)
        return {"shared": self._shared, "min_bytes": self.min_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(1, state["min_bytes"], _shared=state["shared"])  # type: ignore[misc]

    def __call__(self, samples: list[Any]) -> Any:
        if get_worker_info() is None:
            return default_collate(samples)
        self._claimed.clear()
        try:
            batch = collate(samples, collate_fn_map=self._fn_map)
            self._leaves = max(self._leaves, len(self._claimed))
            return batch
        except BaseException:
            for header in self._claimed:  # not sent: the buffers are free again
                header[_CLAIM] = 0
            raise
        finally:
            self._claimed.clear()

    def _collate_tensor(self, batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        nbytes = sum(x.numel() for x in batch) * elem.element_size()
        if (
            nbytes < self.min_bytes
            or elem.layout is not torch.strided
            or elem.is_nested
            or elem.device.type != "cpu"
            or any(x.shape != elem.shape for x in batch)  # (torch.stack's error, from torch's own path)
        ):
            return collate_tensor_fn(batch)
        buffer = self._take(nbytes)
        if buffer is None:
            return collate_tensor_fn(batch)
        out = buffer[HEADER : HEADER + nbytes].view(elem.dtype).view(len(batch), *elem.shape)
        return torch.stack(batch, 0, out=out)

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """This worker's smallest free buffer with room for ``nbytes``, claimed; else a new one
        if the pool may grow; else None. (A free buffer too small for this leaf stays for a
        smaller one: replacing it would make two sizes of leaf take turns in making buffers.)"""
        epoch = int(self._words[_EPOCHS])
        if epoch != self._epoch:  # a new iterator: take back what the old ones' discarded
            for _, header in self._pool:
                if header[_CLAIM] and not header[_SEEN] and header[_EPOCH] < epoch:
                    header[_CLAIM] = 0
            self._epoch = epoch
        fits = None
        for i, (buffer, header) in enumerate(self._pool):
            if header[_CLAIM] == 0 and buffer.numel() >= HEADER + nbytes:
                if fits is None or buffer.numel() < self._pool[fits][0].numel():
                    fits = i
        if fits is not None:
            return self._claim(*self._pool[fits])
        if not self._may_grow(nbytes):
            return None
        # made in shared memory at once, as default_collate does (``share_memory_()`` on a
        # private tensor would fill its pages and copy them: ~8 ms more for a 19 MB leaf)
        storage = torch.UntypedStorage._new_shared(HEADER + nbytes)
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (HEADER + nbytes,))
        header = buffer[:HEADER].view(torch.int64).numpy()
        header[:] = 0
        header[0], header[1] = MAGIC
        entry = (buffer, header)
        self._pool.append(entry)
        return self._claim(*entry)

    def _may_grow(self, nbytes: int) -> bool:
        if len(self._pool) >= self._words[_BUFFERS] * max(self._leaves, len(self._claimed) + 1):
            return False  # (the count is per pooled leaf)
        try:
            shm = os.statvfs(SHM)
        except OSError:
            return False
        return (shm.f_bavail * shm.f_frsize - HEADER - nbytes) * 2 >= shm.f_blocks * shm.f_frsize

    def _claim(self, buffer: torch.Tensor, header: Any) -> torch.Tensor:
        header[_EPOCH] = self._epoch
        header[_CLAIM] = 1  # (one aligned 64-bit store, before the leaf is written)
        self._claimed.append(header)
        return buffer


class Reclaimer:
    """The main process's side: hands a pooled buffer back to its worker once every batch
    made from it has been dropped. Used from one thread (the producer's publishing thread)."""

    def __init__(self) -> None:
        # storage's data_ptr -> [storage, its header (a NumPy view), reclaims since handed back, or None]
        self._held: dict[int, list[Any]] = {}
        # what an entry alone holds of its storage, found as track() makes one: the C++ use
        # count and the Python object's references (a user holding the storage object itself
        # adds to the second only)
        probe = _entry(torch.empty(HEADER, dtype=torch.uint8).untyped_storage())
        self._alone = _references(probe)

    def __len__(self) -> int:
        return len(self._held)

    def track(self, leaves: Any) -> None:
        """Note the pooled storages among ``leaves`` (tensors and arrays of a pulled batch)."""
        for leaf in leaves:
            if (
                not isinstance(leaf, torch.Tensor)
                or leaf.device.type != "cpu"
                or leaf.storage_offset() * leaf.element_size() < HEADER
            ):
                continue
            entry = _entry(leaf.untyped_storage())
            header = entry[1]
            if header[0] != MAGIC[0] or header[1] != MAGIC[1]:
                continue
            header[_SEEN] = 1
            self._held[entry[0].data_ptr()] = entry

    def reclaim(self) -> int:
        """Hand back every tracked buffer nothing else references; let go of buffers handed
        back long ago and not seen since (their worker is gone, or keeps others). Returns how
        many were handed back."""
        handed = 0
        for key, entry in list(self._held.items()):
            since = entry[2]
            if since is not None:
                entry[2] = since + 1
                if since >= _STALE:
                    del self._held[key]
            elif _references(entry) == self._alone:
                header = entry[1]
                header[_SEEN] = 0
                header[_CLAIM] = 0  # (last: from here on the worker may fill it)
                entry[2] = 0
                handed += 1
        return handed

    def forget_handed_back(self) -> None:
        """Let go of the buffers handed back and not seen since: for a loader whose workers
        are not persistent, whose next epoch's workers have pools of their own."""
        for key in [key for key, entry in self._held.items() if entry[2] is not None]:
            del self._held[key]


def _entry(storage: torch.UntypedStorage) -> list[Any]:
    """A Reclaimer's record of ``storage``: the storage, its header's words, and None (held)."""
    header = torch.empty(0, dtype=torch.int64).set_(storage, 0, (HEADER // 8,)).numpy()
    return [storage, header, None]


def _references(entry: list[Any]) -> tuple[int, int]:
    """How much holds ``entry``'s storage: its C++ use count (tensors, views, arrays made from
    them) and its Python object's reference count (a holder of the storage object itself)."""
    return torch._C._storage_Use_Count(entry[0]._cdata), sys.getrefcount(entry[0])


def eligible(loader: Any) -> bool:
    """Whether :func:`installed` would pool ``loader``'s batches: a DataLoader with worker
    processes and torch's own ``default_collate``, and no ``pin_memory`` (its thread copies
    each batch and drops it unseen: no buffer would ever come back)."""
    return (
        isinstance(loader, DataLoader)
        and loader.num_workers > 0
        and loader.collate_fn is default_collate
        and not loader.pin_memory
    )


def for_loader(loader: Any) -> PooledCollate | None:
    """The collate a producer installs in ``loader`` (None if not :func:`eligible`): up to
    ``prefetch_factor`` + 2 buffers a leaf, its batches in flight, the one being published
    and the one the producer's caller still holds (see :func:`keeping` for more)."""
    return PooledCollate(buffers=_in_use(loader)) if eligible(loader) else None


def keeping(collate: PooledCollate, loader: Any, batches: int) -> None:
    """The producer keeps up to ``batches`` of the loader's batches for late joiners: let
    each worker keep its share of them in buffers too, beside those :func:`for_loader` gave."""
    workers = max(loader.num_workers, 1)
    collate.allow(_in_use(loader) + -(-max(batches, 0) // workers))


def _in_use(loader: Any) -> int:
    """A worker's batches in use at once besides kept ones: ``prefetch_factor`` in flight,
    the one being published and the one the producer's caller still holds."""
    return (loader.prefetch_factor or 2) + 2


@contextlib.contextmanager
def installed(loader: Any, collate: PooledCollate | None) -> Iterator[bool]:
    """Within the block, an :func:`eligible` ``loader`` collates with ``collate`` (create its
    iterator here, and no longer pull from the ones before: its workers keep the collate they
    started with, and the batches of earlier iterators not pulled yet are taken as discarded,
    :meth:`PooledCollate.new_epoch`); the loader's own ``collate_fn`` is back afterwards.
    Yields whether it was installed."""
    if collate is None or not eligible(loader):
        yield False
        return
    try:  # (all inside: a Ctrl-C as DataLoader.__setattr__ returns must leave it as it was too)
        loader.collate_fn = collate
        collate.new_epoch()
        yield True
    finally:
        loader.collate_fn = default_collate


class LoaderPool:
    """A producer's side of pooling for the one loader it serves: the collate it installs
    (None: the loader is not :func:`eligible`), the :class:`Reclaimer`, and whether the
    iterator being pulled collates with it. Used from the producer's publishing thread (and
    before it exists, by a restart's rerun of the epoch it resumes)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.collate = for_loader(loader)  # (one for every epoch: persistent workers keep the first)
        self.reclaimer = Reclaimer()
        self.pooling = False
        self._opened = False

    def open(self, epoch: int) -> Iterator[Any]:
        """The loader's iterator for ``epoch`` (:func:`sharding.open_epoch`), made with the
        collate installed."""
        if self._opened and not getattr(self.loader, "persistent_workers", False):
            self.reclaimer.forget_handed_back()  # new workers, new pools: the old never come back
        self._opened = True
        with installed(self.loader, self.collate) as self.pooling:
            return sharding.open_epoch(self.loader, epoch)

    def before_pull(self) -> None:
        """Hand back what the batches pulled before no longer hold (call before each pull)."""
        if len(self.reclaimer):
            self.reclaimer.reclaim()

    def pulled(self, leaves: Any) -> None:
        """A batch was pulled from the iterator :meth:`open` made: note its pooled buffers."""
        if self.pooling:
            self.reclaimer.track(leaves)

    def keep(self, batches: int) -> None:
        """The producer keeps up to ``batches`` of the loader's batches (see :func:`keeping`)."""
        if self.collate is not None:
            keeping(self.collate, self.loader, batches)
