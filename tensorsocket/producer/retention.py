"""The batches a producer keeps for replay: the loader's own batches, held by reference (no
copy, no place of their own), written into a place again when a late joiner is to be sent one
(:meth:`tensorsocket.flow.Flow.restage`).

Why: a replay buffer of places meant that every batch of the first epoch went to a place made
for it, and every consumer mapped it: in the 4-trainer JPEG scenario (19 MB batches) the
producer spent 8-10 ms a batch more and the consumers together 4-5 ms more than with
``replay=0`` (``sharing-vm-2026-11-24-cpu-split.json``), and on a GPU the buffer was GPU memory.
Kept by reference, a batch costs nothing until a joiner needs it; then one copy into a place.

Bounds: bytes (the replay budget), batches (one epoch, at most 4096), and open files: a
DataLoader's worker hands each tensor over in shared memory whose file descriptor the tensor
keeps open (measured: 200 kept batches of 2 tensors held 400 more), so leaves in shared memory
count against a quarter of the process's file limit.

Exactness: a kept batch is the loader's memory, which a loader that reuses its buffers, or a
producer loop that changes a batch in place, may change after it was published. Each kept
batch's sampled fingerprint is taken when it is published, and the newest one is checked when
the next batch is pulled. If it changed, its bytes are copied back out of its place (still
intact then), and from then on every batch is kept as such a copy, with a warning. At re-stage
a batch is checked again, and one that changed anyway stops the producer with an error rather
than be sent under its number with other bytes.
"""

from __future__ import annotations

import collections
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import layout, protocol
from ..transport.base import Room, Store
from ..transport.shm import room as shm_room
from .io_loop import IoLoop
from .restart import plan_fingerprint
from .room import room_to_grow
from .shared import Shared

log = logging.getLogger("tensorsocket")

MIB = 1 << 20
MAX_BATCHES = 4096
#: How long a joiner waits for a place, every place held, before the producer adds one: long
#: enough for holders that are only slow (a training step, a consumer closing or dying) to let
#: go, short beside a consumer's timeout. Holders that never will are each waiting in a loop
#: for a batch that comes only after the joiner's (a slots=2 stream, a joiner and a leader).
GROW_AFTER = 1.0
#: A batch smaller than this is kept as a copy of its place: copying it costs less than the
#: two sampled fingerprints that keeping the loader's own takes (tiny batches, 4 consumers: the
#: producer 290 us a batch with the fingerprints, against 186 us with replay=0), and holds no file.
COPY_BELOW = 256 << 10  # a joiner never needs more than an epoch; this bounds the bookkeeping


@dataclass
class Kept:
    """One kept batch and what its BATCH message needs besides the place."""

    seq: int
    plan: layout.Plan  # the loader's leaves, or one flat uint8 leaf: a copy of the place's bytes
    epoch: int
    index: int
    layout: Any  # the layout's number in the stream's table (or the layout itself)
    fingerprint: int | None  # of the leaves' bytes at publish; None for a copy (ours: it cannot change)
    files: int  # file descriptors its leaves hold open


class Retention:
    """The kept batches, oldest first. Used under the producer's lock."""

    def __init__(self) -> None:
        self.budget = 0  # bytes; 0: keep nothing
        self.max_batches = 0
        self.max_files = max(16, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
        self.copies = False  # a kept batch changed after it was published: keep copies from now on
        self._kept: collections.deque[Kept] = collections.deque()
        self._by_seq: dict[int, Kept] = {}
        self._bytes = self._files = 0  # of every kept batch

    def size(self, budget: int, max_batches: int) -> None:
        self.budget, self.max_batches = budget, min(max_batches, MAX_BATCHES)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, seq: int) -> Kept:
        return self._by_seq[seq]

    def add(self, kept: Kept) -> int:
        """Keep ``kept`` (just published); how many of the newest batches fit the bounds."""
        self._kept.append(kept)
        self._by_seq[kept.seq] = kept
        self._bytes += kept.plan.nbytes
        self._files += kept.files
        count, nbytes, files = len(self._kept), self._bytes, self._files
        for k in self._kept:  # leave out the oldest until the rest fit (at once, mostly: O(1) a batch)
            if count <= self.max_batches and nbytes <= self.budget and files <= self.max_files:
                break
            count, nbytes, files = count - 1, nbytes - k.plan.nbytes, files - k.files
        return count

    def prune(self, kept_from: int) -> None:
        """Let go of every batch before ``kept_from`` (the flow keeps none of them)."""
        while self._kept and self._kept[0].seq < kept_from:
            gone = self._kept.popleft()
            del self._by_seq[gone.seq]
            self._bytes -= gone.plan.nbytes
            self._files -= gone.files

    @property
    def newest_copy(self) -> bool:
        """The newest kept batch is a copy of its place (ours: it cannot change), or none is kept."""
        return not self._kept or self._kept[-1].fingerprint is None

    def newest_changed(self) -> Kept | None:
        """The newest kept batch, if its bytes are not what was published (checked when the next
        batch was pulled: a loader that reuses its buffer has written the next one there)."""
        if self.newest_copy:
            return None
        newest = self._kept[-1]
        return newest if plan_fingerprint(newest.plan) != newest.fingerprint else None

    def replace(self, seq: int, copy: torch.Tensor | np.ndarray) -> None:
        """Keep ``copy`` (the place's bytes, copied out) for ``seq`` instead of the loader's leaves."""
        old = self._by_seq[seq]
        self._files -= old.files
        old.plan, old.fingerprint, old.files = flat_plan(copy), None, 0


