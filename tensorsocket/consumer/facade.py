"""The public Consumer: a drop-in replacement for a DataLoader that yields the producer's
batches as zero-copy views. It checks its arguments, starts the I/O thread (which joins the
producer within ``timeout``) and hands iteration to :class:`~.iteration.Batches`."""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import logging
import os
import queue
import threading
import warnings
import weakref
from typing import Any

import torch

from .. import endpoint as endpoints
from .. import keys, protocol
from ..errors import Closed
from ..flow import LateJoin
from ..options import is_seconds
from ..rebatch import Rebatcher, batches_per_epoch
from ..transport import parse_device
from ..transport.device import check_visible
from ..wakeup import done_whole, stop_loop
from . import handshake, io_loop, resume
from .iteration import Batches, EpochIterator
from .resume import Position
from .shared import Settings, Shared

log = logging.getLogger("tensorsocket")

_UNLIMITED_PREFETCH = 1 << 16
#: The open Consumers of this process. A forked child shares their connections with its parent,
#: so one it inherited must not read or send there (it took the parent's next batch, and the
#: parent then failed on a layout it had never seen): each one refuses in the child.
_OPEN: weakref.WeakSet[Consumer] = weakref.WeakSet()


def _inherited_by_a_fork() -> None:
    for consumer in list(_OPEN):
        consumer._forked()


os.register_at_fork(after_in_child=_inherited_by_a_fork)


