"""The consumer's I/O thread: it creates the DEALER socket, joins the producer (HELLO /
WELCOME), then owns the link (that socket, then its session): it builds BATCHes into batches, sends
heartbeats, STATS and releases, and watches the producer (its pid when local, its silence
otherwise), so a lost producer raises ProducerLost in next() instead of blocking."""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

import zmq

from .. import protocol
from ..errors import Evicted, GroupBroken, ProducerLost, ProtocolError, Refused
from ..host import pid_alive, same_host
from ..layout_table import Recipes
from ..protocol import Kind
from ..transport import Reader
from . import delivery, handshake, resume
from .link import Link
from .shared import BATCH, END, EPOCH_END, ERROR, RESTARTED, SKIPPED, Settings, Shared

log = logging.getLogger("tensorsocket")

TICK = 0.05
_ALIVE_EVERY = 0.02  # seconds between checks that a producer on this host is alive
_STATS_EVERY = 1.0  # seconds between STATS reports to the producer


def run(shared: Shared, settings: Settings, outcome: queue.SimpleQueue[Any]) -> None:
    """The thread's body: join, report the outcome (WELCOME and the reader, or the error)
    to the constructor, then serve until the stream is over or close() stops us."""
    socket = handshake.connect(settings)
    resume = None if settings.resume is None else [*settings.resume, False]
    try:
        welcome = handshake.join(socket, settings, resume, settings.timeout, shared)
        reader = handshake.open_reader_for(welcome, settings)
        recipes = Recipes(welcome["layouts"])
    except BaseException as exc:
        _send_quietly(socket, protocol.encode(Kind.BYE))  # a WELCOME on its way registered us: leave
        socket.close(linger=100)
        outcome.put(exc)
        return
    io = ConsumerIo(socket, shared, settings, welcome, reader, recipes)
    outcome.put((welcome, reader, io))
    try:
        if io.serve():
            io.send_releases()
            io.link.send(protocol.encode(Kind.BYE))
    except Exception as exc:
        log.exception("consumer I/O thread for %s failed", settings.endpoint)
        shared.fail(ProducerLost(f"consumer I/O failed: {type(exc).__name__}: {exc}"))
    finally:
        io.link.close(linger_ms=100)


@dataclass
class _Clock:
    last_seen: float  # last message from the producer
    last_sent: float  # last message to it
    last_awake: float  # when poll last returned: a long gap means this process was frozen
    last_stats: float = 0.0
    last_alive: float = 0.0  # the producer's pid last checked
    stats: tuple[int, int, float] = (0, 0, 0.0)  # last reported


