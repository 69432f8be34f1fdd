"""A producer's place in its stream, kept in a small file beside its socket, so that a
successor started with ``resume=True`` continues the stream where consumers can rejoin it.

Where the successor starts: the *restart point*, the oldest entry some consumer may not have
received (it holds it, and the BATCH may have been in flight when the producer died, or it
was not sent yet: :meth:`Flow.restart_point`). Every consumer is at or past it, so each
rejoins exactly at the batch after the last one it received; the few batches between are
published again and dropped by whoever already has them. Numbers (stream id, seq, epoch,
index) stay the same, so a consumer's position means the same batch on the successor.

How the successor reproduces the stream from there (a :class:`Point`):

* ``stateful``: the loader has ``state_dict()`` / ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``) and no worker processes (:func:`mode_of` says why): mid-epoch, its
  state after the batch before the point is loaded, and the random states of this process
  are put back as they were there (its augmentations draw from them, and the next epoch's
  order from its generator; its own state holds neither). At an epoch's start, as for
  ``rerun``: its state there is only "finished", and loading that makes StatefulDataLoader
  0.11 draw the next epoch's order from a generator state other than the one an
  uninterrupted run has.
* ``rerun``: any other loader, a StatefulDataLoader with workers too. The random states its
  epoch order and augmentations draw from (torch's, Python's and NumPy's global generators
  and the loader's own ``generator``) are restored to what they were at the epoch's start,
  and the epoch runs again up to the point without publishing. That is exact when the epoch
  depends on nothing else; the successor checks it: the batch before the point must have the
  fingerprint the predecessor recorded.
  If not, it starts the epoch again from its first batch, as a new stream that names the old
  one, and consumers are told how many batches they get again.

The file is written with ``torch.save`` (states hold tensors) to a temporary name and renamed
over the old one, at most every :data:`WRITE_EVERY` seconds (a point that lags only means a
few more batches are published again) and at once when a joiner that replays moves the point
back (before it is sent a batch: a point ahead of it would lose what it has not got), and read with ``weights_only=True``: tensors and plain
containers only, nothing a file could use to run code.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# Now, not when a resume first uses np.random (numpy loads it lazily): a Ctrl-C landing in its
# extension modules' initialisation is swallowed there, and a successor stopped that way went
# on to serve (1 in 8 SIGINTs sent as its rerun began).
import numpy.random  # noqa: F401
import torch

from .. import fingerprints, layout, protocol
from ..errors import StateFileError
from ..flow import Flow
from ..pooled_collate import LoaderPool
from .state_file import (
    Point,
    State,
    applying,
    check_matches,
    decode,
    encode,
    read,
    remove,
    remove_leftovers,
    state_path,
    write,
)

# the state file's API, re-exported: restart is what the producer and tests use
__all__ = [
    "Point",
    "State",
    "applying",
    "check_matches",
    "decode",
    "encode",
    "read",
    "remove",
    "remove_leftovers",
    "state_path",
    "write",
]

log = logging.getLogger("tensorsocket")

WRITE_EVERY = 0.1  # seconds between writes of the state file
STATEFUL, RERUN = "stateful", "rerun"


def mode_of(loader: Any) -> str:
    """``stateful`` when the loader saves and loads its own state and draws in this process
    (no worker processes), else ``rerun``. A StatefulDataLoader's state does not hold its
    workers' random states: a load reseeds them as at the epoch's start (torchdata 0.11,
    ``stateful_dataloader/worker.py``), so what they draw (augmentations) differs from
    before, and checking the batch at the point does not catch it: loaded after batch 0, 2
    workers give batch 1 right (worker 1 had drawn nothing) and batch 2 wrong (worker 0 draws
    batch 0's numbers again)."""
    has = all(callable(getattr(loader, m, None)) for m in ("state_dict", "load_state_dict"))
    return STATEFUL if has and not getattr(loader, "num_workers", 0) else RERUN


def describe(loader: Any, batches: int | None, samples: int | None) -> dict[str, Any]:
    """What a successor's loader must match for a resume to mean the same stream."""
    kind = type(loader)
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "batches": batches,
        "samples": samples,
        "mode": mode_of(loader),
    }


