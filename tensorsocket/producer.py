"""The producer: pulls batches from a loader, writes each into a shared slot once, and
announces it to every consumer over a ZeroMQ ROUTER socket.

Two threads. The caller's thread (``serve`` or a ``for batch in producer`` loop) pulls from
the loader, waits for a free slot, writes the batch and publishes it. A background I/O
thread owns the socket: it validates and applies incoming messages, evicts dead or silent
consumers and sends heartbeats, so control traffic is served while the loader is busy.
Both threads change the :class:`~tensorsocket.flow.Flow` only under one lock, and every
outgoing frame goes through one FIFO outbox drained by the I/O thread, so messages leave in
exactly the order the flow decided them.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import endpoint as endpoints
from . import layout, protocol
from .errors import ProtocolError, TensorSocketError
from .flow import Action, Deliver, Flow, LateJoin, Skipped
from .host import boot_id, pid_alive, pid_namespace, same_host
from .protocol import Kind
from .rebatch import batch_length
from .transport import Store, open_store
from .wakeup import Wakeup, stop_loop

log = logging.getLogger("tensorsocket")


class _Closed(TensorSocketError):
    """The producer was closed (possibly from another thread) while the caller waited."""


_TICK = 0.05  # seconds between liveness checks in the I/O loop
_MAX_HEARTBEAT = 1.0
_RATE_WINDOW = 5.0  # seconds of STATS reports a consumer's rate is computed over
_MAX_REPLAY_BATCHES = 4096  # each place is a segment every consumer maps: bound their number
STRAGGLERS = ("stall", "skip")


def default_replay_bytes() -> int:
    """The replay budget when none is given: 1 GiB, or a quarter of the free shared memory
    if that is less (containers often have a small /dev/shm)."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    return min(1 << 30, free // 4)


@dataclass
class _Peer:
    """What the I/O thread knows of a joined consumer besides its flow state."""

    label: str
    pid: int
    timeout: float
    local: bool  # same host and pid namespace: its pid can be watched
    joined: float
    last_seen: float
    device: str = "cpu"
    batch_size: int | None = None
    last_sent: float = 0.0
    # (time, batches, samples, waiting) from its STATS reports, the last few seconds of them
    stats: collections.deque[tuple[float, int, int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=32)
    )

    def describe(self) -> str:
        return f"consumer {self.label!r} (pid {self.pid})"


