"""Deterministic synthetic batches, cheap to make and cheap to check.

Why: benchmarks and tests of the transport need a loader whose cost is known (near zero, or
exactly ``work_ms`` of CPU per batch) and whose output a consumer can verify bit for bit
without talking to the producer. Batch ``index`` is a pure function of ``(seed, index)`` and
the shape parameters, never of the epoch or of what came before, so a consumer regenerates
it with :func:`expected_batch` and compares, and a late joiner or a replayed batch can be
checked the same way.

Each row is a slice of a cached random pattern (one per seed) starting at a per-row random
offset, so making a batch is one allocation plus memcpy; generating the bytes with a random
number generator would cost ~6 ns/byte here (0.4 s for 64 MiB). The first 16 bytes of every
row hold ``(index, row)`` as two native-endian int64, so a wrong or shuffled batch names
itself in the error message (see :func:`read_header`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "HEADER_BYTES",
    "NUM_CLASSES",
    "SyntheticLoader",
    "expected_batch",
    "make_loader",
    "read_header",
    "verify_batch",
]

HEADER_BYTES = 16
NUM_CLASSES = 1000

# Pattern period: odd, so the repetition inside long rows never lines up with the
# power-of-two alignments a transport uses and an off-by-alignment copy still shows.
_PERIOD = (1 << 20) + 7
_MASK64 = (1 << 64) - 1

Batch = tuple[torch.Tensor, torch.Tensor]


def _splitmix64(x: int) -> int:
    """Mix a 64-bit integer; turns (seed, index) into well-spread generator seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=4)
def _pattern(seed: int) -> torch.Tensor:
    """Random bytes of length 2 * _PERIOD for ``seed``; read-only by convention."""
    gen = torch.Generator().manual_seed(_splitmix64(seed & _MASK64))
    return torch.randint(0, 256, (2 * _PERIOD,), dtype=torch.uint8, generator=gen)


def _check_params(batch_bytes: int, batch_size: int, batches: int | None = None) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_bytes < batch_size:
        raise ValueError(
            f"batch_bytes ({batch_bytes}) must be >= batch_size ({batch_size}): "
            "each sample needs at least one byte"
        )
    if batches is not None and batches < 0:
        raise ValueError(f"batches must be >= 0, got {batches}")


def expected_batch(index: int, batch_bytes: int = 1 << 20, batch_size: int = 32, seed: int = 0) -> Batch:
    """Return batch ``index`` exactly as :class:`SyntheticLoader` yields it.

    ``images`` is a fresh contiguous uint8 tensor of shape
    ``(batch_size, batch_bytes // batch_size)``; ``labels`` is int64 of shape
    ``(batch_size,)`` with values in ``[0, NUM_CLASSES)``.
    """
    _check_params(batch_bytes, batch_size)
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    row_bytes = batch_bytes // batch_size
    gen = torch.Generator().manual_seed(_splitmix64((seed * 0x100000001B3 + index) & _MASK64))
    offsets = torch.randint(0, _PERIOD, (batch_size,), generator=gen).tolist()
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen, dtype=torch.int64)

    pattern = _pattern(seed)
    images = torch.empty((batch_size, row_bytes), dtype=torch.uint8)
    for row, offset in enumerate(offsets):
        dst = images[row]
        # pattern[offset : offset + _PERIOD] is always in range; long rows tile it.
        for start in range(0, row_bytes, _PERIOD):
            n = min(_PERIOD, row_bytes - start)
            dst[start : start + n].copy_(pattern[offset : offset + n])

    header = torch.empty((batch_size, 2), dtype=torch.int64)
    header[:, 0] = index
    header[:, 1] = torch.arange(batch_size)
    width = min(HEADER_BYTES, row_bytes)
    images[:, :width] = header.view(torch.uint8)[:, :width]
    return images, labels


def read_header(images: torch.Tensor) -> list[tuple[int, int]]:
    """Return the ``(index, row)`` pairs stamped in each row of a synthetic batch.

    Rows shorter than 16 bytes carry no complete header; they raise ``ValueError``.
    """
    if images.dim() != 2 or images.dtype != torch.uint8:
        raise ValueError(f"expected a 2-D uint8 tensor, got {images.dtype} {tuple(images.shape)}")
    if images.shape[1] < HEADER_BYTES:
        raise ValueError(f"rows of {images.shape[1]} bytes are too short for a header")
    words = images[:, :HEADER_BYTES].cpu().contiguous().view(torch.int64)
    return [(int(i), int(r)) for i, r in words.tolist()]