def open_files(plan: layout.Plan) -> int:
    """File descriptors the plan's leaves keep open: one per tensor in shared memory (a
    DataLoader worker's), none for ordinary, pinned or GPU memory."""
    return sum(1 for src in plan.sources if isinstance(src, torch.Tensor) and src.is_shared() and src.is_cpu)


def flat_plan(data: torch.Tensor | np.ndarray) -> layout.Plan:
    """A plan that writes ``data`` (a place's bytes, flat uint8) back as they were."""
    nbytes = data.nbytes
    return layout.Plan(None, (layout.Leaf("uint8", (nbytes,), 0, nbytes),), (data,), nbytes)


def copy_out(store: Store, place: int, nbytes: int) -> torch.Tensor | np.ndarray:
    """A host copy of a written place's first ``nbytes`` (from host memory, NumPy's: ~0.6 us
    for a tiny batch against ~4 us for torch's slice-and-copy, for every batch kept)."""
    region = store.region(place)
    if region.is_cpu:
        return region.numpy()[:nbytes].copy()
    return region[:nbytes].to("cpu", copy=True)


class Replay:
    """The producer's side of replay: what it keeps of each batch it publishes, the checks that
    a kept batch did not change, and writing one into a place again for a joiner. Used by the
    thread that publishes, and by whichever waits for consumers (close() too), lock not held."""

    def __init__(self, shared: Shared, io: IoLoop) -> None:
        self.shared, self.io = shared, io
        self.kept = Retention()
        self.blocked_since: float | None = None  # a joiner waits for a place to be re-staged into

    def size(self, plan: layout.Plan, room: Room | None) -> None:
        """Size the replay buffer now that a batch's size is known: at most the budget's bytes,
        an epoch of batches, and (leaves in shared memory) what /dev/shm has room for beside
        the window (``room``: the store's, for the window's places)."""
        shared, config, nbytes = self.shared, self.shared.config, plan.nbytes
        batches = MAX_BATCHES
        if config.batches_per_epoch is not None:
            batches = min(batches, config.batches_per_epoch)  # one whole epoch is all a joiner needs
        budget = self._fit(nbytes, config.replay, batches, open_files(plan) > 0, room)
        self.kept.size(budget, batches)
        with shared.changed:
            shared.replay_batches = min(budget // max(nbytes, 1), batches)
        log.info(
            "replay buffer: %d batches of %d bytes, kept where the loader made them (budget %d bytes)",
            shared.replay_batches, nbytes, config.replay,
        )  # fmt: skip

    def _fit(self, nbytes: int, budget: int, batches: int, shared_leaves: bool, room: Room | None) -> int:
        """The replay budget, cut (saying so) to half of what /dev/shm has left when the loader's
        batches are in shared memory (a DataLoader's workers), so that keeping them never leaves
        its workers short."""
        window = self.shared.flow.place_count
        shm = shm_room(nbytes)
        if not shared_leaves or shm is None or budget <= 0:
            return budget
        free = shm.free_bytes - (
            window * shm.arena_bytes if room is not None and room.where == shm.where else 0
        )
        room_for = max(0, free // 2)
        if budget > room_for:
            log.warning(
                "replay buffer cut from %d to %d batches: %s has %.0f MiB free after the window's places, and "
                "the loader's batches are in shared memory there (replay= sets the budget; to keep more, %s)",
                min(budget // max(nbytes, 1), batches), room_for // max(nbytes, 1), shm.where, free / MIB,
                shm.remedy,
            )  # fmt: skip
            return room_for
        return budget

    def to_keep(self, place: int, plan: layout.Plan) -> tuple[layout.Plan, int | None, int] | None:
        """What to keep of a batch just written into ``place`` for replay: the loader's leaves
        and their fingerprint (and the files they hold open), or a copy of the place's bytes (a
        small batch, or any once a kept batch changed after it was published); None when keeping
        nothing."""
        if not self.kept.budget:
            return None
        if self.kept.copies or plan.nbytes < COPY_BELOW:
            return flat_plan(copy_out(self.shared.store, place, plan.nbytes)), None, 0
        return plan, plan_fingerprint(plan), open_files(plan)

    def check_newest(self) -> None:
        """The newest kept batch, checked now that the next one was pulled: if the loader reused
        its buffer (or the loop changed the batch in place), keep a copy of its place's bytes,
        and copies from now on."""
        if self.kept.newest_copy:  # (nothing to check: no lock taken for every tiny batch. Read
            return  # unlocked: only this thread adds, replaces or lets go of kept batches)
        shared = self.shared
        with shared.changed:
            changed = self.kept.newest_changed()
            if changed is None:
                return
            place = shared.flow.place_of(changed.seq)
            if not self.kept.copies:
                log.warning(
                    "batch %d of epoch %d changed after it was published (the loader reuses its output "
                    "buffers, or the producer's loop changes batches in place): from now on the producer "
                    "keeps a copy of each batch for replay (replay=0 keeps none)",
                    changed.index, changed.epoch,
                )  # fmt: skip
                self.kept.copies = True
            if place is not None:
                self.kept.replace(changed.seq, copy_out(shared.store, place, changed.plan.nbytes))

    def job(self) -> tuple[int, int] | None:
        """A kept batch a joiner waits for and the place reserved to write it into (lock held).
        After the joiner has waited :data:`GROW_AFTER` seconds with every place held, a new
        place (see :meth:`Flow.restage`): by then the holders are not merely slow to let go."""
        if not self.kept:
            self.blocked_since = None
            return None
        flow = self.shared.flow
        job = flow.restage()
        if not flow.blocked:
            self.blocked_since = None
            return job
        now = time.monotonic()
        if self.blocked_since is None:
            self.blocked_since = now
            return job
        if now - self.blocked_since < GROW_AFTER:
            return job
        short = room_to_grow(self.shared)
        if short is not None:
            reason = f"this joiner waited for a batch of its replay to be written again while every place was held, and {short}"
            evicted = self._evict_waiting(None, "no room to replay to it", reason)
            log.error("%s: %d joiner(s) evicted", reason, evicted)
            self.blocked_since = None
            if self.shared.io_wanted:
                self.shared.wakeup.wake()
        elif (job := flow.restage(grow=True)) is not None:
            log.info(
                "a joiner waited %.1f s for batch %d to be written again while every place was held (each "
                "consumer's loop holding the batch it last got): one place more, %d now",
                now - self.blocked_since, job[0], flow.place_count,
            )  # fmt: skip
            self.blocked_since = None
        return job

    def restage(self, seq: int, place: int) -> None:
        """Write kept batch ``seq`` into ``place`` (which :meth:`Flow.restage` reserved) again and
        send it to the joiners waiting for it. On any error the place is given back."""
        shared = self.shared
        settled = False  # the place went to its batch, or back to the flow
        try:
            with shared.changed:  # (plan and fingerprint together: check_newest may replace both)
                kept = self.kept.get(seq)
                plan, published = kept.plan, kept.fingerprint
                check = shared.fingerprints_wanted()
            if published is not None and plan_fingerprint(plan) != published:
                settled = True  # (given back there)
                self._cannot_resend(kept, place)
                return
            fingerprint = shared.write(place, plan, check)
            with shared.changed:
                if fingerprint is None and shared.fingerprints_wanted():
                    fingerprint = shared.store.fingerprint(place, plan.nbytes)
                frame = protocol.encode_batch(seq, kept.epoch, kept.index, place, kept.layout, fingerprint)
                actions = shared.flow.restaged(place, frame)
                settled = True
                shared.send_all(actions)
                shared.stats["restaged"] += 1
                wake = shared.io_wanted
        except BaseException:
            if not settled:
                with shared.changed:
                    shared.flow.cancel(place)
            raise
        if wake:
            shared.wakeup.wake()

    def _cannot_resend(self, kept: Kept, place: int) -> None:
        """Kept batch ``kept`` changed after it was published, unnoticed until now: rather than
        send other bytes under its number, evict the joiners waiting for it, saying why."""
        shared = self.shared
        reason = (
            f"batch {kept.index} of epoch {kept.epoch} changed after it was published, so it cannot be sent "
            "again as it was: the producer's loader reuses its output buffers, or its loop changes batches "
            "in place. Start with the next epoch (late_join='next_epoch'), or give the producer replay=0 "
            "or a loader that makes each batch anew"
        )
        with shared.changed:
            shared.flow.cancel(place)
            evicted = self._evict_waiting(kept.seq, "a batch it replays changed", reason)
            wake = shared.io_wanted
        log.error("%s (%d consumer(s) evicted)", reason, evicted)
        if wake:
            shared.wakeup.wake()

    def _evict_waiting(self, seq: int | None, why: str, reason: str) -> int:
        """Evict the joiners waiting for kept batch ``seq`` (None: for any) to be written again,
        telling them ``reason`` (lock held); how many."""
        consumers = self.shared.flow.consumers
        waiting = [c for c, s in consumers.items() if s.wants is not None and (seq is None or s.wants == seq)]
        for cid in waiting:
            self.io.drop(cid, f"evicted: {why}", reason)
        return len(waiting)