def rng_state(loader: Any) -> dict[str, Any]:
    """The random states an epoch may draw from in this process (see the module docstring)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    generator = getattr(loader, "generator", None)
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
    }


def set_rng_state(loader: Any, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator) and state["generator"] is not None:
        generator.set_state(state["generator"])


def plan_fingerprint(p: layout.Plan) -> int:
    """A sampled fingerprint of every leaf's bytes where the leaf is (host or GPU), read
    through :func:`fingerprints.sampling` (~1 KiB a leaf): the same batch gives the same number wherever
    it was written, padding between leaves not read."""
    total = 0
    for leaf, src in zip(p.leaves, p.sources, strict=True):
        if leaf.nbytes:
            stride, _ = fingerprints.sampling(leaf.nbytes)
            data = layout.leaf_bytes(src)
            samples = data.numpy()[::stride] if data.device.type == "cpu" else data[::stride].cpu().numpy()
            total = (total * 1_000_003 + fingerprints.of_samples(samples, leaf.nbytes)) % (1 << 64)
    return total


def content_fingerprint(plan: layout.Plan) -> int:
    """A batch's identity, cheaply: its layout (tree, scalar leaves, shapes) and a sampled
    fingerprint of each tensor leaf's bytes. Padding between leaves is not read, so the same
    batch gives the same number wherever it was written."""
    shape = zlib.crc32(msgpack.packb(plan.encode(), use_bin_type=True))
    return (shape * 1_000_003 + plan_fingerprint(plan)) % (1 << 64)


def _locked(method: Any) -> Any:
    @functools.wraps(method)
    def run(self: Tracker, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return run


@dataclass
class Tracker:
    """The caller's thread's record of how to restart from each entry a consumer may still
    need (points and fingerprints by seq), and the throttled writes of the state file."""

    path: Path
    loader: Any
    description: dict[str, Any]
    stream: str
    points: dict[int, Point] = field(default_factory=dict)
    fingerprints: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # seq -> (epoch, index, fp)
    epoch_rng: dict[int, dict[str, Any]] = field(default_factory=dict)  # at each epoch's start
    last_write: float = 0.0
    lagging: bool = False  # a write was skipped (WRITE_EVERY): due once that much time passed
    written: int | None = None  # the restart point last written
    joins: int = 0  # the Shared.joins of the last write: a point taken before a join is stale
    restarted: list[Any] | None = None  # written with each state: see state_file.State
    consumers: int = 0  # the consumers last written: one more is written at once (a successor waits for it)
    seconds_writing: float = 0.0  # for the benchmark: the file's cost
    done: bool = False  # the stream ended: the file is gone and stays gone
    # close() from another thread may end the epoch and the stream while the caller's thread
    # publishes: every method holds it
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def stateful(self) -> bool:
        return self.description["mode"] == STATEFUL

    def loader_state(self) -> Any:
        return self.loader.state_dict() if self.stateful else None

    def resumed(self, resumed: Resumed) -> None:
        """A successor's first point: where it restarts (so its first write can be made)."""
        seq = resumed.first_seq + resumed.index
        self.epoch_rng[resumed.epoch] = resumed.rng
        self.restarted = resumed.restarted
        # (not the loader's state now: it may have pulled the batch at the point to check it)
        state = resumed.loader_state if self.stateful and resumed.index and not resumed.at_end else None
        self.points[seq] = Point(
            resumed.epoch, resumed.first_seq, resumed.index, resumed.rng, state, resumed.at_end
        )

    @_locked
    def epoch_started(self, epoch: int, seq: int) -> None:
        """Before ``set_epoch`` and ``iter()``: the epoch's random states and a point at its start."""
        rng = self.epoch_rng[epoch] = rng_state(self.loader)
        self.points[seq] = Point(epoch, seq, 0, rng)

    @_locked
    def fingerprinted(self, seq: int, epoch: int, index: int, fingerprint: int) -> None:
        """Batch ``seq`` is about to go out (lock held): any state written once a consumer may
        have it must let a successor check it, or an epoch that does not repeat goes unseen."""
        self.fingerprints[seq] = (epoch, index, fingerprint)

    @_locked
    def published(self, seq: int, epoch: int, first_seq: int, index: int) -> None:
        """Batch ``seq`` went out: record the point after it."""
        # A stateful loader resumes mid-epoch from its own state; the random states there are
        # what its augmentations (drawn in this process: it has no workers) draw from next.
        # (~140 us, NumPy's ~90 of it: the price of exactness here)
        rng = rng_state(self.loader) if self.stateful else self.epoch_rng[epoch]
        self.points[seq + 1] = Point(epoch, first_seq, index + 1, rng, self.loader_state())

    @_locked
    def epoch_ended(self, seq: int, epoch: int, first_seq: int, batches: int) -> None:
        """Its end marker (entry ``seq``) went out: the epoch is known to end there, and the
        next one starts after it with the random states as they are now."""
        rng = rng_state(self.loader)
        self.points[seq] = Point(epoch, first_seq, batches, rng, ended=True)
        self.points[seq + 1] = Point(epoch + 1, seq + 1, 0, rng)
        self.epoch_rng.pop(epoch - 1, None)

    @_locked
    def save(
        self, restart_point: int, keep_from: int, consumers: int, joins: int, force: bool = False
    ) -> None:
        """Write the state for ``restart_point`` (at most every WRITE_EVERY seconds unless
        ``force``, or the ``consumers`` a successor waits for changed) and forget what no
        restart can need any more. The caller's thread takes a point under the producer's lock
        and writes it after: one taken before the I/O thread wrote a joiner's (``joins`` is
        older) would undo that, so it is not written."""
        now = time.monotonic()
        soon = now - self.last_write < WRITE_EVERY and consumers == self.consumers
        if joins < self.joins:
            return
        if not force and soon:
            self.lagging = True
            return
        point = self.points.get(restart_point)
        if point is None:  # nothing published since the last point was written
            return
        for table in (self.points, self.fingerprints):
            for seq in [s for s in table if s < keep_from - 1]:
                del table[seq]
        prints = {(e, i): fp for s, (e, i, fp) in self.fingerprints.items() if s >= restart_point - 1}
        t0 = time.perf_counter()
        if self.done:
            return
        state = State(self.stream, self.description, point, prints, consumers, self.restarted)
        write(self.path, encode(state))
        self.seconds_writing += time.perf_counter() - t0
        self.last_write, self.written, self.joins, self.consumers = now, restart_point, joins, consumers
        self.lagging = False

    def catch_up_due(self, now: float) -> bool:
        """A write skipped for WRITE_EVERY is due: made by the I/O thread, as nothing may publish
        again soon to make it (the window full under a consumer that holds its batches)."""
        return self.lagging and now - self.last_write >= WRITE_EVERY

    def behind(self, restart_point: int) -> bool:
        """Has the restart point moved back past the one written (a consumer joined and
        replays)? Then the file must say so before the joiner is sent anything."""
        return self.written is not None and restart_point < self.written

    @_locked
    def ended(self) -> None:
        """The stream ended (consumers were told): nothing to resume; remove the file."""
        self.done = True
        remove(self.path)


