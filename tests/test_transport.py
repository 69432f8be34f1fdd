"""Transport conformance: every transport behind ``transport/base.py`` (``Store`` on the
producer's side, ``Reader`` on the consumer's) keeps the same contract, checked here against
the interface only, parametrised over ``shm`` and ``cuda``.

``cuda`` runs over the CPU stand-in of the CUDA primitives (``TENSORSOCKET_FAKE_CUDA=1``) on
CI, and over the real GPU with ``TENSORSOCKET_GPU_REAL=1`` (as ``scripts/gpu.sh`` runs
tests/test_cuda_path.py); the few checks that need the stand-in's knobs say so.

Batches are written by a store in a second process (spawned; one per transport, fresh store
per test) and read by a reader in this one, as producer and consumers run: that also keeps
real CUDA IPC happy, which cannot open a handle in the process that exported it. Store-only
and reader-only checks run here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tensorsocket import layout
from tensorsocket.errors import ProtocolError
from tensorsocket.layout_table import Recipe
from tensorsocket.transport import Lease, Reader, Store, open_reader, open_store, sweep_stale
from tests.support import SPAWN, same, shm_segments, wait_until

REAL = os.environ.get("TENSORSOCKET_GPU_REAL") == "1"
KINDS = [
    "shm",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            REAL and not torch.cuda.is_available(), reason="TENSORSOCKET_GPU_REAL=1 needs a GPU"
        ),
    ),
]
DEVICE = {"shm": "cpu", "cuda": "cuda:0"}
SMALL, BIG = 4, 6000  # rows: BIG needs more than the 2 MiB a cuda arena starts with
REPLY_TIMEOUT = 60.0


def sample(rows: int, seed: int = 0) -> Any:
    """A nested batch of tensors and arrays, a pure function of its arguments (so both
    processes know it): NaN and -0.0 to catch anything but a bit copy, an empty leaf, and an
    int64 leading tensor that an in-place ``add_(1)`` changes in every sampled byte lane."""
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(rows, 3, 4, 4, generator=g)
    image[0, 0, 0, :2] = torch.tensor([float("nan"), -0.0])
    return (
        torch.randint(0, 1 << 40, (rows, 64), generator=g),
        {
            "image": image.to(torch.bfloat16),
            "mask": torch.rand(rows, generator=g) > 0.5,
            "np": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + seed,
            "meta": ["text", None, seed],
        },
        [torch.zeros(0, 5), torch.tensor([seed], dtype=torch.int16)],
    )


def make_store(kind: str) -> Store:
    store = open_store(DEVICE[kind])
    assert store.kind == kind  # open_store picked the transport asked for
    return store


def make_reader(kind: str, gpu: str | None) -> Reader:
    reader = open_reader(kind, gpu, torch.device(DEVICE[kind]))
    assert reader.kind == kind and reader.delivery == "views"
    return reader


def put(store: Store, place: int, batch: Any) -> tuple[list[Any] | None, list[Any], int | None]:
    """Write ``batch`` into ``place`` as the producer does: (new descriptor or None, layout,
    receipt fingerprint)."""
    plan = layout.plan(batch)
    prepared = store.prepare(place, plan.nbytes)
    descriptors = None if prepared is None else store.install(prepared)
    if descriptors is not None:
        assert len(descriptors) == 1, descriptors  # one transport served: no mirror here
    descriptor = None if descriptors is None else descriptors[0]
    return descriptor, plan.encode(), store.write(place, plan).wait()


def read(reader: Reader, place: int, encoded: list[Any]) -> tuple[Any, Lease]:
    """The user's batch for a BATCH message, as the consumer builds it: (views, lease)."""
    recipe = Recipe(encoded)
    lease = reader.lease(place, recipe.nbytes)
    return reader.deliver(recipe.build(lease.region), copy=False), lease