class ConsumerIo:
    """The I/O thread's state; only this thread touches the link."""

    def __init__(
        self,
        socket: zmq.Socket,
        shared: Shared,
        settings: Settings,
        welcome: dict[str, Any],
        reader: Reader,
        recipes: Recipes,
    ) -> None:
        self.shared, self.settings = shared, settings
        self.endpoint = settings.endpoint
        self.poller = zmq.Poller()
        self.poller.register(shared.wakeup.fd, zmq.POLLIN)
        self.link = Link(socket, self.poller, settings.timeout, shared.stop)
        self._welcomed(welcome, reader, recipes)
        self.ready_sent = False
        # For a rejoin: the stream and the last entry received (its seq and where the next
        # batch is), so a successor resumes right after it and what came again is dropped.
        self.stream: str = welcome["stream"]
        self.last_seq = -1
        self.next_at: tuple[int, int] | None = None if settings.resume is None else settings.resume[1:]
        self.drop_through = -1  # after a rejoin: entries up to this seq came before
        self.rejoined_at: tuple[int, int] | None = None  # after a rejoin: where the next batch should be
        self.size = 1 if settings.group is None else settings.group[2]

    def _welcomed(self, welcome: dict[str, Any], reader: Reader, recipes: Recipes) -> None:
        self.reader, self.recipes = reader, recipes  # (a successor numbers its layouts anew)
        self.producer_pid = welcome["pid"]
        self.producer_local = same_host(welcome["boot_id"], welcome["pidns"])
        self.heartbeat = min(welcome["heartbeat"], self.settings.timeout / 4)
        self.batches_per_epoch: int | None = welcome["batches"]
        self.link.open_session(welcome, self.producer_local)

    def serve(self) -> bool:
        """Turn until stopped (True: leave politely) or the stream is over for us (False)."""
        now = time.monotonic()
        clock = _Clock(now, now, now)
        while not self.shared.stop.is_set():
            if not self._once(self.poller, clock):
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
        if self.link.readable(events):
            clock.last_seen = now
            if not self._receive():
                return False
            # Closed under us: it died (while its pid still looks alive as it exits, or it cut
            # us off without a word, the pid and silence checks below decide, as before sessions).
            if self.link.closed and not shared.stream_over and not pid_alive(self.producer_pid):
                return self._lost(f"the producer at {self.endpoint} (pid {self.producer_pid}) died", clock)
        if shared.wakeup.fd in events:
            shared.wakeup.drain()
        if self.send_releases():
            clock.last_sent = now
        if shared.ready is not None and not self.ready_sent:
            self.ready_sent = True
            self._send(protocol.encode(Kind.READY, resume=self._ready_at(shared.ready[0])))
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
                return self._lost(f"the producer at {self.endpoint} (pid {self.producer_pid}) died", clock)
        if now - clock.last_seen > timeout:
            return self._lost(f"no message from the producer at {self.endpoint} for {timeout:g} s", clock)
        return True

    def _ready_at(self, restored: list[Any] | None) -> list[Any] | None:
        """A group member's READY position: the batch after the last one it received (it
        rejoins a successor), else where it was restored, if it was."""
        if self.last_seq < 0 or self.next_at is None:
            return None if restored is None else [*restored, False]
        return [self.stream, *self.next_at, True]

    def _lost(self, why: str, clock: _Clock) -> bool:
        """The producer died or went silent: with ``reconnect``, wait for a successor on the
        same endpoint and rejoin it after the last batch received (the batches held and
        queued stay valid: their memory stays mapped); else, or if none comes, ProducerLost."""
        wait = self.settings.reconnect
        if not wait:
            self.shared.fail(ProducerLost(why))
            return False
        log.warning("%s; waiting up to %g s for a producer to continue the stream", why, wait)
        self.link = self.link.renewed(handshake.connect(self.settings))
        at = None if self.next_at is None else [self.stream, *self.next_at, True]
        try:
            welcome = handshake.join(self.link.socket, self.settings, at, wait, self.shared)
        except (ProducerLost, Refused, ProtocolError, ValueError) as exc:
            if self.shared.stop.is_set():
                return True  # close() was called meanwhile
            self.shared.fail(
                ProducerLost(f"{why}; waited {wait:g} s for a producer to continue the stream: {exc}")
            )
            return False
        if welcome["pid"] == self.producer_pid and self.producer_local:
            # Silent, not dead: our old connection is still registered there, and once it is
            # evicted the places under what we hold and have queued may be reused.
            self.link.send(protocol.encode(Kind.BYE))
            self.shared.fail(ProducerLost(f"{why}; it is still running, so this consumer cannot rejoin it"))
            return False
        if not self._same_stream(welcome):
            self.link.send(protocol.encode(Kind.BYE))
            return False
        try:
            reader = handshake.open_reader_for(welcome, self.settings)
            recipes = Recipes(welcome["layouts"])
        except Exception as exc:
            self.link.send(protocol.encode(Kind.BYE))
            self.shared.fail(ProducerLost(f"{why}; its successor's memory or layouts cannot be read: {exc}"))
            return False
        old, self.reader = self.reader, None  # type: ignore[assignment]
        old.close()  # the old producer's memory stays mapped under the batches still held
        self._welcomed(welcome, reader, recipes)
        self.ready_sent = False  # a group member says READY again, at its rejoin position
        now = time.monotonic()
        clock.last_seen = clock.last_sent = clock.last_alive = clock.last_awake = now
        log.warning("rejoined the stream at %s (producer pid %d)", self.endpoint, self.producer_pid)
        return True

    def _same_stream(self, welcome: dict[str, Any]) -> bool:
        """Does the successor continue our stream? The same stream: drop what came before.
        Our epoch started again (its loader cannot repeat its order): say how many batches
        come again. Another stream: ProducerLost (we cannot go on exactly)."""
        restarted = welcome["restarted"]
        if welcome["stream"] == self.stream:
            self.drop_through, self.rejoined_at = self.last_seq, self.next_at
            return True
        if self.last_seq < 0 and self.settings.resume is None:  # it had nothing yet: nothing to lose
            self.stream = welcome["stream"]
            self.shared.queue.put((RESTARTED, (self.stream, 0)))
            return True
        if restarted is not None and restarted[0] == self.stream and self.next_at is not None:
            epoch, index = self.next_at
            again = index if epoch == restarted[1] else None
            self.stream, self.drop_through = welcome["stream"], -1
            log.warning(
                "the producer at %s started epoch %d again from its first batch (its loader does not repeat "
                "its order): this consumer gets %s batches of it again",
                self.endpoint, restarted[1], "some" if again is None else again,
            )  # fmt: skip
            self.shared.queue.put((RESTARTED, (self.stream, again)))
            return True
        self.shared.fail(
            ProducerLost(
                f"the producer now at {self.endpoint} serves another stream (it was not started with "
                "resume=True, or its state file was removed): this consumer cannot go on exactly"
            )
        )
        return False

    def _send(self, frame: bytes) -> None:
        self.link.send(frame)

    def _receive(self) -> bool:
        """Handle every waiting message; False when the stream is over for this consumer."""
        shared = self.shared
        while True:
            frame = self.link.recv()
            if frame is None:
                return True
            try:
                kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
                if kind in (Kind.BATCH, Kind.EPOCH_END) and not self._new(kind, msg):
                    continue
                if kind is Kind.BATCH:
                    recipe = self.recipes.get(msg["layout"])
                    batch, token, release = delivery.build(
                        msg, recipe, self.reader, shared, self.settings.copy
                    )
                    samples = recipe.count(batch)  # counted here, off the training thread
                    payload = (
                        batch,
                        msg["epoch"],
                        msg["index"],
                        msg["seq"],
                        token,
                        release,
                        samples,
                        self.reader,
                    )
                    shared.queue.put((BATCH, payload))
                elif kind is Kind.SKIPPED:
                    shared.queue.put((SKIPPED, msg["count"]))
                elif kind is Kind.ARENA:
                    self.reader.announce(msg["arena"])
                elif kind is Kind.LAYOUT:
                    self.recipes.define(msg["number"], msg["layout"])
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

    def _new(self, kind: Kind, msg: dict[str, Any]) -> bool:
        """Note where the stream is for a rejoin; False for an entry received before it (a
        successor publishes again from its restart point): released at once, not yielded."""
        if msg["seq"] <= self.drop_through:
            if kind is Kind.BATCH:
                self._send(protocol.encode(Kind.RELEASE, seqs=[msg["seq"]]))
            return False
        if self.rejoined_at is not None:
            self._after_rejoin(kind, msg)
        self.last_seq = msg["seq"]
        if kind is Kind.EPOCH_END:
            self.next_at = (msg["epoch"] + 1, 0)
        else:
            self.next_at = (msg["epoch"], (msg["index"] // self.size + 1) * self.size)
        return True

    def _after_rejoin(self, kind: Kind, msg: dict[str, Any]) -> None:
        """The first entry after a rejoin. An epoch end it jumps over is ended here. Batches
        between where we rejoined and it were lost (the successor no longer had them: say, a
        consumer joined with a replay just before the crash, before the state file said so):
        said, and counted in ``missed``."""
        epoch, index = self.rejoined_at  # type: ignore[misc]
        self.rejoined_at = None
        for ended in range(epoch, msg["epoch"]):
            # An epoch's end marker is not held, so it may have been in flight when the producer
            # died while the successor starts after it: end that epoch here, as it would have.
            self.shared.queue.put((EPOCH_END, ended))
        first = (msg["epoch"], msg["index"] - msg["index"] % self.size) if kind is Kind.BATCH else None
        if first is None or first == (epoch, index):
            return
        lost = resume.missed(resume.Position(self.stream, epoch, index), *first, self.batches_per_epoch)
        if lost:
            self.shared.missed += lost
            log.warning(
                "rejoined at batch %d of epoch %d, which the producer no longer had: %d batches missed",
                index, epoch, lost,
            )  # fmt: skip

    def send_releases(self) -> bool:
        """Release every retired batch (checking it was not changed while held); True if any."""
        shared, seqs = self.shared, []
        while shared.released:
            seq, token, nbytes, fingerprint, epoch, index, reader = shared.released.popleft()
            if reader is not self.reader:
                continue  # from a producer that died: nothing to release to
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
        message = delivery.modified(self.settings.label, epoch, index)
        log.error("%s", message)
        self.shared.violations.append(message)
        self._send(protocol.encode(Kind.MODIFIED, seq=seq, epoch=epoch, index=index))


def _send_quietly(sock: zmq.Socket, frame: bytes) -> None:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # no producer connected any more: nobody to tell