@dataclass
class Resumed:
    """Where a successor continues (see :func:`resume`), for the flow and the publisher."""

    stream: str
    epoch: int
    first_seq: int
    index: int
    rng: dict[str, Any]  # the epoch's random states at its start (for the points after this one)
    consumers: int
    fingerprints: dict[tuple[int, int], int]  # batches it publishes again: each must match
    iterator: Iterator[Any] | None = None  # the epoch's loader iterator at ``index`` (None: start it)
    pending: list[Any] = field(default_factory=list)  # batch ``index``, pulled to check it: published first
    at_end: bool = False  # the epoch ends at ``index``: its end marker comes next
    loader_state: Any = None  # stateful, mid-epoch: the state loaded (the point's, for the next file)
    restarted: list[Any] | None = None  # the epoch starts again, as a new stream: protocol.replaced_streams


def resume(
    loader: Any,
    state: State,
    new_stream: str,
    pool: LoaderPool,
    path: Path,
    progress: Callable[[int], None] | None = None,
) -> Resumed:
    """Make ``loader`` continue the stream ``state`` describes (see the module docstring): load
    its state, or restore the random states and run the epoch again up to the point, checking
    the batch before it (a batch at the point that was published is pulled and checked too).
    A rerun whose batch differs starts the epoch again as ``new_stream``; a stateful loader
    whose batch differs raises StateFileError. The iterator is opened through ``pool`` (its workers
    keep the collate they start with, for the producer's life). ``progress``: told the
    batches pulled so far, after each."""
    p, stateful = state.point, state.loader["mode"] == STATEFUL
    out = Resumed(state.stream, p.epoch, p.first_seq, p.index, p.rng, state.consumers, state.fingerprints)
    out.loader_state, out.restarted = p.loader_state, state.restarted  # (its consumers may rejoin still)
    mid_epoch = stateful and p.index > 0 and not p.ended
    with applying(path):  # (what the loader does from iter() on raises its own errors)
        if mid_epoch:
            loader.load_state_dict(p.loader_state)
        else:  # before iter(): the epoch's order is drawn there
            set_rng_state(loader, p.rng)
    if p.ended:  # the next epoch starts as after its end (an epoch's start needs no loader state)
        out.at_end = True
        return out
    it = pool.open(p.epoch)
    if mid_epoch:  # iter() drew from the generators again: put them back as they were there
        with applying(path):
            set_rng_state(loader, p.rng)
    if stateful or p.index == 0:  # check the batch at the point, if it was published
        skip, checked = 0, (p.epoch, p.index)
    else:  # run the epoch again up to the point; check the batch before it
        skip, checked = p.index, (p.epoch, p.index - 1)
    expected = state.fingerprints.get(checked)
    wanted = skip + (checked[1] == p.index and expected is not None)
    last, plan, pulled = None, None, 0
    while pulled < wanted:
        pool.before_pull()
        try:
            last = next(it)
        except StopIteration:
            break
        plan = layout.plan(last)  # (the last one's is checked below)
        pool.pulled(plan.sources)
        pulled += 1
        if progress is not None:
            progress(pulled)
    if pulled == wanted and (expected is None or content_fingerprint(plan) == expected):
        out.iterator = it
        out.pending = [last] if checked[1] == p.index and last is not None else []
        return out
    if stateful:
        raise StateFileError(
            f"the loader, loaded with its saved state, gives batch {checked[1]} of epoch {p.epoch} other than "
            "before the restart (its dataset or order changed?): remove the state file to begin a fresh stream"
        )
    log.warning(
        "the loader does not repeat epoch %d's order (batch %d differs from the one published before the "
        "restart): the epoch starts again from its first batch, as a new stream",
        p.epoch, checked[1],
    )  # fmt: skip
    set_rng_state(loader, p.rng)
    again = protocol.restarting(state.stream, p.epoch, state.restarted)
    return Resumed(new_stream, p.epoch, p.first_seq, 0, p.rng, state.consumers, {}, restarted=again)


def rejoinable(flow: Flow) -> int:
    """Consumers served with a position to lose: sent something, or rejoined us after what our
    predecessor sent them. Each rejoins a successor after what it received, and the state file
    tells the successor to wait for them; one with nothing goes on with whatever stream it finds."""
    return len([c for c in _served(flow) if c.last_sent is not None or c.rejoined])


def rejoined(flow: Flow) -> int:
    """Consumers served that rejoined us after what our predecessor sent them: a successor
    counts these, not new consumers, against the ones its state file names."""
    return len([c for c in _served(flow) if c.rejoined])


def _served(flow: Flow) -> list[Any]:
    """The consumers :meth:`Flow.serving` counts: not waiting for their group, not cut off."""
    return [c for c in flow.consumers.values() if not (c.broken or c.forming)]
