"""Shared-memory segments: allocation failures are clean, stale segments are swept, live
ones are not, and consumers map only tensorsocket segments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tensorsocket import layout
from tensorsocket.errors import ProtocolError
from tensorsocket.transport.shm import PREFIX, SHM_DIR, ArenaInfo, ShmReader, ShmStore, sweep_stale


def test_a_too_large_arena_fails_cleanly_and_leaves_nothing():
    pool = ShmStore()
    try:
        with pytest.raises(OSError, match="cannot allocate .* shared memory"):
            pool.prepare(0, 1 << 50)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getuid()}-{os.getpid()}-")]
    finally:
        pool.close()


def test_sweep_removes_segments_of_dead_owners_only():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = os.path.join(SHM_DIR, f"{PREFIX}{os.getuid()}-{dead_pid}-deadbeef-0-1")
    live = os.path.join(SHM_DIR, f"{PREFIX}{os.getuid()}-{os.getpid()}-cafef00d-0-1")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = sweep_stale()
        assert os.path.basename(stale) in removed
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_producer_and_consumer_views_share_memory_and_regrowth_is_announced():
    pool = ShmStore()
    try:
        small = layout.plan(torch.arange(10))
        (descriptor,) = pool.install(pool.prepare(0, small.nbytes))  # one transport: one descriptor
        info = ArenaInfo.decode(descriptor)
        assert info.size % 4096 == 0
        assert pool.prepare(0, small.nbytes) is None  # fits: no new arena
        big = layout.plan(torch.arange(1 << 20))
        grown = ArenaInfo.decode(pool.install(pool.prepare(0, big.nbytes))[0])
        assert grown.name != info.name and grown.size >= big.nbytes
        assert not os.path.exists(os.path.join(SHM_DIR, info.name))  # the old one is unlinked
        fingerprint = pool.write(0, big).wait()
        arenas = ShmReader(torch.device("cpu"))
        arenas.announce(grown.encode())
        region = arenas.region(0, big.nbytes)
        assert layout.fingerprint(region) == fingerprint
        tree, leaves = layout.check(big.encode(), grown.size)
        assert torch.equal(layout.build(tree, leaves, region), torch.arange(1 << 20))
    finally:
        pool.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "/tmp/x", "other-segment", f"{PREFIX}a/../../b"])
def test_consumer_maps_only_tensorsocket_segments(name):
    arenas = ShmReader(torch.device("cpu"))
    arenas.announce(ArenaInfo(0, name, 4096).encode())
    with pytest.raises(ValueError):
        arenas.region(0, 16)


@pytest.mark.parametrize(
    "descriptor",
    [["shm", 0, "x"], ["cuda", 0, "x", 4096], ["shm", -1, "x", 4096], ["shm", 0, b"x", 4096], "shm", []],
)
def test_consumer_decodes_shm_descriptors_strictly(descriptor):
    with pytest.raises(ProtocolError):
        ShmReader(torch.device("cpu")).announce(descriptor)