def _serve_store(kind: str, conn: Any) -> None:
    """Second-process body: a store driven by commands on ``conn``; every reply is
    ``("ok", value)`` or ``("error", text)``."""
    store: Store | None = None
    while True:
        command, *args = conn.recv()
        try:
            if command == "reset":  # a fresh store for the next test
                if store is not None:
                    store.close()
                store = make_store(kind)
                reply: Any = (os.getpid(), store.gpu)
            elif command == "put":
                place, rows, seed = args
                reply = put(store, place, sample(rows, seed))
            elif command == "describe":
                reply = store.describe()
            elif command == "exit":
                if store is not None:
                    store.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Writer:
    """This side of a ``_serve_store`` process."""

    def __init__(self, kind: str) -> None:
        self.conn, theirs = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_serve_store, args=(kind, theirs), daemon=True)
        self.process.start()
        theirs.close()
        self.pid, self.gpu = self.ask("reset")

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        assert self.conn.poll(REPLY_TIMEOUT), f"the store process did not answer {command[0]!r}"
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def put(self, place: int, rows: int, seed: int = 0) -> tuple[list[Any] | None, list[Any], int | None]:
        return self.ask("put", place, rows, seed)

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.ask("exit")
        finally:
            self.process.join(REPLY_TIMEOUT)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.conn.close()
            self.process.close()


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The transport under test; the stand-in selected for this process and the store
    processes it spawns (they inherit the environment), unless on a real GPU."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("TENSORSOCKET_FAKE_CUDA_DELAY", "TENSORSOCKET_TEST_UNORDERED"):
            mp.delenv(var, raising=False)
        if not REAL:
            mp.setenv("TENSORSOCKET_FAKE_CUDA", "1")
            mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        yield request.param


@pytest.fixture(scope="module")
def remote(kind: str) -> Iterator[Writer]:
    writer = Writer(kind)
    yield writer
    pid = writer.pid
    writer.close()
    assert shm_segments(pid) == []  # its store unlinked everything (the stand-in's too)


@pytest.fixture
def writer(remote: Writer) -> Writer:
    """The store process, with a fresh store (no arenas yet) for this test."""
    remote.pid, remote.gpu = remote.ask("reset")
    return remote


@pytest.fixture
def reader(kind: str, writer: Writer) -> Iterator[Reader]:
    with make_reader(kind, writer.gpu) as r:
        yield r


@pytest.fixture
def store(kind: str) -> Iterator[Store]:
    with make_store(kind) as s:
        yield s


def _backend_stream() -> Any:
    from tensorsocket.transport.device import backend

    return backend().current_stream(0)


# --- write in one process, read in another --------------------------------------------------


def test_a_batch_written_in_one_process_reads_back_bit_identical_as_views(kind, writer, reader):
    descriptor, encoded, fingerprint = writer.put(0, SMALL, seed=1)
    assert descriptor is not None  # a first batch needs an arena, announced before the batch
    reader.announce(descriptor)
    views, lease = read(reader, 0, encoded)
    assert same(views, sample(SMALL, seed=1))
    # zero copy: the tensors are views of the leased region, not copies of it
    region = torch.from_numpy(lease.region) if isinstance(lease.region, np.ndarray) else lease.region
    start = region.data_ptr()
    assert start <= views[0].data_ptr() < start + region.numel()
    assert fingerprint is not None and reader.fingerprint(lease.token, encoded[2]) == fingerprint


def test_host_regions_are_read_only_unless_writes_are_checked(kind, writer):
    descriptor, encoded, _ = writer.put(0, SMALL)
    for check_writes in (False, True):
        with open_reader(kind, writer.gpu, torch.device(DEVICE[kind]), check_writes=check_writes) as reader:
            reader.announce(descriptor)
            views, lease = read(reader, 0, encoded)
            protected = kind == "shm" and not check_writes  # GPU memory cannot be protected
            assert reader.checks_writes is not protected
            if kind == "shm":
                assert lease.owner.flags.writeable is not protected
            del views, lease


def test_the_fingerprint_catches_an_in_place_write_through_a_view(kind, writer):
    descriptor, encoded, fingerprint = writer.put(0, SMALL)
    reader = open_reader(kind, writer.gpu, torch.device(DEVICE[kind]), check_writes=True)
    reader.announce(descriptor)
    views, lease = read(reader, 0, encoded)
    assert reader.fingerprint(lease.token, encoded[2]) == fingerprint
    views[0].add_(1)  # what a consumer normalising in place does to everyone's batch
    if kind == "cuda" and REAL:
        torch.cuda.synchronize()
    assert reader.fingerprint(lease.token, encoded[2]) != fingerprint
    assert not same(views[0], sample(SMALL)[0])
    del views, lease
    reader.close()


def test_a_grown_arena_is_announced_and_earlier_views_stay_valid(kind, writer, reader):
    first, small, _ = writer.put(0, SMALL, seed=2)
    reader.announce(first)
    old, _ = read(reader, 0, small)
    grown, big, fingerprint = writer.put(0, BIG, seed=4)
    assert grown is not None and grown != first and grown[:2] == [kind, 0]
    assert writer.ask("describe") == [grown]  # the old arena is gone from the store
    with pytest.raises(ProtocolError):  # the old arena is too small for the new layout
        layout.check(big, reader.size(0))
    reader.announce(grown)
    views, lease = read(reader, 0, big)
    assert same(views, sample(BIG, seed=4))
    assert reader.fingerprint(lease.token, big[2]) == fingerprint
    # Leased before the growth: still mapped (the store freed that arena), bytes unchanged.
    assert same(old, sample(SMALL, seed=2))


