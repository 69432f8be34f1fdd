"""What a new place costs the producer: a fresh shared-memory segment, its pages reserved
(``posix_fallocate``) and mapped with their page faults taken up front, then one batch copied
in. Two ways of taking the faults, in turn, in one process:

* ``map_populate``: ``mmap(MAP_POPULATE)``, what the producer did before;
* ``madvise_populate_write``: ``mmap`` then ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14),
  what ``tensorsocket.transport.shm`` does now (it falls back to the first on older kernels).

Why it matters: with the default replay budget every batch of the first epoch goes to a new
place, so a short run pays this for each of them (benchmarks/FINDINGS.md, "Where issue 18's goals stand").

    python3 -m benchmarks.new_place [--mib 18.4] [--rounds 30]
    # -> benchmarks/results/new_place-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import numpy as np

from benchmarks.sharing import machine, write
from tensorsocket.transport.shm import _MADV_POPULATE_WRITE, SHM_DIR


def _map_populate(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)


def _madvise_populate_write(fd: int, size: int) -> mmap.mmap:
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
    mm.madvise(_MADV_POPULATE_WRITE)
    return mm


WAYS = {"map_populate": _map_populate, "madvise_populate_write": _madvise_populate_write}


def one(way: str, size: int, batch: np.ndarray) -> tuple[float, float]:
    """CPU ms to make one new place the given way, and to copy one batch into it."""
    path = os.path.join(SHM_DIR, f"tensorsocket-bench-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.process_time()
        os.posix_fallocate(fd, 0, size)
        mm = WAYS[way](fd, size)
        t1 = time.process_time()
        view = np.frombuffer(mm, dtype=np.uint8)
        ctypes.memmove(view.ctypes.data, batch.ctypes.data, size)
        t2 = time.process_time()
        del view
        mm.close()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3
    finally:
        os.close(fd)
        os.unlink(path)


def run(mib: float, rounds: int) -> dict[str, Any]:
    size = int(mib * (1 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE
    batch = np.ones(size, dtype=np.uint8)
    made: dict[str, list[float]] = {way: [] for way in WAYS}
    copied: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else reversed(list(WAYS)):  # in turn, each first half the time
            make_ms, copy_ms = one(way, size, batch)
            made[way].append(make_ms)
            copied[way].append(copy_ms)
    summary = {
        way: {
            "make_ms_p50": round(statistics.median(made[way]), 2),
            "copy_ms_p50": round(statistics.median(copied[way]), 2),
        }
        for way in WAYS
    }
    return {
        "benchmark": "new_place",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"python3 -m benchmarks.new_place --mib {mib} --rounds {rounds}",
        "machine": {**machine(), "kernel": os.uname().release},
        "config": {"bytes": size, "rounds": rounds},
        "summary": summary,
        "made_ms": made,
        "copied_ms": copied,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mib", type=float, default=18.4, help="a place's size (18.4: a 32x3x224x224 float batch)"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(args.mib, args.rounds)
    for way, row in result["summary"].items():
        print(
            f"{way:>24}: make a new place {row['make_ms_p50']:.2f} ms CPU, then copy a batch in {row['copy_ms_p50']:.2f} ms"
        )
    if not args.no_write:
        print("wrote", write(result, "new_place"))


if __name__ == "__main__":
    main()