def verify_batch(
    batch: Sequence[Any],
    index: int,
    batch_bytes: int = 1 << 20,
    batch_size: int = 32,
    seed: int = 0,
) -> None:
    """Raise ``ValueError`` describing the first difference from batch ``index``.

    ``TypeError`` when a leaf is not a tensor. Works on tensors on any device; returns
    ``None`` when the batch is bit-exact.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"batch {index}: expected (images, labels), got {type(batch).__name__}")
    images, labels = batch
    want_images, want_labels = expected_batch(index, batch_bytes, batch_size, seed)
    for name, got, want in (
        ("images", images, want_images),
        ("labels", labels, want_labels),
    ):
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"batch {index}: {name} is {type(got).__name__}, not a tensor")
        if got.dtype != want.dtype or got.shape != want.shape:
            raise ValueError(
                f"batch {index}: {name} is {got.dtype} {tuple(got.shape)}, "
                f"expected {want.dtype} {tuple(want.shape)}"
            )
        got = got.cpu()
        if not torch.equal(got, want):
            where = (got != want).nonzero()[0].tolist()
            detail = ""
            if name == "images" and got.shape[1] >= HEADER_BYTES:
                detail = f"; row {where[0]} header says (index, row) = {read_header(got)[where[0]]}"
            raise ValueError(f"batch {index}: {name} differ first at {tuple(where)}{detail}")


class SyntheticLoader:
    """Re-iterable loader of deterministic ``(images, labels)`` batches.

    Every ``iter()`` starts a fresh epoch at batch 0 and yields the same bytes, like a
    non-shuffled ``DataLoader``. ``work_ms`` adds a busy loop per batch to stand in for a
    CPU-bound pipeline (it holds the GIL, as decode + augment in a single process would).
    """

    def __init__(
        self,
        batch_bytes: int = 1 << 20,
        batch_size: int = 32,
        batches: int = 100,
        seed: int = 0,
        work_ms: float = 0.0,
    ) -> None:
        _check_params(batch_bytes, batch_size, batches)
        if work_ms < 0:
            raise ValueError(f"work_ms must be >= 0, got {work_ms}")
        self.batch_bytes = batch_bytes
        self.batch_size = batch_size
        self.batches = batches
        self.seed = seed
        self.work_ms = work_ms

    @property
    def row_bytes(self) -> int:
        """Bytes per sample; ``batch_bytes`` rounded down to a multiple of ``batch_size``."""
        return self.batch_bytes // self.batch_size

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Batch]:
        return _SyntheticIterator(self)

    def expected_batch(self, index: int) -> Batch:
        """Regenerate batch ``index`` of this loader."""
        return expected_batch(index, self.batch_bytes, self.batch_size, self.seed)

    def verify_batch(self, batch: Sequence[Any], index: int) -> None:
        """Raise ``ValueError`` unless ``batch`` is bit-exact batch ``index`` of this loader."""
        verify_batch(batch, index, self.batch_bytes, self.batch_size, self.seed)

    def __repr__(self) -> str:
        return (
            f"SyntheticLoader(batch_bytes={self.batch_bytes}, batch_size={self.batch_size}, "
            f"batches={self.batches}, seed={self.seed}, work_ms={self.work_ms})"
        )


class _SyntheticIterator:
    """One epoch over a :class:`SyntheticLoader`.

    A class rather than a generator so that no suspended frame keeps the last yielded
    batch alive after the caller has dropped it.
    """

    def __init__(self, loader: SyntheticLoader) -> None:
        self._loader = loader
        self._next = 0

    def __iter__(self) -> _SyntheticIterator:
        return self

    def __len__(self) -> int:
        return self._loader.batches - self._next

    def __next__(self) -> Batch:
        loader = self._loader
        if self._next >= loader.batches:
            raise StopIteration
        deadline = time.perf_counter() + loader.work_ms / 1000.0
        batch = loader.expected_batch(self._next)
        self._next += 1
        while time.perf_counter() < deadline:
            pass
        return batch


def make_loader(
    batch_bytes: int = 1 << 20,
    batch_size: int = 32,
    batches: int = 100,
    seed: int = 0,
    work_ms: float = 0.0,
) -> SyntheticLoader:
    """Return a :class:`SyntheticLoader`; see the module docstring."""
    return SyntheticLoader(batch_bytes, batch_size, batches, seed, work_ms)


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Time synthetic batch generation.")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    _pattern(0)  # built once per seed; not part of the per-batch cost
    for mib in args.sizes_mib:
        loader = make_loader(int(mib * (1 << 20)), args.batch_size, args.batches)
        times = []
        it = iter(loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            times.append(time.perf_counter() - start)
            del batch
        times.sort()
        print(
            f"{mib:>6g} MiB/batch: median {times[len(times) // 2] * 1e3:7.2f} ms, "
            f"min {times[0] * 1e3:7.2f} ms, max {times[-1] * 1e3:7.2f} ms"
        )


if __name__ == "__main__":
    _main()
