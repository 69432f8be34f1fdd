"""The public Producer: checks its arguments, wires the shared record, the I/O thread and
the publisher together, and gives the user serve(), the epoch loop, status() and close()."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .. import endpoint as endpoints
from .. import sharding
from ..errors import Closed, IoThreadDied, TensorSocketError
from ..flow import Flow
from ..options import STRAGGLERS, default_max_lag, is_seconds
from ..pooled_collate import LoaderPool
from ..rebatch import batch_length
from ..status import ProducerStatus
from ..transport import Store, open_store
from ..wakeup import Wakeup, done_whole, stop_loop
from . import restart, successor
from .io_loop import IoLoop
from .publisher import Publisher
from .shared import Config, Shared

log = logging.getLogger("tensorsocket")


def default_replay_bytes() -> int:
    """The replay budget when none is given: 1 GiB, or a quarter of the free shared memory
    if that is less (containers often have a small /dev/shm)."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    return min(1 << 30, free // 4)


class Producer:
    """Share every batch of ``loader`` with the consumers that connect to ``name``.

    ``loader`` is any re-iterable of batches (a DataLoader, a list) or a function returning
    an iterable (a generator function), called once per epoch. At each epoch's start the
    producer calls ``set_epoch(epoch)`` on the loader, its sampler, batch sampler and dataset
    (each that has one, once), as a training loop would, so a ``DistributedSampler`` or any
    epoch-seeded order changes from epoch to epoch. ``device`` is where batches live while
    consumers read them: host shared memory ("cpu") or GPU memory shared by CUDA IPC
    ("cuda:N"). The producer runs at most ``slots`` batches ahead of the slowest consumer
    (``stragglers="stall"``, exact), or moves a consumer lagging more than ``max_lag``
    batches ahead and tells it what it skipped (``"skip"``). Beyond the window it keeps up
    to ``replay`` bytes of already-consumed batches, so late joiners can be sent the current
    epoch from its start. Nothing is pulled from the loader until ``min_consumers``
    consumers have joined (or, with ``grace``, that many seconds after the first one
    joined), nor while no consumer is connected. See the README for the whole contract.
    """

    def __init__(
        self,
        loader: Iterable[Any] | Callable[[], Iterable[Any]],
        name: str | None = None,
        *,
        endpoint: str | None = None,
        device: str = "cpu",
        slots: int = 8,
        replay: int | None = None,
        min_consumers: int = 1,
        grace: float | None = None,
        stragglers: str = "stall",
        max_lag: int | None = None,
        linger: float = 10.0,
        resume: bool = False,
    ) -> None:
        max_lag = _check_arguments(loader, slots, min_consumers, replay, grace, stragglers, max_lag, linger)
        if not isinstance(resume, bool):
            raise ValueError(f"resume must be True or False, got {resume!r}")
        self.loader = loader
        self.endpoint = endpoints.resolve(name, endpoint)
        self.slots = slots
        self.replay = default_replay_bytes() if replay is None else replay
        self.min_consumers = min_consumers
        self.grace = grace
        self.stragglers = stragglers
        self.max_lag = max_lag
        self.linger = float(linger)
        try:
            self.batches_per_epoch: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            self.batches_per_epoch = None
        self.samples_per_epoch = _samples_per_epoch(loader)
        self._closed = True  # until everything below exists: nothing to close, no warning
        self._close_lock = threading.RLock()
        # Under skip the leader's window, a straggler's unsent batches (up to max_lag behind
        # it) and the batches each of them holds must all fit with room to spare, or the
        # leader would be paced by the straggler's releases.
        flow = Flow(window=slots, places=slots * (3 if stragglers == "skip" else 1), max_lag=max_lag)
        # (made before the name is locked: it refuses a max_lag out of range)
        self._lock_file = endpoints.lock(self.endpoint)
        try:
            pool = LoaderPool(loader)
            begun = successor.begin(
                loader, self.endpoint, resume, self.batches_per_epoch, self.samples_per_epoch
            )
            store = open_store(device)
        except BaseException:
            self._release_lock()
            raise
        self.device = store.device
        config = Config(
            self.endpoint,
            slots,
            self.replay,
            stragglers,
            max_lag,
            self.batches_per_epoch,
            self.samples_per_epoch,
            uuid.uuid4().hex if begun is None else begun.stream,
            None,
            begun is not None and begun.state is not None,
        )
        self._shared = Shared(config, flow, store)
        self._shared.preparing = None if begun is None else begun.preparing
        self._io = IoLoop(self._shared, self.endpoint, owner=self)
        try:
            bound = self._io.start()
            successor.bound(self.endpoint, fresh=begun is None)
            if bound != self.endpoint:  # a tcp ":*" endpoint: the port the OS picked
                self.endpoint = bound
                self._shared.config = dataclasses.replace(config, endpoint=bound)
            tracker, resumed = self._prepare(begun, pool)
            self._publisher = Publisher(self._shared, self._io, pool, min_consumers, grace, tracker, resumed)
            with self._shared.changed:  # (after the publisher: the WELCOMEs say whom it waits for)
                successor.settle(self._shared, resumed, tracker)
        except BaseException:  # (Ctrl-C, say: else the I/O thread would serve the name on, unseen)
            done_whole(self._stop_and_free)
            raise
        self._closed = False
        # If close() is never called (a script without `with` that raises): at exit, stop the
        # I/O thread before zmq is torn down under it (that aborts the process) and free the
        # arenas. The I/O thread keeps `self` alive (a serving producer must not vanish under
        # its consumers), so __del__ would not run.
        shared = self._shared
        weakref.finalize(self, _stop_at_exit, shared.stop, shared.wakeup, self._io.thread, store)
        log.info("producer serving %s with %d slots on %s", self.endpoint, slots, self.device)

    def _prepare(
        self, begun: successor.Begun | None, pool: LoaderPool
    ) -> tuple[restart.Tracker | None, restart.Resumed | None]:
        """A resuming producer's loader brought to its restart point, bound meanwhile (see
        :mod:`.successor`); on an error the HELLOs held are answered with it."""
        if begun is None:
            return None, None
        shared = self._shared
        preparing = begun.preparing

        def progress(pulled: int) -> None:
            shared.preparing = f"{preparing}: {pulled} pulled"

        try:
            tracker, resumed = successor.finish(self.loader, begun, pool, progress)
        except BaseException as exc:
            if isinstance(exc, Exception):  # (interrupted: they wait on, for another successor)
                with shared.changed:
                    successor.refuse_held(shared, f"the producer could not resume its stream: {exc}")
            raise
        return tracker, resumed

    # ------------------------------------------------------------------ public API

    @property
    def epoch(self) -> int:
        """The epoch being published, or the next one (a resumed producer goes on counting
        the stream's epochs from where its predecessor was)."""
        with self._shared.changed:
            return self._shared.flow.epoch

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("the loader has no len()")
        return self.batches_per_epoch

    def __iter__(self) -> _EpochPublisher:
        """Start an epoch (calling the loader's ``set_epoch`` hooks): yields the loader's
        batches after publishing each one."""
        self._check_open()
        self._publisher.start_epoch()
        return _EpochPublisher(self._publisher)

    def serve(self, epochs: int | None = 1) -> None:
        """Publish the stream's epochs up to ``epochs`` (None: forever; a resumed producer
        publishes what its predecessor had not), end the stream, wait for every consumer to
        be sent everything or to leave, then close.

        Ctrl-C (KeyboardInterrupt) ends the current epoch where it is and the stream cleanly;
        any other exception ends the stream with its reason, which consumers raise as
        ProducerLost."""
        if epochs is not None and (type(epochs) is not int or epochs < 0):
            raise ValueError(f"epochs must be a non-negative int or None, got {epochs!r}")
        publisher = self._publisher
        try:
            done = self.epoch  # a resumed stream goes on counting its epochs
            while epochs is None or done < epochs:
                for _ in self:
                    pass
                done += 1
            publisher.end_stream(None)
            publisher.wait(publisher.all_left, None, "consumers to finish")
        except (Closed, IoThreadDied) as exc:
            if publisher.closing:
                return  # close() was called from another thread
            self.close(reason=str(exc))  # the I/O thread died: still end and free the arenas
            raise
        except KeyboardInterrupt:
            self.close()  # a deliberate stop: the epoch ends where it is, then a clean end
            raise
        except BaseException as exc:
            self.close(reason=f"producer stopped: {type(exc).__name__}: {exc}")
            raise
        self.close()

    def close(self, reason: str | None = None) -> None:
        """End the stream (consumers get a clean end, or ``reason``), wait up to ``linger``
        seconds for them to be sent it, then stop and free the arenas. Idempotent, and safe to
        call from several threads (serve() ends with it while the caller may close too): one
        closes, the others wait for it."""
        with self._close_lock:
            if not self._closed:
                self._close(reason)

    def _close(self, reason: str | None) -> None:
        shared, publisher = self._shared, self._publisher
        publisher.closing = True
        try:
            if not shared.stop.is_set():  # (set: a close() cut short as it freed; only that is left)
                if not shared.flow.ended:
                    if reason is None:
                        publisher.end_epoch()  # a no-op unless an epoch is open
                    publisher.end_stream(reason)
                publisher.wait(publisher.all_left, time.monotonic() + self.linger, "consumers to finish")
        except TimeoutError:
            log.warning(
                "closing %s with %d consumer(s) not finished after linger=%g s; they get ProducerLost",
                self.endpoint,
                len(shared.peers),
                self.linger,
            )
        except TensorSocketError:
            pass  # the I/O thread is already gone
        finally:
            self._stop_and_free()
            self._closed = True  # (after: a close() cut short by Ctrl-C is done again by the next)
            log.info("producer on %s closed", self.endpoint)

    def _stop_and_free(self) -> None:
        """Stop the I/O thread, free the places and give up the name: at close(), or when
        the constructor fails once the name is bound. Done again whole if cut short."""
        shared = self._shared
        stop_loop(shared.stop, shared.wakeup, self._io.thread, timeout=5.0, gate=self._io.gate)
        with shared.changed:
            shared.store.close()
        shared.wakeup.close()
        shared.publisher_wakeup.close()
        self._release_lock()

    def join(self) -> None:
        """Alias of :meth:`close` for code written against the upstream TensorProducer."""
        self.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        clean = exc is None or isinstance(exc, KeyboardInterrupt)  # as in serve()
        self.close(reason=None if clean else f"producer stopped: {exc_type.__name__}: {exc}")

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"Producer on {self.endpoint} was not closed", ResourceWarning, stacklevel=1)

    def status(self) -> ProducerStatus:
        """A snapshot of consumers, places and timings (also answered to STATUS messages)."""
        with self._shared.changed:
            return self._shared.status()

    def _check_open(self) -> None:
        if self._closed:  # Closed: serve() and producer loops end quietly when close() was asked
            raise Closed(f"producer on {self.endpoint} is closed")

    def _release_lock(self) -> None:
        """Give up the name: its socket and lock files go (after the I/O thread stopped)."""
        held, self._lock_file = self._lock_file, None
        endpoints.unlock(self.endpoint, held)


