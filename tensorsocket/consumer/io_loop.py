"""The consumer's I/O thread: it creates the DEALER socket, joins the producer (HELLO /
WELCOME), then owns the socket: it receives BATCH messages and builds them into batches, sends
heartbeats, STATS and releases, and watches the producer (its pid when local, its silence
otherwise), so a lost producer raises ProducerLost in next() instead of blocking."""

from __future__ import annotations

import logging
import os
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from .. import endpoint as endpoints
from .. import protocol
from ..errors import Evicted, GroupBroken, ProducerLost, ProtocolError, Refused
from ..host import boot_id, pid_alive, pid_namespace, same_host
from ..protocol import Kind
from ..rebatch import batch_length
from ..transport import Reader, open_reader
from . import delivery
from .shared import BATCH, END, EPOCH_END, ERROR, SKIPPED, Settings, Shared

log = logging.getLogger("tensorsocket")

TICK = 0.05
_ALIVE_EVERY = 0.02  # seconds between checks that a producer on this host is alive
_STATS_EVERY = 1.0  # seconds between STATS reports to the producer


def run(shared: Shared, settings: Settings, outcome: queue.SimpleQueue[Any]) -> None:
    """The thread's body: join, report the outcome (WELCOME and the reader, or the error)
    to the constructor, then serve until the stream is over or close() stops us."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_BYTES)
    try:
        socket.connect(endpoints.connect_address(settings.endpoint))
        welcome = _handshake(socket, settings)
        reader = open_reader(
            welcome["transport"], welcome["gpu"], settings.device, settings.stream, settings.check_writes
        )
        for arena in welcome["arenas"]:
            reader.announce(arena)
    except BaseException as exc:
        _send_quietly(socket, protocol.encode(Kind.BYE))  # a WELCOME on its way registered us: leave
        socket.close(linger=100)
        outcome.put(exc)
        return
    io = ConsumerIo(socket, shared, settings, welcome, reader)
    outcome.put((welcome, reader, io))
    try:
        if io.serve():
            io.send_releases()
            _send_quietly(socket, protocol.encode(Kind.BYE))
    except Exception as exc:
        log.exception("consumer I/O thread for %s failed", settings.endpoint)
        shared.fail(ProducerLost(f"consumer I/O failed: {type(exc).__name__}: {exc}"))
    finally:
        socket.close(linger=100)


def _handshake(socket: zmq.Socket, settings: Settings) -> dict[str, Any]:
    socket.send(
        protocol.encode(
            Kind.HELLO,
            version=protocol.VERSION,
            pid=os.getpid(),
            boot_id=boot_id(),
            pidns=pid_namespace(),
            label=settings.label,
            prefetch=settings.prefetch,
            timeout=settings.timeout,
            late_join=settings.late_join,
            batch_size=settings.batch_size,
            device=str(settings.device),
            group=None if settings.group is None else list(settings.group),
            resume=None if settings.resume is None else list(settings.resume),
        )
    )
    if not socket.poll(int(settings.timeout * 1000)):
        raise ProducerLost(
            f"no producer answered at {settings.endpoint} within {settings.timeout:g} s; start one "
            "with Producer(loader, name=...) or check the name / endpoint"
        )
    kind, msg = protocol.decode(socket.recv(), protocol.MAX_REPLY_BYTES)
    if kind is Kind.WELCOME:
        return msg
    if kind in (Kind.ERROR, Kind.EVICTED):
        raise Refused(f"the producer at {settings.endpoint} refused to serve us: {msg['reason']}")
    raise ProtocolError(f"expected WELCOME from {settings.endpoint}, got {kind.value}")


@dataclass
class _Clock:
    last_seen: float  # last message from the producer
    last_sent: float  # last message to it
    last_awake: float  # when poll last returned: a long gap means this process was frozen
    last_stats: float = 0.0
    last_alive: float = 0.0  # the producer's pid last checked
    stats: tuple[int, int, float] = (0, 0, 0.0)  # last reported


class ConsumerIo:
    """The I/O thread's state; only this thread touches the socket."""

    def __init__(
        self, socket: zmq.Socket, shared: Shared, settings: Settings, welcome: dict[str, Any], reader: Reader
    ) -> None:
        self.socket, self.shared, self.settings, self.reader = socket, shared, settings, reader
        self.endpoint = settings.endpoint
        self.producer_pid = welcome["pid"]
        self.producer_local = same_host(welcome["boot_id"], welcome["pidns"])
        self.heartbeat = min(welcome["heartbeat"], settings.timeout / 4)
        self.ready_sent = False

    def serve(self) -> bool:
        """Turn until stopped (True: leave politely) or the stream is over for us (False)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.shared.wakeup.fd, zmq.POLLIN)
        now = time.monotonic()
        clock = _Clock(now, now, now)
        while not self.shared.stop.is_set():
            if not self._once(poller, clock):
                return False
        return True

    def _once(self, poller: zmq.Poller, clock: _Clock) -> bool:
        """One turn of the loop; False when this consumer's stream is over."""
        shared, timeout = self.shared, self.settings.timeout
        events = dict(poller.poll(int(TICK * 1000)))
        now = time.monotonic()
        if now - clock.last_awake > timeout / 2:
            # We were frozen (SIGSTOP, a debugger), maybe inside poll: the producer's silence
            # was ours, so give it a fresh window; and ask it something. Its answer comes after
            # anything it sent while we were frozen (EVICTED, say): once here, that was read.
            clock.last_seen = max(clock.last_seen, now)
            shared.synced.clear()
            self._send(protocol.encode(Kind.STATUS, status=None))
        clock.last_awake = now
        shared.io_tick = now  # see Batches.catch_up_after_freeze
        if self.socket in events:
            clock.last_seen = now
            if not self._receive():
                return False
        if shared.wakeup.fd in events:
            shared.wakeup.drain()
        if self.send_releases():
            clock.last_sent = now
        if shared.ready is not None and not self.ready_sent:
            self.ready_sent = True
            self._send(protocol.encode(Kind.READY, resume=shared.ready[0]))
        if shared.stream_over:
            return True
        if now - clock.last_stats >= _STATS_EVERY:
            started = shared.wait_started
            waiting = shared.waiting + (max(0.0, now - started) if started is not None else 0.0)
            stats = (shared.taken_batches, shared.taken_samples, round(waiting, 6))
            if stats != clock.stats:
                batches, samples, waiting = clock.stats = stats
                self._send(
                    protocol.encode(Kind.STATS, taken_batches=batches, taken_samples=samples, waiting=waiting)
                )
                clock.last_sent = now
            clock.last_stats = now
        if now - clock.last_sent >= self.heartbeat:
            self._send(protocol.encode(Kind.HEARTBEAT))
            clock.last_sent = now
        if self.producer_local and now - clock.last_alive >= _ALIVE_EVERY:
            # At most this often: reading /proc/<pid>/stat at every turn of a busy loop was ~9%
            # of a consumer's CPU with small batches (py-spy).
            clock.last_alive = now
            if not pid_alive(self.producer_pid):
                shared.fail(ProducerLost(f"the producer at {self.endpoint} (pid {self.producer_pid}) died"))
                return False
        if now - clock.last_seen > timeout:
            shared.fail(ProducerLost(f"no message from the producer at {self.endpoint} for {timeout:g} s"))
            return False
        return True

    def _send(self, frame: bytes) -> None:
        _send_quietly(self.socket, frame)

    def _receive(self) -> bool:
        """Handle every waiting message; False when the stream is over for this consumer."""
        shared = self.shared
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
                if kind is Kind.BATCH:
                    batch, token, release = delivery.build(msg, self.reader, shared, self.settings.copy)
                    samples = batch_length(batch)  # counted here, off the training thread
                    payload = (batch, msg["epoch"], msg["index"], msg["seq"], token, release, samples)
                    shared.queue.put((BATCH, payload))
                elif kind is Kind.SKIPPED:
                    shared.queue.put((SKIPPED, msg["count"]))
                elif kind is Kind.ARENA:
                    self.reader.announce(msg["arena"])
                elif kind is Kind.EPOCH_END:
                    shared.queue.put((EPOCH_END, msg["epoch"]))
                elif kind is Kind.END:
                    # Every earlier BATCH is built (so its arena mapped): tell the producer
                    # it may now free its arenas.
                    shared.stream_over = True
                    shared.queue.put((END, msg["reason"]))
                    self._send(protocol.encode(Kind.BYE))
                elif kind is Kind.EVICTED and shared.stream_over:
                    # We said BYE at END, so a later RELEASE or MODIFIED draws this; after END
                    # no place is reused, so the queued batches stay valid.
                    continue
                elif kind is Kind.EVICTED:
                    # Mid-stream (after END the branch above applies): our queued batches'
                    # places get reused, so never yield them.
                    shared.cut_off = Evicted(
                        f"the producer at {self.endpoint} evicted this consumer: {msg['reason']}"
                    )
                    shared.fail(shared.cut_off)
                    return False
                elif kind is Kind.GROUP_BROKEN:
                    # Nothing more comes, but what we hold stays ours until released: this thread
                    # goes on heartbeating (not shared.fail: a silent consumer is evicted, and its
                    # places reused under the batches it still holds) and releasing.
                    broken = GroupBroken(f"the producer at {self.endpoint} reports: {msg['reason']}")
                    log.error("%s", broken)
                    if msg["at_once"]:  # mid-epoch: the batches still queued are no use to DDP
                        shared.cut_off = broken
                    shared.queue.put((ERROR, broken))
                elif kind is Kind.ERROR:
                    log.error("the producer at %s reports: %s", self.endpoint, msg["reason"])
                elif kind is Kind.STATUS:
                    shared.synced.set()
                elif kind is not Kind.HEARTBEAT:
                    raise ProtocolError(f"unexpected {kind.value} message from the producer")
            except (ProtocolError, KeyError, ValueError) as exc:
                shared.fail(ProtocolError(f"bad message from the producer at {self.endpoint}: {exc}"))
                return False

    def send_releases(self) -> bool:
        """Release every retired batch (checking it was not changed while held); True if any."""
        shared, seqs = self.shared, []
        while shared.released:
            seq, token, nbytes, fingerprint, epoch, index = shared.released.popleft()
            if (
                fingerprint is not None
                and self.reader.checks_writes
                and self.reader.fingerprint(token, nbytes) != fingerprint
            ):
                self._report_modified(seq, epoch, index)
            seqs.append(seq)
        if not seqs:
            return False
        step = protocol.MAX_RELEASE_SEQS
        for start in range(0, len(seqs), step):
            self._send(protocol.encode(Kind.RELEASE, seqs=seqs[start : start + step]))
        return True

    def _report_modified(self, seq: int, epoch: int, index: int) -> None:
        message = (
            f"batch {index} of epoch {epoch} changed in shared memory while consumer "
            f"{self.settings.label!r} held it. Shared batches are read-only: every trainer reads the same "
            "memory, so an in-place op (x.sub_(mean), x /= 255, x[...] = ...) corrupts the others' "
            "data. Use an out-of-place op (x = x - mean) or Consumer(copy=True). If this process "
            "wrote nothing, another consumer holding the batch did: see the producer's log."
        )
        log.error("%s", message)
        self.shared.violations.append(message)
        self._send(protocol.encode(Kind.MODIFIED, seq=seq, epoch=epoch, index=index))


def _send_quietly(sock: zmq.Socket, frame: bytes) -> None:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # no producer connected any more: nobody to tell