def test_views_outlive_the_readers_close(kind, writer, reader):
    descriptor, encoded, _ = writer.put(0, SMALL, seed=5)
    reader.announce(descriptor)
    views, _ = read(reader, 0, encoded)
    reader.close()
    assert same(views, sample(SMALL, seed=5))


# --- release only when the lease says so ------------------------------------------------------


def test_the_owner_dies_exactly_with_the_last_derived_view(kind, writer, reader):
    descriptor, encoded, fingerprint = writer.put(0, SMALL, seed=6)
    reader.announce(descriptor)
    views, lease = read(reader, 0, encoded)
    fired: list[bool] = []
    weakref.finalize(lease.owner, fired.append, True)
    token = lease.token
    rows = views[0][1:].t()  # a view of a view
    mask = views[1]["mask"].view(torch.uint8)  # a reinterpretation
    del lease, views
    assert fired == []
    del rows
    assert fired == []
    del mask
    assert fired == [True]
    # The token does not keep the owner alive, yet still reads the batch's memory.
    assert reader.fingerprint(token, encoded[2]) == fingerprint


def test_retire_releases_only_after_the_work_queued_on_the_batch_ran(kind, writer, reader):
    descriptor, encoded, _ = writer.put(0, SMALL)
    reader.announce(descriptor)
    views, lease = read(reader, 0, encoded)
    reader.handed_out(lease.token)
    token = lease.token
    released: list[bool] = []
    if kind == "shm":  # the CPU read synchronously: nothing can be in flight
        del views, lease
        reader.retire(token, lambda: released.append(True))
        assert released == [True]
        return
    if REAL:
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of "kernel" on the stream current at handed_out
        after = torch.cuda.Event()
        after.record()
        reader.retire(token, lambda: released.append(after.query()))
        assert released == []
        wait_until(lambda: released, 30, "the release after the queued kernel")
        assert released == [True]
        return
    gate, ran = threading.Event(), threading.Event()

    def kernel() -> None:  # a kernel that reads the batch until the test lets it finish
        gate.wait(30)
        ran.set()

    _backend_stream().enqueue(kernel)
    try:
        reader.retire(token, lambda: released.append(ran.is_set()))
        time.sleep(0.2)
        assert released == []  # the kernel still runs: the place must not be released
    finally:
        gate.set()
    wait_until(lambda: released, 10, "the release after the queued kernel")
    assert released == [True]


# --- store and reader objects ---------------------------------------------------------------


def test_prepare_returns_none_while_the_arena_fits(kind, store):
    descriptor, encoded, _ = put(store, 0, sample(SMALL))
    assert descriptor is not None and store.bytes >= encoded[2]
    assert store.prepare(0, encoded[2]) is None
    assert store.prepare(0, store.bytes) is None
    grown = store.prepare(0, store.bytes + 1)
    assert grown is not None
    assert store.install(grown) != [descriptor] and store.bytes > encoded[2]


def test_descriptors_are_tagged_by_transport_and_place(kind, store):
    installed = [put(store, place, sample(SMALL))[0] for place in (0, 3)]
    assert [d[:2] for d in installed] == [[kind, 0], [kind, 3]]
    assert sorted(store.describe(), key=lambda d: d[1]) == installed


def test_close_is_idempotent_and_a_closed_store_refuses_work(kind):
    store = make_store(kind)
    _, encoded, _ = put(store, 0, sample(SMALL))
    prepared = store.prepare(1, 1024)
    store.close()
    store.close()
    assert store.bytes == 0 and store.describe() == []
    with pytest.raises(RuntimeError, match="closed"):
        store.prepare(0, 1024)
    with pytest.raises(RuntimeError, match="closed"):
        store.write(0, layout.plan(sample(SMALL)))
    with pytest.raises(RuntimeError, match="closed"):
        store.install(prepared)  # and frees what was prepared for it
    if not REAL or kind == "shm":
        assert shm_segments(os.getpid()) == []
    with make_store(kind) as other:  # the context manager closes
        put(other, 0, sample(SMALL))
    with pytest.raises(RuntimeError, match="closed"):
        other.prepare(0, 1024)


def test_reader_close_is_idempotent(kind, store):
    reader = make_reader(kind, store.gpu)
    reader.announce(put(store, 0, sample(SMALL))[0])
    reader.close()
    reader.close()
    with make_reader(kind, store.gpu) as other:
        pass
    other.close()