class Producer:
    """Share every batch of ``loader`` with the consumers that connect to ``name``.

    ``loader`` is any re-iterable of batches (a DataLoader, a list) or a function returning
    an iterable (a generator function), called once per epoch. The producer runs at most
    ``slots`` batches ahead of the slowest consumer (``stragglers="stall"``, exact), or moves
    a consumer lagging more than ``max_lag`` batches ahead and tells it what it skipped
    (``"skip"``). Beyond those slots it keeps up to ``replay`` bytes of already-consumed
    batches in shared memory, so late joiners can be sent the current epoch from its start.
    Nothing is pulled from the loader until ``min_consumers`` consumers have joined (or,
    with ``grace``, that many seconds after the first one joined), nor while no consumer is
    connected. See the README for the whole contract.
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
    ) -> None:
        if isinstance(loader, Iterator):
            raise TypeError(
                f"loader is a one-shot iterator ({type(loader).__name__}); pass something that "
                "can be read once per epoch: a DataLoader, a list, or the generator function "
                "itself (it is called once per epoch)"
            )
        if not isinstance(loader, Iterable) and not callable(loader):
            raise TypeError(
                f"loader must be an iterable of batches or a function returning one, got "
                f"{type(loader).__name__}"
            )
        if type(slots) is not int or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        if type(min_consumers) is not int or min_consumers < 1:
            raise ValueError(f"min_consumers must be an int >= 1, got {min_consumers!r}")
        if replay is not None and (type(replay) is not int or replay < 0):
            raise ValueError(
                f"replay must be a number of bytes >= 0 (or None for the default), got {replay!r}"
            )
        if grace is not None and (
            not isinstance(grace, (int, float)) or isinstance(grace, bool) or grace < 0
        ):
            raise ValueError(f"grace must be a number of seconds >= 0 or None, got {grace!r}")
        if stragglers not in STRAGGLERS:
            raise ValueError(f"stragglers must be one of {STRAGGLERS}, got {stragglers!r}")
        if stragglers == "stall" and max_lag is not None:
            raise ValueError("max_lag applies to stragglers='skip' only")
        if stragglers == "skip" and type(slots) is int and slots < 2:
            raise ValueError(
                f"stragglers='skip' needs slots >= 2 (got {slots}): a straggler may lag up to slots - 1 batches"
            )
        if stragglers == "skip" and max_lag is None:
            max_lag = max(1, slots // 2) if type(slots) is int else 1
        if not isinstance(linger, (int, float)) or linger < 0:
            raise ValueError(f"linger must be a number of seconds >= 0, got {linger!r}")
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
        # Flow checks max_lag against slots. Under skip the leader's window, a straggler's
        # unsent batches (up to max_lag behind it) and the batches each of them holds must all
        # fit with room to spare, or the leader would be paced by the straggler's releases.
        flow = Flow(window=slots, places=slots * (3 if stragglers == "skip" else 1), max_lag=max_lag)

        self._lock_file = endpoints.lock(self.endpoint)
        try:
            self._store: Store = open_store(device)
        except BaseException:
            self._release_lock()
            raise
        self.device = self._store.device
        self._flow = flow
        self._replay_places = 0  # sized at the first batch, from its bytes
        self._peers: dict[Hashable, _Peer] = {}
        self._outbox: collections.deque[tuple[Hashable, bytes]] = collections.deque()
        self._changed = threading.Condition()  # guards flow, peers, pool, outbox
        self._wakeup = Wakeup()
        self._stop = threading.Event()
        self._closed = False
        self._closing = False  # close() has begun: waits in the caller's thread end quietly
        self._started = False  # the first batch was pulled
        self._first_join: float | None = None
        self._epoch_open = False
        self._index = 0
        self._loader_iter: Iterator[Any] | None = None
        # loader_wait: in next(loader); slot_wait: for the slowest consumer to free a slot;
        # publish_time: writing and announcing (slot_wait included)
        self._stats = {
            "published": 0,
            "loader_wait": 0.0,
            "slot_wait": 0.0,
            "publish_time": 0.0,
            "bad_messages": 0,
        }
        self._born = time.monotonic()

        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 500)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop: credits bound what is queued
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REQUEST_BYTES)
        try:
            if self.endpoint.startswith("tcp://") and self.endpoint.endswith(":*"):
                port = self._socket.bind_to_random_port(self.endpoint[: -len(":*")])
                self.endpoint = f"{self.endpoint[:-2]}:{port}"
            else:
                self._socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._wakeup.close()
            self._store.close()
            self._closed = True  # nothing for the caller to close: no "not closed" warning
            self._release_lock()
            raise RuntimeError(f"cannot bind {self.endpoint}: {exc}") from None
        self._io = threading.Thread(target=self._io_loop, name="tensorsocket-producer-io", daemon=True)
        self._io.start()
        # If close() is never called (a script without `with` that raises): at exit, stop the
        # I/O thread before zmq is torn down under it (that aborts the process) and unlink.
        # The I/O thread keeps `self` alive, so __del__ would not run.
        weakref.finalize(self, _stop_at_exit, self._stop, self._wakeup, self._io, self._store)
        log.info("producer serving %s with %d slots", self.endpoint, slots)

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("the loader has no len()")
        return self.batches_per_epoch

    def __iter__(self) -> _EpochPublisher:
        """Start an epoch: yields the loader's batches after publishing each one."""
        self._check_open()
        if self._epoch_open:  # the previous epoch's loop was left early: end it where it is
            self._end_epoch()
        source = self.loader if isinstance(self.loader, Iterable) else self.loader()
        self._loader_iter = iter(source)
        self._epoch_open = True
        self._index = 0
        return _EpochPublisher(self)

    def serve(self, epochs: int | None = 1) -> None:
        """Publish ``epochs`` epochs (None: forever), end the stream, wait for every consumer
        to be sent everything or to leave, then close.

        Ctrl-C (KeyboardInterrupt) ends the current epoch where it is and the stream cleanly;
        any other exception ends the stream with its reason, which consumers raise as
        ProducerLost."""
        if epochs is not None and (type(epochs) is not int or epochs < 0):
            raise ValueError(f"epochs must be a non-negative int or None, got {epochs!r}")
        try:
            done = 0
            while epochs is None or done < epochs:
                for _ in self:
                    pass
                done += 1
            self._end_stream(None)
            self._wait(self._all_left, None, "consumers to finish")
        except _Closed as exc:
            if self._closing:
                return  # close() was called from another thread
            self.close(reason=str(exc))  # the I/O thread died: still end and unlink
            raise TensorSocketError(str(exc)) from None
        except KeyboardInterrupt:
            self.close()  # a deliberate stop: the epoch ends where it is, then a clean end
            raise
        except BaseException as exc:
            self.close(reason=f"producer stopped: {type(exc).__name__}: {exc}")
            raise
        self.close()

    def close(self, reason: str | None = None) -> None:
        """End the stream (consumers get a clean end, or ``reason``), wait up to ``linger``
        seconds for them to be sent it, then stop and unlink the shared memory. Idempotent."""
        if self._closed:
            return
        self._closing = True
        try:
            if not self._flow.ended:
                if reason is None:
                    self._end_epoch()  # a no-op unless an epoch is open
                self._end_stream(reason)
            deadline = time.monotonic() + self.linger
            self._wait(self._all_left, deadline, "consumers to finish")
        except TimeoutError:
            log.warning(
                "closing %s with %d consumer(s) not finished after linger=%g s; they get ProducerLost",
                self.endpoint,
                len(self._peers),
                self.linger,
            )
        except TensorSocketError:
            pass  # the I/O thread is already gone
        finally:
            self._closed = True
            self._stop.set()
            self._wakeup.wake()
            self._io.join(timeout=5.0)
            with self._changed:
                self._store.close()
            self._wakeup.close()
            self._release_lock()
            log.info("producer on %s closed", self.endpoint)

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

    def status(self) -> dict[str, Any]:
        """A snapshot of consumers, slots and timings (also answered to STATUS messages)."""
        with self._changed:
            return self._status_locked()

    # ------------------------------------------------------------------ caller's thread

    def _next_batch(self) -> Any:
        self._check_open()
        if self._started:
            self._wait(lambda: len(self._peers) >= 1, None, "a consumer to join")
        else:
            self._wait(self._may_start, None, f"{self.min_consumers} consumer(s) to join")
        t0 = time.perf_counter()
        assert self._loader_iter is not None
        try:
            batch = next(self._loader_iter)
        except StopIteration:
            self._end_epoch()
            raise
        t1 = time.perf_counter()
        plan = layout.plan(batch)
        if not self._started:
            self._size_replay(plan.nbytes)
        self._started = True
        slot_box: list[int] = []

        def reserved() -> bool:
            if self._flow.ended:
                raise _Closed(f"producer on {self.endpoint} was closed")
            slot = self._flow.reserve()
            if slot is not None:
                slot_box.append(slot)
            return slot is not None

        t_slot = time.perf_counter()
        self._wait(reserved, None, "a free slot")
        slot_wait = time.perf_counter() - t_slot
        slot = slot_box[0]
        try:
            arena = self._store.prepare(slot, plan.nbytes)  # slow for big arenas: not under the lock
            if arena is not None:
                with self._changed:
                    frame = protocol.encode(Kind.ARENA, arena=self._store.install(arena))
                    self._outbox.extend((cid, frame) for cid in self._peers)
            # Announce after completion: the BATCH goes out only once the bytes are where
            # consumers read them (on a GPU, the copy's event fired), so no consumer ever
            # waits on the producer's GPU work.
            fingerprint = self._store.write(slot, plan).wait()
        except BaseException:
            with self._changed:
                self._flow.cancel(slot)
            if self._closing:  # close() from another thread closed the pool under us
                raise _Closed(f"producer on {self.endpoint} was closed") from None
            raise
        with self._changed:
            if self._flow.ended:  # closed while we wrote
                raise _Closed(f"producer on {self.endpoint} was closed")
            frame = protocol.encode(
                Kind.BATCH,
                seq=self._flow.next_seq,
                epoch=self._flow.epoch,
                index=self._index,
                place=slot,
                layout=plan.encode(),
                fingerprint=fingerprint,
            )
            if len(frame) > protocol.MAX_REPLY_BYTES:
                self._flow.cancel(slot)
                raise TypeError(
                    f"batch {self._index} of epoch {self._flow.epoch} describes itself in {len(frame)} bytes "
                    f"(limit {protocol.MAX_REPLY_BYTES}): its str / bytes / scalar leaves travel in the "
                    "message; put large data in tensors or NumPy arrays"
                )
            self._send_all(self._flow.publish(slot, frame))
            self._index += 1
            self._stats["published"] += 1
            self._stats["loader_wait"] += t1 - t0
            self._stats["publish_time"] += time.perf_counter() - t1
            self._stats["slot_wait"] += slot_wait
        self._wakeup.wake()
        return batch

    def _may_start(self) -> bool:
        """Before the first batch: enough consumers, or the grace period is over (lock held)."""
        if len(self._peers) >= self.min_consumers:
            return True
        return (
            self.grace is not None
            and bool(self._peers)
            and self._first_join is not None
            and time.monotonic() - self._first_join >= self.grace
        )

    def _size_replay(self, nbytes: int) -> None:
        """Turn the replay budget into places, now that a batch's size is known."""
        places = min(self.replay // max(nbytes, 1), _MAX_REPLAY_BATCHES)
        if self.batches_per_epoch is not None:
            places = min(places, self.batches_per_epoch)  # one whole epoch is all a joiner needs
        with self._changed:
            self._flow.add_places(places)
            self._replay_places = places
        log.info("replay buffer: %d batches of %d bytes (budget %d bytes)", places, nbytes, self.replay)

    def _end_epoch(self) -> None:
        with self._changed:
            if not self._epoch_open:  # already ended (close() raced the caller's thread)
                return
            self._epoch_open = False
            if self._flow.ended:
                raise _Closed(f"producer on {self.endpoint} was closed")
            frame = protocol.encode(Kind.EPOCH_END, seq=self._flow.next_seq, epoch=self._flow.epoch)
            self._send_all(self._flow.end_epoch(frame))
        self._wakeup.wake()

    def _end_stream(self, reason: str | None) -> None:
        with self._changed:
            if self._flow.ended:
                return
            frame = protocol.encode(Kind.END, seq=self._flow.next_seq, reason=reason)
            self._send_all(self._flow.end_stream(frame))
        self._wakeup.wake()

    def _wait(self, predicate: Any, deadline: float | None, what: str) -> None:
        """Wait under the lock until ``predicate()``; re-check every tick so close() and a
        dead I/O thread are noticed. Raises TimeoutError at ``deadline``."""
        with self._changed:
            while not predicate():
                if self._stop.is_set() or not self._io.is_alive():
                    raise _Closed(f"producer on {self.endpoint} stopped while waiting for {what}")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"gave up waiting for {what}")
                self._changed.wait(_TICK)

    def _all_left(self) -> bool:
        """After END: every consumer said BYE (it has mapped every arena it was sent, so the
        segments may be unlinked), left, or died."""
        return self._flow.ended and not self._peers

    def _check_open(self) -> None:
        if self._closed:  # _Closed: serve() and producer loops end quietly when close() was asked
            raise _Closed(f"producer on {self.endpoint} is closed")

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------ I/O thread

    def _send_all(self, actions: list[Action]) -> None:
        """Queue what the flow decided (caller holds the lock)."""
        for action in actions:
            if isinstance(action, Deliver):
                self._outbox.append((action.consumer, action.entry.payload))
            else:
                assert isinstance(action, Skipped)
                self._outbox.append((action.consumer, protocol.encode(Kind.SKIPPED, count=action.count)))

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(_TICK * 1000)))
                if self._wakeup.fd in events:
                    self._wakeup.drain()
                if self._socket in events:
                    self._receive()
                now = time.monotonic()
                if now >= next_tick:
                    self._check_peers(now)
                    next_tick = now + _TICK
                self._flush(now)
            self._flush(time.monotonic())
        except Exception:
            log.exception("producer I/O thread on %s failed", self.endpoint)
        finally:
            self._socket.close()
            with self._changed:
                self._changed.notify_all()

    def _flush(self, now: float) -> None:
        with self._changed:
            frames = list(self._outbox)
            self._outbox.clear()
            for cid, _ in frames:
                peer = self._peers.get(cid)
                if peer is not None:
                    peer.last_sent = now
        for cid, frame in frames:
            try:
                self._socket.send_multipart([cid, frame], zmq.NOBLOCK)  # type: ignore[list-item]
            except zmq.Again:
                log.warning("dropped a message to %r: its queue is full", cid)

    def _receive(self) -> None:
        for _ in range(1000):  # bounded, so ticks still run under a flood
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad(frames[0], f"expected 1 frame after the routing id, got {len(frames) - 1}")
                continue
            cid, frame = frames
            try:
                kind, msg = protocol.decode(frame)
                with self._changed:
                    self._handle(cid, kind, msg)
                    self._changed.notify_all()
            except ProtocolError as exc:
                self._bad(cid, str(exc))

    def _bad(self, cid: bytes, reason: str) -> None:
        self._stats["bad_messages"] += 1
        if self._stats["bad_messages"] <= 20 or self._stats["bad_messages"] % 1000 == 0:
            log.warning("bad message from %r: %s (%d so far)", cid, reason, self._stats["bad_messages"])
        with self._changed:
            self._outbox.append((cid, protocol.encode(Kind.ERROR, reason=reason[:4000])))

    def _handle(self, cid: bytes, kind: Kind, msg: dict[str, Any]) -> None:
        """Apply one valid message (lock held)."""
        now = time.monotonic()
        peer = self._peers.get(cid)
        if peer is not None:
            peer.last_seen = now
        if kind is Kind.HELLO:
            self._hello(cid, msg, now)
        elif kind is Kind.STATUS:
            self._outbox.append((cid, protocol.encode(Kind.STATUS, status=self._status_locked())))
        elif peer is None:
            if kind is not Kind.BYE:
                reason = "unknown consumer: it was evicted or never joined"
                self._outbox.append((cid, protocol.encode(Kind.EVICTED, reason=reason)))
        elif kind is Kind.RELEASE:
            self._send_all(self._flow.release(cid, msg["seqs"]))
        elif kind is Kind.BYE:
            self._drop(cid, "left")
        elif kind is Kind.STATS:
            peer.stats.append((now, msg["taken_batches"], msg["taken_samples"], float(msg["waiting"])))
        elif kind is Kind.MODIFIED:
            log.error(
                "%s reports batch %d (epoch %d, index %d) changed in shared memory while it held it: "
                "an in-place op on a shared batch corrupts every consumer's data; use copy=True "
                "or out-of-place ops",
                peer.describe(),
                msg["seq"],
                msg["epoch"],
                msg["index"],
            )
        elif kind is not Kind.HEARTBEAT:
            raise ProtocolError(f"a consumer may not send {kind.value} messages")

    def _hello(self, cid: bytes, msg: dict[str, Any], now: float) -> None:
        if cid in self._peers:
            raise ProtocolError("HELLO from a consumer that already joined")
        local = same_host(msg["boot_id"], msg["pidns"])
        self._store.admit(msg, local)
        peer = _Peer(
            msg["label"], msg["pid"], float(msg["timeout"]), local, now, now, msg["device"], msg["batch_size"]
        )
        self._peers[cid] = peer
        if self._first_join is None:
            self._first_join = now
        welcome = protocol.encode(
            Kind.WELCOME,
            pid=os.getpid(),
            boot_id=boot_id(),
            pidns=pid_namespace(),
            batches=self.batches_per_epoch,
            samples=self.samples_per_epoch,
            slots=self.slots,
            transport=self._store.kind,
            gpu=self._store.gpu,
            arenas=self._store.describe(),
            heartbeat=self._heartbeat_interval(peer),
        )
        self._outbox.append((cid, welcome))
        self._send_all(self._flow.join(cid, msg["prefetch"], LateJoin(msg["late_join"])))
        state = self._flow.consumers[cid]
        where = (
            "waits for the next epoch"
            if state.cursor is None
            else f"starts {self._flow.lag(cid)} batches behind"
        )
        log.info("%s joined (%d connected); it %s", peer.describe(), len(self._peers), where)

    def _drop(self, cid: Hashable, why: str) -> None:
        peer = self._peers.pop(cid, None)
        self._flow.leave(cid)
        if peer is not None:
            log.info("%s %s (%d connected)", peer.describe(), why, len(self._peers))

    @staticmethod
    def _heartbeat_interval(peer: _Peer) -> float:
        return min(_MAX_HEARTBEAT, peer.timeout / 4)

    def _check_peers(self, now: float) -> None:
        with self._changed:
            for cid, peer in list(self._peers.items()):
                if peer.local and not pid_alive(peer.pid):
                    self._drop(cid, "died; evicted")
                elif now - peer.last_seen > peer.timeout:
                    self._drop(cid, f"was silent for {now - peer.last_seen:.1f} s; evicted")
                    reason = f"evicted after {peer.timeout:g} s without a message"
                    self._outbox.append((cid, protocol.encode(Kind.EVICTED, reason=reason)))
                elif now - peer.last_sent > self._heartbeat_interval(peer):
                    self._outbox.append((cid, protocol.encode(Kind.HEARTBEAT)))
            self._changed.notify_all()

    def _status_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        consumers = []
        for cid, peer in self._peers.items():
            state = self._flow.consumers[cid]
            consumers.append(
                {
                    "label": peer.label,
                    "pid": peer.pid,
                    "device": peer.device,
                    "batch_size": peer.batch_size,
                    "late_join": state.policy.value,
                    "joined_s_ago": round(now - peer.joined, 3),
                    "cursor": state.cursor,
                    "lag": self._flow.lag(cid),
                    "catching_up": state.catching_up,
                    "held": len(state.held),
                    "received": state.received,
                    "skipped": state.skipped,
                    **_rates(peer.stats, now),
                }
            )
        elapsed = max(now - self._born, 1e-9)
        return {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "uptime_s": round(elapsed, 3),
            "slots": self.slots,
            "places": self._flow.slot_count,
            "replay_places": self._replay_places,
            "replay_budget_bytes": self.replay,
            "resident_batches": self._flow.resident(),
            "slot_bytes": self._store.bytes,
            "transport": self._store.kind,
            "device": self.device,
            "stragglers": self.stragglers,
            "max_lag": self.max_lag,
            "epoch": self._flow.epoch,
            "next_seq": self._flow.next_seq,
            "ended": self._flow.ended,
            "batches_per_epoch": self.batches_per_epoch,
            "samples_per_epoch": self.samples_per_epoch,
            "consumers": consumers,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in self._stats.items()},
        }