def _check_arguments(
    loader: Any,
    slots: Any,
    min_consumers: Any,
    replay: Any,
    grace: Any,
    stragglers: Any,
    max_lag: Any,
    linger: Any,
) -> int | None:
    """Raise TypeError / ValueError naming a bad argument; return max_lag with its default."""
    if isinstance(loader, Iterator):
        raise TypeError(
            f"loader is a one-shot iterator ({type(loader).__name__}); pass something that "
            "can be read once per epoch: a DataLoader, a list, or the generator function "
            "itself (it is called once per epoch)"
        )
    if not isinstance(loader, Iterable) and not callable(loader):
        raise TypeError(
            f"loader must be an iterable of batches or a function returning one, got {type(loader).__name__}"
        )
    sharding.check_factory(loader)
    if type(slots) is not int or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    if type(min_consumers) is not int or min_consumers < 1:
        raise ValueError(f"min_consumers must be an int >= 1, got {min_consumers!r}")
    if replay is not None and (type(replay) is not int or replay < 0):
        raise ValueError(f"replay must be a number of bytes >= 0 (or None for the default), got {replay!r}")
    if grace is not None and not is_seconds(grace):
        raise ValueError(f"grace must be a finite number of seconds >= 0 or None, got {grace!r}")
    if stragglers not in STRAGGLERS:
        raise ValueError(f"stragglers must be one of {STRAGGLERS}, got {stragglers!r}")
    if stragglers == "stall" and max_lag is not None:
        raise ValueError("max_lag applies to stragglers='skip' only")
    if stragglers == "skip" and slots < 2:
        raise ValueError(
            f"stragglers='skip' needs slots >= 2 (got {slots}): a straggler may lag up to slots - 1 batches"
        )
    if stragglers == "skip" and max_lag is None:
        max_lag = default_max_lag(slots)
    if not is_seconds(linger):
        raise ValueError(f"linger must be a finite number of seconds >= 0, got {linger!r}")
    return max_lag


