"""The consumer: a drop-in replacement for a DataLoader that yields the producer's batches as
zero-copy views of shared memory.

The constructor joins the producer (HELLO / WELCOME, within ``timeout``). A background I/O
thread then owns the DEALER socket: it receives BATCH messages, bounds-checks each layout,
builds the views and queues the batch, so ``next()`` only takes a ready batch. It also sends
heartbeats and releases, and watches the producer (its pid when local, its silence
otherwise) so a lost producer raises :class:`ProducerLost` instead of blocking.

Lifetime: each batch's views hang off one NumPy array with a finalizer. When the last view
(or anything derived from one) dies, the finalizer queues a release and pokes the I/O
thread, which re-checks the batch's sampled fingerprint (catching in-place writes to a
shared batch) and sends RELEASE. Only then may the producer reuse the slot.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import queue
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from . import endpoint as endpoints
from . import layout, protocol
from .errors import BatchModified, Evicted, ProducerLost, ProtocolError, TensorSocketError
from .flow import LateJoin
from .host import boot_id, pid_alive, pid_namespace, same_host
from .protocol import Kind
from .rebatch import Rebatcher, batch_length, batches_per_epoch
from .transport import Reader, open_reader, parse_device
from .wakeup import Wakeup, stop_loop

log = logging.getLogger("tensorsocket")

_TICK = 0.05
_UNLIMITED_PREFETCH = 1 << 16
_STATS_EVERY = 1.0  # seconds between STATS reports to the producer
# Queue items: (kind, payload). Kinds:
_BATCH, _SKIPPED, _EPOCH_END, _END, _ERROR = "batch", "skipped", "epoch_end", "end", "error"


class Consumer:
    """Iterate the batches a :class:`~tensorsocket.Producer` shares.

    ``for batch in consumer`` runs one epoch and stops exactly at the producer's epoch end;
    iterate again for the next epoch. Batches are views of shared memory that stay valid as
    long as you hold any tensor of them; they are read-only by contract (use ``copy=True``
    for private copies). ``device`` moves tensors there (a copy unless it is "cpu").
    ``batch_size`` / ``drop_last`` re-cut the producer's batches into batches of this size,
    as a DataLoader with them would (views where a batch lies inside one producer batch).
    ``late_join`` says where a consumer joining mid-epoch starts: ``"replay"`` (the current
    epoch from its first batch if the producer still has it, else the next epoch),
    ``"next_epoch"``, or ``"now"`` (the oldest batch the producer still has; that first
    epoch is partial). ``prefetch`` bounds the batches this consumer holds or has queued
    (default and maximum: the producer's slots). ``timeout`` is how long the producer may
    stay silent before :class:`ProducerLost` is raised, and how long this consumer may stay
    silent before the producer evicts it. ``stream`` (GPU batches only): the CUDA stream your
    work on the batches is queued on, when it is not the current stream at ``next()``; a
    batch's memory is released to the producer only after the work queued there before its
    last view died has run.
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
    ) -> None:
        if not isinstance(timeout, (int, float)) or not 0.05 <= timeout <= 86400:
            raise ValueError(f"timeout must be a number of seconds in [0.05, 86400], got {timeout!r}")
        if prefetch is not None and (type(prefetch) is not int or prefetch < 1):
            raise ValueError(f"prefetch must be a positive int or None, got {prefetch!r}")
        if not isinstance(copy, bool):
            raise ValueError(f"copy must be True or False, got {copy!r}")
        try:
            self.late_join = LateJoin(late_join)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in LateJoin)
            raise ValueError(f"late_join must be one of {choices}, got {late_join!r}") from None
        self.batch_size = batch_size
        self.drop_last = drop_last
        # Validates batch_size and drop_last; None: batches as the producer cut them.
        self._rebatcher = Rebatcher(batch_size, drop_last) if batch_size is not None else None
        if batch_size is None and drop_last is not False:
            raise ValueError(
                "drop_last needs a batch_size: without one the producer's batches arrive as they are"
            )
        self.device = parse_device(device)
        self.endpoint = endpoints.resolve(name, endpoint)
        self.stream = stream
        self.copy = copy
        self.timeout = float(timeout)
        self.label = label if label is not None else f"pid {os.getpid()}"
        if not isinstance(self.label, str) or len(self.label) > 128:
            raise ValueError("label must be a string of at most 128 characters")
        self._prefetch = prefetch or _UNLIMITED_PREFETCH

        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._released: collections.deque[tuple[int, Any, int, int | None, int, int]] = collections.deque()
        # seqs handed out by next() and not yet dropped (set.add / discard / len are atomic
        # under the GIL, so finalizers in any thread may change it without a lock)
        self._live: set[int] = set()
        self._wakeup = Wakeup()
        self._stop = threading.Event()
        self._closed = False
        self._ended = False
        self._mid_epoch = False
        self._violation: str | None = None
        self._error: Exception | None = None
        self._stream_over = False  # END or an error arrived: the producer may now go away
        self._io_tick = time.monotonic()  # when the I/O thread's poll last returned
        self._synced = threading.Event()  # cleared after a freeze until the producer answers
        self._synced.set()
        self._reader: Reader | None = None  # made once WELCOME says which transport
        self._ready: collections.deque[Any] = collections.deque()  # re-cut batches not yet yielded
        self._stop_pending = False  # the epoch ended after the batches in _ready
        self.skipped = 0  # batches the producer moved this consumer past (stragglers="skip")
        self._skipped_epoch = 0
        self._first_batch = True
        # what the I/O thread reports to the producer: batches and samples handed to the
        # user, seconds spent waiting for data in next() (plain ints/floats: GIL-atomic)
        self._taken_batches = 0
        self._taken_samples = 0
        self._waiting = 0.0
        self._wait_started: float | None = None  # inside next() since then: a wait in progress counts

        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_BYTES)
        try:
            self._socket.connect(endpoints.connect_address(self.endpoint))
            welcome = self._handshake()
        except BaseException:
            try:  # a WELCOME still on its way means the producer registered us: leave
                self._socket.send(protocol.encode(Kind.BYE), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._socket.close(linger=100)
            self._wakeup.close()
            self._closed = True  # nothing for the caller to close: no "not closed" warning
            raise
        self.batches_per_epoch: int | None = welcome["batches"]
        self.samples_per_epoch: int | None = welcome["samples"]
        self.slots: int = welcome["slots"]
        self._producer_pid = welcome["pid"]
        self._producer_local = same_host(welcome["boot_id"], welcome["pidns"])
        self._heartbeat = min(welcome["heartbeat"], self.timeout / 4)
        self._reader = open_reader(welcome["transport"], welcome["gpu"], self.device, self.stream)
        for arena in welcome["arenas"]:
            self._reader.announce(arena)
        self._io = threading.Thread(
            target=_io_thread,
            args=(weakref.ref(self), self._socket, self._stop, self.endpoint),
            name="tensorsocket-consumer-io",
            daemon=True,
        )
        self._io.start()
        # At interpreter exit (or when dropped), stop the thread before zmq is torn down
        # under it: a daemon thread still using its socket then aborts the process.
        weakref.finalize(self, stop_loop, self._stop, self._wakeup, self._io)

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        """Batches per epoch: the producer loader's len(), or with ``batch_size`` what this
        consumer's re-cut yields. TypeError if the producer cannot tell."""
        if self.batch_size is None:
            if self.batches_per_epoch is None:
                raise TypeError("the producer's loader has no len()")
            return self.batches_per_epoch
        if self.samples_per_epoch is None:
            raise TypeError(
                "the producer cannot tell how many samples an epoch has (its loader is not a "
                "DataLoader with a sized sampler, nor a list), so len() with batch_size is unknown"
            )
        return batches_per_epoch(self.samples_per_epoch, self.batch_size, self.drop_last)

    def __iter__(self) -> _EpochIterator:
        """The next epoch. If the previous epoch's loop was left early, its remaining batches
        are skipped (as a new DataLoader iterator starts a new epoch)."""
        self._check_open()
        if self._mid_epoch:
            self._skip_rest_of_epoch()
        self._ready.clear()
        self._stop_pending = False
        if self._rebatcher is not None:
            self._rebatcher.flush()  # drop a remainder left behind by a loop that broke early
        return _EpochIterator(self)

    @property
    def delivery(self) -> str:
        """ "views" (batches are views of the producer's memory: zero copy) or "copy" (copied
        to this consumer's device: a GPU other than the producer's, or the host)."""
        assert self._reader is not None
        return self._reader.delivery

    @property
    def finished(self) -> bool:
        """True once the producer ended the stream and this consumer saw the end."""
        return self._ended

    def close(self) -> None:
        """Leave the producer at once (it stops waiting for us and takes back every slot this
        consumer held: batches you still hold may be overwritten mid-stream, so clone what
        you keep past close(); after the end of stream they stay valid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wakeup.wake()
        self._io.join(timeout=5.0)
        # Drop queued batches; their finalizers fire and are ignored now.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"Consumer of {self.endpoint} was not closed", ResourceWarning, stacklevel=1)

    # ------------------------------------------------------------------ iteration

    def _next_for_user(self) -> Any:
        """The next batch in this consumer's batch size; StopIteration at the epoch's end."""
        t0 = self._wait_started = time.monotonic()
        try:
            batch = self._next() if self._rebatcher is None else self._next_rebatched()
        finally:
            self._waiting += time.monotonic() - t0
            self._wait_started = None
        self._taken_batches += 1
        self._taken_samples += batch_length(batch) or 0
        return batch

    def _next_rebatched(self) -> Any:
        assert self._rebatcher is not None
        while not self._ready:
            if self._stop_pending:
                self._stop_pending = False
                raise StopIteration
            try:
                self._ready.extend(self._rebatcher.push(self._next()))
            except StopIteration:
                tail = self._rebatcher.flush()
                if tail is None:
                    raise
                self._ready.append(tail)
                self._stop_pending = True
        return self._ready.popleft()

    def _next(self) -> Any:
        """The next producer batch of the current epoch, or StopIteration at its end."""
        if self._ended:
            raise StopIteration
        if self._error is not None:
            raise self._error
        self._check_violation()
        kind, payload = self._take()
        while kind == _SKIPPED:
            self._note_skipped(payload)
            kind, payload = self._take()
        if kind == _BATCH:
            self._catch_up_after_freeze()
            if self._error is not None:  # evicted while this batch waited in the queue
                raise self._error
            self._mid_epoch = True
            batch, epoch, index, seq, token, release = payload
            # Counted as held from here (not when built): the hoarding check must not count a
            # batch the I/O thread is still building or queueing. A batch delivered as a copy
            # dropped its views in the I/O thread already: it holds nothing.
            if release.alive:
                self._live.add(seq)
                self._reader.handed_out(token)
            if self._first_batch:
                self._first_batch = False
                if index:
                    log.warning(
                        "consumer %r joined epoch %d at its batch %d (late_join=%r): this first epoch is partial",
                        self.label,
                        epoch,
                        index,
                        self.late_join.value,
                    )
            return batch
        self._mid_epoch = False
        if kind == _EPOCH_END:
            if self._skipped_epoch:
                log.warning(
                    "consumer %r skipped %d batches of epoch %d: it fell more than max_lag batches behind the fastest",
                    self.label,
                    self._skipped_epoch,
                    payload,
                )
                self._skipped_epoch = 0
            raise StopIteration
        if kind == _END:
            self._ended = True
            if payload:
                raise ProducerLost(f"the producer at {self.endpoint} ended the stream: {payload}")
            raise StopIteration
        self._error = payload
        raise payload

    def _take(self) -> tuple[str, Any]:
        """Block for the next queue item, with the checks that make a wait finite."""
        while True:
            try:
                return self._queue.get(timeout=_TICK)
            except queue.Empty:
                pass
            if not self._io.is_alive():
                try:  # what it queued just before it stopped (the reason) comes first
                    return self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._check_open()
                raise ProducerLost(f"the consumer's I/O thread for {self.endpoint} stopped")
            self._check_hoarding()

    def _note_skipped(self, count: int) -> None:
        if not self.skipped:
            log.warning(
                "consumer %r fell more than max_lag batches behind the fastest consumer (stragglers='skip'): "
                "it skips batches from now on; Consumer.skipped counts them",
                self.label,
            )
        self.skipped += count
        self._skipped_epoch += count

    def _catch_up_after_freeze(self) -> None:
        """After this process was frozen (SIGSTOP, a debugger) for longer than the producer
        waits, it was evicted and its queued batches' slots may hold other data by now, but
        the EVICTED message may not be read yet. The I/O thread notices the freeze at its next
        turn (a gap over ``timeout / 2``; eviction needs more than ``timeout``) and asks the
        producer something; its answer comes after EVICTED. So: if the I/O thread has not
        turned since the freeze, wait for it to; then wait for the answer."""
        seen = self._io_tick
        if time.monotonic() - seen > self.timeout / 2:
            deadline = time.monotonic() + 1.0
            while self._io_tick == seen and self._io.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
        if self._synced.is_set():
            return
        deadline = time.monotonic() + self.timeout
        while not self._synced.wait(0.01):
            if not self._io.is_alive():
                return  # it stopped: _next raises the error it left
            if time.monotonic() > deadline:
                raise ProducerLost(
                    f"the producer at {self.endpoint} did not answer after this process was frozen"
                )

    def _skip_rest_of_epoch(self) -> None:
        while self._mid_epoch:
            try:
                self._next()
            except StopIteration:
                break

    def _check_hoarding(self) -> None:
        limit = min(self._prefetch, self.slots)
        if len(self._live) < limit:
            return
        gc.collect()  # batches kept alive only by reference cycles
        live = len(self._live)
        if live >= limit:
            raise TensorSocketError(
                f"this consumer holds {live} batches, all it may hold (prefetch={self._prefetch}, "
                f"producer slots={self.slots}), and waits for another: that can never arrive. "
                "Drop references to old batches, use Consumer(copy=True), or give the producer "
                "more slots"
            )

    def _check_violation(self) -> None:
        if self._violation is not None:
            message, self._violation = self._violation, None
            raise BatchModified(message)

    def _check_open(self) -> None:
        if self._closed:
            raise TensorSocketError(f"consumer of {self.endpoint} is closed")

    # ------------------------------------------------------------------ handshake

    def _handshake(self) -> dict[str, Any]:
        self._socket.send(
            protocol.encode(
                Kind.HELLO,
                version=protocol.VERSION,
                pid=os.getpid(),
                boot_id=boot_id(),
                pidns=pid_namespace(),
                label=self.label,
                prefetch=self._prefetch,
                timeout=self.timeout,
                late_join=self.late_join.value,
                batch_size=self.batch_size,
                device=str(self.device),
            )
        )
        if not self._socket.poll(int(self.timeout * 1000)):
            raise ProducerLost(
                f"no producer answered at {self.endpoint} within {self.timeout:g} s; start one "
                "with Producer(loader, name=...) or check the name / endpoint"
            )
        kind, msg = protocol.decode(self._socket.recv(), protocol.MAX_REPLY_BYTES)
        if kind is Kind.WELCOME:
            return msg
        if kind in (Kind.ERROR, Kind.EVICTED):
            raise TensorSocketError(f"the producer at {self.endpoint} refused to serve us: {msg['reason']}")
        raise ProtocolError(f"expected WELCOME from {self.endpoint}, got {kind.value}")

    # ------------------------------------------------------------------ I/O thread

    def _io_begin(self) -> _IoState:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        now = time.monotonic()
        return _IoState(poller, now, now, now)

    def _io_once(self, state: _IoState) -> bool:
        """One turn of the I/O loop; False when this consumer's stream is over."""
        events = dict(state.poller.poll(int(_TICK * 1000)))
        now = time.monotonic()
        if now - state.last_awake > self.timeout / 2:
            # We were frozen (SIGSTOP, a debugger), maybe inside poll: the producer's silence
            # was ours, so give it a fresh window; and ask it something. Its answer comes after
            # anything it sent while we were frozen (EVICTED, say): once here, that was read.
            state.last_seen = max(state.last_seen, now)
            self._synced.clear()
            self._send(protocol.encode(Kind.STATUS, status=None))
        state.last_awake = now
        self._io_tick = now  # see _catch_up_after_freeze
        if self._socket in events:
            state.last_seen = now
            if not self._receive():
                return False
        if self._wakeup.fd in events:
            self._wakeup.drain()
        if self._send_releases():
            state.last_sent = now
        if self._stream_over:
            return True
        if now - state.last_stats >= _STATS_EVERY:
            started = self._wait_started
            waiting = self._waiting + (max(0.0, now - started) if started is not None else 0.0)
            stats = (self._taken_batches, self._taken_samples, round(waiting, 6))
            if stats != state.stats:
                batches, samples, waiting = state.stats = stats
                self._send(
                    protocol.encode(Kind.STATS, taken_batches=batches, taken_samples=samples, waiting=waiting)
                )
                state.last_sent = now
            state.last_stats = now
        if now - state.last_sent >= self._heartbeat:
            self._send(protocol.encode(Kind.HEARTBEAT))
            state.last_sent = now
        if self._producer_local and not pid_alive(self._producer_pid):
            self._fail(ProducerLost(f"the producer at {self.endpoint} (pid {self._producer_pid}) died"))
            return False
        if now - state.last_seen > self.timeout:
            self._fail(
                ProducerLost(f"no message from the producer at {self.endpoint} for {self.timeout:g} s")
            )
            return False
        return True

    def _fail(self, exc: Exception) -> None:
        self._stream_over = True
        self._queue.put((_ERROR, exc))

    def _send(self, frame: bytes) -> None:
        _send_quietly(self._socket, frame)

    def _receive(self) -> bool:
        """Handle every waiting message; False when the stream is over for this consumer."""
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
                if kind is Kind.BATCH:
                    batch, token, release = self._build(msg)
                    self._queue.put((_BATCH, (batch, msg["epoch"], msg["index"], msg["seq"], token, release)))
                elif kind is Kind.SKIPPED:
                    self._queue.put((_SKIPPED, msg["count"]))
                elif kind is Kind.ARENA:
                    self._reader.announce(msg["arena"])
                elif kind is Kind.EPOCH_END:
                    self._queue.put((_EPOCH_END, msg["epoch"]))
                elif kind is Kind.END:
                    # Every earlier BATCH is built (so its arena mapped): tell the producer
                    # it may now unlink its segments.
                    self._stream_over = True
                    self._queue.put((_END, msg["reason"]))
                    self._send(protocol.encode(Kind.BYE))
                elif kind is Kind.EVICTED and self._stream_over:
                    # We said BYE at END, so a later RELEASE or MODIFIED draws this; after END
                    # no slot is reused, so the queued batches stay valid.
                    continue
                elif kind is Kind.EVICTED:
                    evicted = Evicted(
                        f"the producer at {self.endpoint} evicted this consumer: {msg['reason']}"
                    )
                    # Mid-stream (after END the branch above applies): our queued batches' slots
                    # get reused, so never yield them.
                    self._error = evicted
                    self._fail(evicted)
                    return False
                elif kind is Kind.ERROR:
                    log.error("the producer at %s reports: %s", self.endpoint, msg["reason"])
                elif kind is Kind.STATUS:
                    self._synced.set()
                elif kind is not Kind.HEARTBEAT:
                    raise ProtocolError(f"unexpected {kind.value} message from the producer")
            except (ProtocolError, KeyError, ValueError) as exc:
                self._fail(ProtocolError(f"bad message from the producer at {self.endpoint}: {exc}"))
                return False

    def _build(self, msg: dict[str, Any]) -> tuple[Any, Any, weakref.finalize]:
        """The user's batch from a BATCH message, the lease's token and its release finalizer."""
        reader, place, seq = self._reader, msg["place"], msg["seq"]
        tree, leaves = layout.check(msg["layout"], reader.size(place))
        nbytes = msg["layout"][2]
        lease = reader.lease(place, nbytes)
        item = (seq, lease.token, nbytes, msg["fingerprint"], msg["epoch"], msg["index"])
        release = weakref.finalize(
            lease.owner, _release_later, self._live, self._released, self._wakeup, reader, item
        )
        release.atexit = False
        batch = reader.deliver(layout.build(tree, leaves, lease.region), copy=self.copy)
        return batch, lease.token, release

    def _send_releases(self) -> bool:
        seqs = []
        while self._released:
            seq, token, nbytes, fingerprint, epoch, index = self._released.popleft()
            if fingerprint is not None and self._reader.fingerprint(token, nbytes) != fingerprint:
                self._report_modified(seq, epoch, index)
            seqs.append(seq)
        if not seqs:
            return False
        step = protocol.MAX_RELEASE_SEQS
        for start in range(0, len(seqs), step):
            self._send(protocol.encode(Kind.RELEASE, seqs=seqs[start : start + step]))
        return True

    def _report_modified(self, seq: int, epoch: int, index: int) -> None:
        self._violation = (
            f"batch {index} of epoch {epoch} changed in shared memory while consumer "
            f"{self.label!r} held it. Shared batches are read-only: every trainer reads the same "
            "memory, so an in-place op (x.sub_(mean), x /= 255, x[...] = ...) corrupts the others' "
            "data. Use an out-of-place op (x = x - mean) or Consumer(copy=True). If this process "
            "wrote nothing, another consumer holding the batch did: see the producer's log."
        )
        log.error("%s", self._violation)
        self._send(protocol.encode(Kind.MODIFIED, seq=seq, epoch=epoch, index=index))


@dataclass
class _IoState:
    poller: zmq.Poller
    last_seen: float  # last message from the producer
    last_sent: float  # last message to it
    last_awake: float  # when poll last returned: a long gap means this process was frozen
    last_stats: float = 0.0
    stats: tuple[int, int, float] = (0, 0, 0.0)  # last reported


def _send_quietly(sock: zmq.Socket, frame: bytes) -> None:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass  # no producer connected any more: nobody to tell


def _release_later(
    live: set[int], released: collections.deque[Any], wakeup: Wakeup, reader: Reader, item: tuple[Any, ...]
) -> None:
    """A batch's finalizer: runs in whichever thread dropped its last view. It must not touch
    the socket, and it references no Consumer, so a dropped Consumer can be collected. The
    reader calls back once the region may be released (on a GPU: after the work queued on it)."""
    live.discard(item[0])

    def ready() -> None:
        released.append(item)
        wakeup.wake()

    reader.retire(item[1], ready)


def _io_thread(ref: weakref.ref[Consumer], sock: zmq.Socket, stop: threading.Event, endpoint: str) -> None:
    """The consumer's I/O thread. It holds the Consumer only during one turn of the loop, so a
    Consumer dropped without close() is collected and its thread then leaves the producer
    (which drops its holds) instead of stalling every other consumer forever."""
    state: _IoState | None = None
    try:
        while not stop.is_set():
            consumer = ref()
            if consumer is None:
                break
            if state is None:
                state = consumer._io_begin()
            going = consumer._io_once(state)
            del consumer
            if not going:
                return
        consumer = ref()
        if consumer is not None:
            consumer._send_releases()
            del consumer
        _send_quietly(sock, protocol.encode(Kind.BYE))
    except Exception as exc:
        log.exception("consumer I/O thread for %s failed", endpoint)
        consumer = ref()
        if consumer is not None:
            consumer._fail(ProducerLost(f"consumer I/O failed: {type(exc).__name__}: {exc}"))
    finally:
        sock.close(linger=100)


class _EpochIterator:
    """One epoch of ``for batch in consumer``; a class so no generator frame pins a batch."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self._done = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._consumer._next_for_user()
        except StopIteration:
            self._done = True
            raise