def _rates(stats: collections.deque[tuple[float, int, int, float]], now: float) -> dict[str, Any]:
    """A consumer's totals and, over its last few seconds of reports, samples/s, batches/s
    and the share of time it waited for data."""
    if not stats:
        return {
            "batches": 0,
            "samples": 0,
            "waiting_s": 0.0,
            "samples_per_s": None,
            "batches_per_s": None,
            "waiting_share": None,
        }
    t1, b1, s1, w1 = stats[-1]
    recent = [r for r in stats if now - r[0] <= _RATE_WINDOW] or [stats[-1]]
    t0, b0, s0, w0 = recent[0]
    span = t1 - t0
    rate = span > 0.2
    return {
        "batches": b1,
        "samples": s1,
        "waiting_s": round(w1, 3),
        "samples_per_s": round((s1 - s0) / span, 2) if rate else None,
        "batches_per_s": round((b1 - b0) / span, 3) if rate else None,
        "waiting_share": round(min(1.0, (w1 - w0) / span), 3) if rate else None,
    }


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


def _stop_at_exit(stop: threading.Event, wakeup: Wakeup, thread: threading.Thread, store: Store) -> None:
    stop_loop(stop, wakeup, thread)
    store.close()


class _EpochPublisher:
    """One epoch of ``for batch in producer``; a class so no generator frame pins a batch."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer

    def __iter__(self) -> _EpochPublisher:
        return self

    def __next__(self) -> Any:
        try:
            return self._producer._next_batch()
        except _Closed:
            if self._producer._closing:  # close() from another thread ends the loop
                raise StopIteration from None
            raise