class Consumer:
    """Iterate the batches a :class:`~tensorsocket.Producer` shares.

    ``for batch in consumer`` runs one epoch and stops exactly at the producer's epoch end;
    iterate again for the next epoch. Batches are views of shared memory that stay valid as
    long as you hold any tensor of them; they are read-only by contract (use ``copy=True``
    for private copies). ``device`` is where tensors appear (views of a GPU producer's
    memory on its own GPU, else a copy there). ``batch_size`` / ``drop_last`` re-cut the
    producer's batches into batches of this size, as a DataLoader with them would (views
    where a batch lies inside one producer batch). ``late_join`` says where a consumer
    joining mid-epoch starts: ``"replay"`` (the current epoch from its first batch if the
    producer still has it, else the next epoch), ``"next_epoch"``, or ``"now"`` (the oldest
    batch the producer still has; that first epoch is partial). ``prefetch`` bounds the
    batches this consumer holds or has queued (default and maximum: the producer's slots).
    ``timeout`` is how long the producer may stay silent before :class:`ProducerLost` is
    raised, and how long this consumer may stay silent before the producer evicts it.
    ``stream`` (GPU batches only): the CUDA stream your work on the batches is queued on,
    when it is not the current stream at ``next()``; a batch's memory is released to the
    producer only after the work queued there before its last view died has run.

    Batches in host shared memory are mapped read-only: an in-place op on one (``x.sub_(m)``,
    ``x /= 255``) stops this process with a segmentation fault whose traceback (printed by
    :mod:`faulthandler`, enabled here unless the application did) names the line, and no
    other consumer ever sees a changed byte. Use out-of-place ops or ``copy=True``.
    ``check_writes=True`` maps them writable instead and checks each batch's sampled
    fingerprint when it is released (:class:`BatchModified` at the next ``next()``), as is
    always done for batches in GPU memory, which cannot be protected.

    ``group`` makes this consumer rank ``rank`` of ``world_size`` consumers that split the
    stream, as the ranks of one DDP job each take their share (defaults: torchrun's
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; the producer serves one node). Batch ``i`` of
    an epoch goes to rank ``i % world_size``; every rank gets the same number of batches per
    epoch, so all-reduces line up: ``group_tail="pad"`` sends the short last round again to
    the ranks it lacks (as DistributedSampler pads), ``"drop"`` drops it. Consumers of other
    groups, or of none, see the whole stream. The group starts when all its ranks joined and
    began iterating; if one leaves or dies, the others raise :class:`GroupBroken`.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        endpoint: str | None = None,
        device: str | torch.device = "cpu",
        copy: bool = False,
        timeout: float = 10.0,
        prefetch: int | None = None,
        batch_size: int | None = None,
        drop_last: bool = False,
        late_join: str = "replay",
        label: str | None = None,
        stream: Any = None,
        check_writes: bool = False,
        group: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group_tail: str = "pad",
        reconnect: float = 0.0,
    ) -> None:
        self._closed = True  # until the I/O thread joined: nothing to close, no warning
        if not is_seconds(timeout, 0.05, 86400):
            raise ValueError(f"timeout must be a number of seconds in [0.05, 86400], got {timeout!r}")
        if prefetch is not None and (type(prefetch) is not int or prefetch < 1):
            raise ValueError(f"prefetch must be a positive int or None, got {prefetch!r}")
        if not isinstance(copy, bool):
            raise ValueError(f"copy must be True or False, got {copy!r}")
        if not isinstance(check_writes, bool):
            raise ValueError(f"check_writes must be True or False, got {check_writes!r}")
        if not is_seconds(reconnect, 0, 86400):
            raise ValueError(f"reconnect must be a number of seconds in [0, 86400], got {reconnect!r}")
        try:
            self.late_join = LateJoin(late_join)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in LateJoin)
            raise ValueError(f"late_join must be one of {choices}, got {late_join!r}") from None
        membership = _membership(group, rank, world_size, group_tail, self.late_join, batch_size)
        self.group, self.rank, self.world_size, self.group_tail = membership or (None, None, None, group_tail)
        self.batch_size = batch_size
        self.drop_last = drop_last
        # Validates batch_size and drop_last; None: batches as the producer cut them.
        rebatcher = Rebatcher(batch_size, drop_last) if batch_size is not None else None
        if batch_size is None and drop_last is not False:
            raise ValueError(
                "drop_last needs a batch_size: without one the producer's batches arrive as they are"
            )
        self.device = parse_device(device)
        check_visible(self.device)
        self.endpoint = endpoints.resolve(name, endpoint)
        self.stream = stream
        self.copy = copy
        self.timeout = float(timeout)
        if label is None:  # a sweep's trial is known by its name (`tensorsocket sweep` sets it)
            label = os.environ.get("TENSORSOCKET_TRIAL", "")[:128] or f"pid {os.getpid()}"
        self.label = label
        if not isinstance(self.label, str) or len(self.label) > 128 or not self.label.isprintable():
            raise ValueError(
                f"label must be a printable string of at most 128 characters, got {self.label!r}"
            )
        key_folder = keys.client_folder(self.endpoint)
        settings = Settings(
            self.endpoint,
            self.label,
            self.timeout,
            min(prefetch or _UNLIMITED_PREFETCH, _UNLIMITED_PREFETCH),  # (the producer caps it at slots)
            self.late_join.value,
            batch_size,
            self.device,
            stream,
            copy,
            check_writes,
            membership,
            reconnect=float(reconnect),
            key_folder=key_folder,
            curve_keys=keys.client_keys(key_folder),  # (read once, now: KeysError here, naming the folder)
        )
        self._rebatcher = rebatcher
        self._join(settings, None)

    def _join(self, settings: Settings, restored: Position | None) -> None:
        """Start the I/O thread, which joins the producer (at ``restored``, if it can),
        and wait for the outcome; raise what went wrong."""
        if restored is not None:
            settings = dataclasses.replace(settings, resume=(restored.stream, restored.epoch, restored.index))
        self._settings = settings
        shared = self._shared = Shared()
        outcome: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._io = threading.Thread(
            target=io_loop.run, args=(shared, settings, outcome), name="tensorsocket-consumer-io", daemon=True
        )
        try:
            self._io.start()
            joined = handshake.outcome(outcome, shared, self.timeout, self.endpoint)
            if isinstance(joined, BaseException):
                self._io.join(timeout=5.0)
                shared.wakeup.close()
                raise joined
            self._joined(shared, settings, restored, joined)
        except BaseException:
            # Ctrl-C as it waited, say: else the thread stays joined, unseen (no Consumer to close)
            stop = functools.partial(stop_loop, shared.stop, shared.wakeup, self._io, gate=shared.link_lock)
            done_whole(stop)
            raise

    def _joined(self, shared: Shared, settings: Settings, restored: Position | None, joined: Any) -> None:
        welcome, reader, self._conn = joined  # _conn: the I/O thread's state (its reader changes at a rejoin)
        if not reader.checks_writes and not faulthandler.is_enabled():
            # A write to a read-only batch is a segmentation fault: let it print the Python
            # traceback of the line that wrote, not just "Segmentation fault".
            faulthandler.enable()
        self.batches_per_epoch: int | None = welcome["batches"]
        self.samples_per_epoch: int | None = welcome["samples"]
        self.slots: int = welcome["slots"]
        if self._rebatcher is not None:
            self._rebatcher.flush()
        self._batches = Batches(
            shared, settings, self._io, self._conn, self.slots, self._rebatcher, welcome["stream"], restored,
            self.batches_per_epoch, welcome["stragglers"] == "stall",
        )  # fmt: skip
        self._closed = False
        self._fork_error: Closed | None = None
        self._made_in = os.getpid()
        _OPEN.add(self)
        # At interpreter exit (or when dropped), stop the thread before zmq is torn down
        # under it: a daemon thread still using its socket then aborts the process. The
        # thread holds the shared record, not this object, so a dropped Consumer is
        # collected and its thread then leaves the producer (which drops its holds).
        weakref.finalize(self, stop_loop, shared.stop, shared.wakeup, self._io)

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is, for a checkpoint: after the last batch it handed out (as
        StatefulDataLoader's ``state_dict``). A small dict of plain values."""
        batches = self._batches
        position = batches.position() if batches.taken_any else batches.restored
        return resume.state_of(position, self.batch_size, self._group_key())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` saved earlier (a restarted trainer's checkpoint),
        before iterating: this consumer rejoins the producer at that position. Exact when the
        producer still has that batch or has not published it yet; else it goes on as its
        ``late_join`` says and logs how many batches it missed (``missed``). ValueError for a
        state of another kind, batch size or group."""
        self._check_open()
        restored = resume.position_of(state, self.batch_size, self._group_key())
        if self._batches.taken_any or self._shared.ready is not None:
            raise ValueError("load_state_dict() must come before iterating")
        if self.group is not None:  # its group starts once every rank began iterating
            self._batches.restore(restored)
            return
        self._leave()
        self._join(self._settings, restored)

    def _group_key(self) -> list[Any] | None:
        return None if self.group is None else [self.group, self.world_size]

    @property
    def repeated(self) -> int | None:
        """Batches of an epoch it had when a restarted producer that could not repeat its order
        published that epoch again, in a new order (None: none); a group rank's skipped ones
        (``missed``) count too if it starts again once more: ``repeated - missed`` is what it had."""
        return self._batches.repeated

    @property
    def missed(self) -> int | None:
        """Producer batches a restored or rejoining consumer lost because the producer no longer
        had them, or a group rank skipped to end a restarted epoch level (None: none, or unknown)."""
        restored, rejoins = self._batches.missed, self._shared.missed
        return (restored or 0) + rejoins if restored or rejoins else restored

    def __len__(self) -> int:
        """Batches per epoch: the producer loader's len(), or with ``batch_size`` what this
        consumer's re-cut yields. TypeError if the producer cannot tell."""
        if self.batch_size is None:
            if self.batches_per_epoch is None:
                raise TypeError("the producer's loader has no len()")
            if self.world_size is not None:  # this rank's share
                if self.group_tail == "drop":
                    return self.batches_per_epoch // self.world_size
                return -(-self.batches_per_epoch // self.world_size)
            return self.batches_per_epoch
        if self.samples_per_epoch is None:
            raise TypeError(
                "the producer cannot tell how many samples an epoch has (its loader is not a "
                "DataLoader with a sized sampler, nor a list), so len() with batch_size is unknown"
            )
        return batches_per_epoch(self.samples_per_epoch, self.batch_size, self.drop_last)

    def __iter__(self) -> EpochIterator:
        """The next epoch. If the previous epoch's loop was left early, its remaining batches
        are skipped (as a new DataLoader iterator starts a new epoch)."""
        self._check_open()
        self._batches.start_epoch()
        return EpochIterator(self._batches, owner=self)

    @property
    def skipped(self) -> int:
        """Batches the producer moved this consumer past (stragglers="skip")."""
        return self._batches.skipped

    @property
    def delivery(self) -> str:
        """ "views" (batches are views of the producer's memory: zero copy) or "copy" (copied
        to this consumer's device: a GPU other than the producer's, or the host; or private
        clones, ``copy=True``)."""
        return "copy" if self.copy else self._conn.reader.delivery

    @property
    def finished(self) -> bool:
        """True once the producer ended the stream and this consumer saw the end."""
        return self._batches.ended

    def close(self) -> None:
        """Leave the producer at once (it stops waiting for us and takes back every place this
        consumer held: batches you still hold may be overwritten mid-stream, so clone what
        you keep past close(); after the end of stream they stay valid). Idempotent. Raises,
        once closed, a Ctrl-C that landed as a batch was let go and no next() raised yet."""
        if self._closed:
            return
        if self._fork_error is None:  # (in a forked child, what it shares stays the parent's)
            self._leave()
        self._closed = True  # (after: a close() cut short by Ctrl-C is done again by the next)
        _OPEN.discard(self)
        self._shared.raise_interrupted()  # (a Ctrl-C that landed as the last batch was let go)

    def _forked(self) -> None:
        """In a forked child: refuse from now on (see _OPEN)."""
        self._fork_error = self._batches.error = Closed(
            f"this consumer of {self.endpoint} was made in process {self._made_in}, and this forked child "
            "cannot use it: its batches and connection are its parent's. Make a Consumer in the child"
        )

    def _leave(self) -> None:
        """Stop the I/O thread (it says BYE), drop what it queued, close the reader."""
        shared = self._shared
        stop_loop(shared.stop, shared.wakeup, self._io, timeout=5.0)
        while True:  # drop queued batches; their finalizers fire and are ignored now
            try:
                shared.queue.get_nowait()
            except queue.Empty:
                break
        self._batches.turns.held.clear()
        self._conn.reader.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"Consumer of {self.endpoint} was not closed", ResourceWarning, stacklevel=1)

    def _check_open(self) -> None:
        if self._fork_error is not None:
            raise self._fork_error
        if self._closed:
            raise Closed(f"consumer of {self.endpoint} is closed")


def _membership(
    group: Any, rank: Any, world_size: Any, tail: Any, late_join: LateJoin, batch_size: Any
) -> tuple[str, int, int, str] | None:
    """(group, rank, world size, tail) for a group member, None for a consumer that sees the
    whole stream; ValueError naming a bad or missing argument."""
    if group is None:
        if rank is not None or world_size is not None:
            raise ValueError("rank and world_size place a consumer in a group: pass group='...' too")
        if tail != "pad":
            raise ValueError("group_tail applies to a group member: pass group='...' too")
        return None
    if not isinstance(group, str) or not 1 <= len(group) <= 128:
        raise ValueError(f"group must be a name of 1 to 128 characters, got {group!r}")
    rank = _from_env(group, "rank", rank, "LOCAL_RANK")
    world_size = _from_env(group, "world_size", world_size, "LOCAL_WORLD_SIZE")
    if not 1 <= world_size <= 1 << 16:
        raise ValueError(f"group {group!r}: world_size must be from 1 to 65536, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"group {group!r}: rank must be from 0 to world_size - 1 = {world_size - 1}, got {rank}"
        )
    if tail not in protocol.TAILS:
        raise ValueError(f"group_tail must be 'pad' or 'drop', got {tail!r}")
    if late_join is LateJoin.NOW:
        raise ValueError(
            f"group {group!r}: a group starts at an epoch's first batch; use late_join='replay' or 'next_epoch'"
        )
    if batch_size is not None:
        raise ValueError(
            f"group {group!r}: a group member takes the producer's batches whole (a re-cut could give "
            "its ranks unequal batch counts); set the batch size in the producer's loader"
        )
    return group, rank, world_size, tail


def _from_env(group: str, what: str, value: Any, variable: str) -> int:
    """An int argument, or when None the environment variable torchrun sets for it."""
    if value is None:
        text = os.environ.get(variable)
        if text is None:
            raise ValueError(
                f"group {group!r}: {what} is not given and {variable} is not set; launch with "
                f"torchrun (which sets it) or pass {what}=..."
            )
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"group {group!r}: {variable}={text!r} is not an int") from None
    if type(value) is not int:
        raise ValueError(f"group {group!r}: {what} must be an int, got {value!r}")
    return value