def test_a_reader_rejects_another_transports_descriptor(kind, store):
    other_kind = "cuda" if kind == "shm" else "shm"
    if other_kind == "cuda" and REAL and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    with make_store(other_kind) as other:
        foreign = put(other, 0, sample(SMALL))[0]
        assert foreign[0] == other_kind
        with make_reader(kind, store.gpu) as reader, pytest.raises(ProtocolError):
            reader.announce(foreign)


MALFORMED = {
    "missing a field": lambda d: d[:-1],
    "an extra field": lambda d: [*d, 0],
    "no fields": lambda d: d[:1],
    "empty": lambda d: [],
    "a tuple": tuple,
    "a bare tag": lambda d: d[0],
    "None": lambda d: None,
    "another tag": lambda d: ["nccl", *d[1:]],
    "a tag in capitals": lambda d: [d[0].upper(), *d[1:]],
    "a negative place": lambda d: [d[0], -1, *d[2:]],
    "a huge place": lambda d: [d[0], 1 << 16, *d[2:]],
    "a bool place": lambda d: [d[0], True, *d[2:]],
    "a str place": lambda d: [d[0], "0", *d[2:]],
    "a float field": lambda d: [*d[:2], 1.5, *d[3:]],
    "a negative size": lambda d: [*d[:3], -1, *d[4:]],
    "a float size": lambda d: [*d[:3], float(d[3]), *d[4:]],
    "a huge size": lambda d: [*d[:3], 1 << 60, *d[4:]],
}


@pytest.mark.parametrize("mutation", list(MALFORMED))
def test_a_reader_rejects_malformed_descriptors(kind, store, mutation):
    descriptor = put(store, 0, sample(SMALL))[0]
    with make_reader(kind, store.gpu) as reader:
        reader.announce(list(descriptor))  # the unmutated one is fine
        with pytest.raises(ProtocolError):
            reader.announce(MALFORMED[mutation](list(descriptor)))


# --- a SIGKILLed owner ----------------------------------------------------------------------


def test_a_sigkilled_owners_arenas_are_swept(kind, store):
    if kind == "cuda" and REAL:
        pytest.skip("real device memory goes with its process; only the stand-in's is in /dev/shm")
    put(store, 0, sample(SMALL))  # a live owner's arena, which must survive the sweep
    mine = shm_segments(os.getpid())
    victim = Writer(kind)
    try:
        victim.put(0, SMALL)
        victim.put(1, BIG)
        left = shm_segments(victim.pid)
        assert len(left) == 2
        os.kill(victim.pid, signal.SIGKILL)
        victim.process.join(REPLY_TIMEOUT)
        assert victim.process.exitcode == -signal.SIGKILL
        # Only a sweep removes them (a Producer made in another xdist worker sweeps too, so
        # which sweep took them is not asked).
        sweep_stale()
        assert shm_segments(victim.pid) == []
        assert shm_segments(os.getpid()) == mine
    finally:
        victim.close()


def test_admit_says_which_transport_a_consumer_reads(kind, store):
    from tensorsocket.host import boot_id

    hello = {"boot_id": boot_id(), "label": "t", "pid": 1}
    assert store.admit(hello, True) == kind
    with pytest.raises(ProtocolError, match="another (host|machine)"):
        store.admit(hello | {"boot_id": "another-boot"}, False)
    # Another PID namespace on this machine: host shared memory either way; a GPU store
    # serves it from a host mirror of every place, kept up to date from then on.
    first = sample(SMALL, seed=1)
    put(store, 0, first)
    assert store.admit(hello, False) == "shm"
    kinds = sorted(d[0] for d in store.describe())
    assert kinds == (["shm"] if kind == "shm" else ["cuda", "shm"])
    reader = make_reader("shm", None)
    for descriptor in store.describe():
        if descriptor[0] == "shm":
            reader.announce(descriptor)
    plan = layout.plan(first)
    views, lease = read(reader, 0, plan.encode())
    assert same(views, first)  # written before the mirror began: copied into it
    del views, lease
    second = sample(BIG, seed=2)  # grows place 0: a new arena in every transport served
    plan = layout.plan(second)
    descriptors = store.install(store.prepare(0, plan.nbytes))
    assert sorted(d[0] for d in descriptors) == kinds
    fingerprint = store.write(0, plan).wait()
    for descriptor in descriptors:
        if descriptor[0] == "shm":
            reader.announce(descriptor)
    views, lease = read(reader, 0, plan.encode())
    assert same(views, second)  # written after: mirrored by the write itself
    assert reader.fingerprint(lease.token, plan.nbytes) == fingerprint
    del views, lease
    reader.close()