def _samples_per_epoch(loader: Any) -> int | None:
    """Samples one epoch of ``loader`` yields, when it can tell without being iterated: a
    DataLoader (its sampler's length, less what drop_last drops) or a list of batches. A
    consumer with its own batch_size needs this for len()."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None:
        try:
            n = len(batch_sampler.sampler)
        except (TypeError, AttributeError):
            return None
        size = getattr(batch_sampler, "batch_size", None)
        if getattr(batch_sampler, "drop_last", False) and isinstance(size, int) and size > 0:
            return n // size * size
        return n
    if isinstance(loader, (list, tuple)):
        lengths = [batch_length(b) for b in loader]
        return None if any(n is None for n in lengths) else sum(lengths)  # type: ignore[misc]
    return None


def _stop_at_exit(stop: Any, wakeup: Wakeup, thread: Any, store: Store) -> None:
    stop_loop(stop, wakeup, thread)
    store.close()


class _EpochPublisher:
    """One epoch of ``for batch in producer``; a class so no generator frame pins a batch."""

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    def __iter__(self) -> _EpochPublisher:
        return self

    def __next__(self) -> Any:
        try:
            return self._publisher.next_batch()
        except Closed:
            if self._publisher.closing:  # close() from another thread ends the loop
                raise StopIteration from None
            raise
