"""The consumer's I/O thread: it creates the DEALER socket, joins the producer (HELLO /
WELCOME), then keeps the link (that socket, then its session): it reads and builds BATCHes
(:mod:`~tensorsocket.consumer.inbox`; the caller's thread reads them itself while it waits in
next() for host batches, :mod:`~tensorsocket.consumer.caller_turn`), sends heartbeats, STATS
and releases, and watches the producer (its pid when local, its silence otherwise), so a lost
producer raises ProducerLost in next() instead of blocking."""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from typing import Any

import zmq

from .. import protocol
from ..errors import ProducerLost, ProtocolError, Refused
from ..host import pid_alive, pid_watch, same_host, stopped
from ..layout_table import Recipes
from ..protocol import Kind
from ..transport import Reader
from ..wakeup import begins
from . import handshake
from .inbox import Inbox
from .link import Link
from .shared import RESTARTED, TICK, Settings, Shared

log = logging.getLogger("tensorsocket")

_TICK_MS = int(TICK * 1000)
_ALIVE_EVERY = 0.02  # seconds between checks that a producer on this host is alive (no pidfd)
_STATS_EVERY = 1.0  # seconds between STATS reports to the producer
_ZMQ_GRACE_MS = 100  # after the producer's end, how long ZeroMQ may take to hand over its last messages


def run(shared: Shared, settings: Settings, outcome: queue.SimpleQueue[Any]) -> None:
    """The thread's body: join, report the outcome (WELCOME and the reader, or the error)
    to the constructor, then serve until the stream is over or close() stops us."""
    if not begins(shared.stop, shared.link_lock):  # (a stop may come first: see Consumer())
        return
    socket, monitor = handshake.connect(settings)
    resume = None if settings.resume is None else [*settings.resume, False]
    try:
        welcome = handshake.join(socket, monitor, settings, resume, settings.timeout, shared)
        reader = handshake.open_reader_for(welcome, settings)
        recipes = Recipes(welcome["layouts"])
    except BaseException as exc:
        _send_quietly(socket, shared.bye())  # a WELCOME on its way registered us: leave
        socket.close(linger=100)
        outcome.put(exc)
        return
    io = ConsumerIo(socket, shared, settings, welcome, reader, recipes)
    outcome.put((welcome, reader, io))
    try:
        if io.serve():
            with shared.link_lock:
                io.send_releases()
    except Exception as exc:
        log.exception("consumer I/O thread for %s failed", settings.endpoint)
        shared.fail(ProducerLost(f"consumer I/O failed: {type(exc).__name__}: {exc}"))
    finally:
        with shared.link_lock:  # (the caller's thread may be reading it)
            # Leave, however this consumer's stream ended (close(), an error here, a bad
            # message): a producer still serving takes back the places we held at once, not
            # after our `timeout` of silence, pacing everyone meanwhile. (Said twice, or to a
            # producer that is gone or evicted us, it changes nothing; a send never raises.)
            io.link.send(shared.bye())
            io.link.close(linger_ms=100)
        io.unwatch_producer()


@dataclass
class _Clock:
    last_sent: float  # last message to the producer
    last_awake: float  # when poll last returned: a long gap means this process was frozen
    last_stats: float = 0.0
    last_alive: float = 0.0  # the producer's pid last checked
    stats: tuple[int, int, float] = (0, 0, 0.0)  # last reported


class ConsumerIo(Inbox):
    """The I/O thread's state and loop; it touches the link under ``shared.link_lock``."""

    def __init__(
        self,
        socket: zmq.Socket,
        shared: Shared,
        settings: Settings,
        welcome: dict[str, Any],
        reader: Reader,
        recipes: Recipes,
    ) -> None:
        self.poller = zmq.Poller()
        self.poller.register(shared.wakeup.fd, zmq.POLLIN)
        self.pidfd: int | None = None  # readable once the producer (on this host) ends
        super().__init__(
            shared, settings, Link(socket, self.poller, settings.timeout, shared.stop), welcome["stream"]
        )
        self._welcomed(welcome, reader, recipes)
        self.ready_sent = False

    def _welcomed(self, welcome: dict[str, Any], reader: Reader, recipes: Recipes) -> None:
        self.reader, self.recipes = reader, recipes  # (a successor numbers its layouts anew)
        self.producer_pid = welcome["pid"]
        self.producer_local = same_host(welcome["boot_id"], welcome["pidns"])
        self.heartbeat = min(welcome["heartbeat"], self.settings.timeout / 4)
        self.batches_per_epoch = welcome["batches"]
        self.shared.starts_with = welcome["starts_with"]
        # The places this consumer may hold at once: its prefetch caps the producer's window
        self.shared.io_sleeping.window = min(self.settings.prefetch, welcome["slots"])
        self.link.open_session(welcome, self.producer_local)
        self.unwatch_producer()
        self.pidfd = pid_watch(self.producer_pid) if self.producer_local else None
        if self.pidfd is not None:
            self.poller.register(self.pidfd, zmq.POLLIN)

    def unwatch_producer(self) -> None:
        if self.pidfd is not None:
            self.poller.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None

    def serve(self) -> bool:
        """Turn until stopped (True: leave politely) or the stream is over for us (False)."""
        now = time.monotonic()
        clock = _Clock(now, now)
        shared = self.shared
        sleeping = shared.io_sleeping
        while not shared.stop.is_set():
            # Over a session of host batches the caller's thread reads while in next(), and we
            # read ahead at our ticks while it is away: we poll the link only when it cannot.
            # Asleep from here: a release made meanwhile that must go now wakes us.
            sleeping.now = sleeping.long = True  # (long until decided: the caller may wake us)
            reading = not self.caller_may_read()
            self.link.watch(reading)
            sleeping.reading = reading
            wait = self._sleep_ms(clock, reading)
            sleeping.long = wait > _TICK_MS
            urgent = shared.released and sleeping.wants(shared.live, shared.released)
            events = dict(self.poller.poll(0 if urgent else wait))
            sleeping.now = False
            with shared.link_lock:
                if self.over or not self._once(events, clock):
                    return False
        return True

    def _sleep_ms(self, clock: _Clock, reading: bool) -> int:
        """How long to sleep (``reading``: this thread reads the link, the caller's may not).
        A TICK while the caller is away from next() over a session of host batches (we read
        ahead at each), or while the producer's pid must be polled.
        Else until the next thing due (a heartbeat, STATS, the producer's silence deadline),
        at most a quarter of ``timeout`` (a longer gap reads as a freeze): a consumer waiting
        in next() for a slow loader then costs no wake-up of this thread per batch (~250 us
        of CPU each on a 2-core VM); if it then steps, we read ahead only from our next wake
        (its next() reads meanwhile). What must happen sooner wakes us: a message we read, a
        release that must go now, close(), the caller taking a batch we read ahead (see
        CallerTurns.take), the end of the session or of the producer (its pidfd)."""
        if not reading and not self.shared.caller_inside:
            return _TICK_MS
        if self.shared.stream_over or (self.producer_local and self.pidfd is None):
            return _TICK_MS  # (over: nothing is due any more, see _once)
        timeout = self.settings.timeout
        due = min(clock.last_sent + self.heartbeat, clock.last_stats + _STATS_EVERY, self.last_seen + timeout)
        return max(1, min(int((due - time.monotonic()) * 1000) + 1, int(timeout * 250)))

    def _once(self, events: dict[Any, int], clock: _Clock) -> bool:
        """One turn of the loop (``link_lock`` held); False when this consumer's stream is over."""
        shared, timeout = self.shared, self.settings.timeout
        now = time.monotonic()
        if now - clock.last_awake > timeout / 2:
            # We were frozen (SIGSTOP, a debugger), maybe inside poll: the producer's silence
            # was ours, so give it a fresh window; and ask it something. Its answer comes after
            # anything it sent while we were frozen (EVICTED, say): once here, that was read.
            self.last_seen = max(self.last_seen, now)
            shared.synced.clear()
            self._send(protocol.encode(Kind.STATUS, status=None))
        clock.last_awake = now
        shared.io_tick = now  # see Batches.catch_up_after_freeze
        # A message, or the session's end (watched even while the caller's thread reads it: an
        # EVICTED before it must be read before the caller hands out a batch whose place the
        # producer reuses); else, with the caller away from next(), read ahead (CallerTurns).
        if self.link.readable(events):
            self.last_seen = now
            if not self.receive():
                return False
        elif self.caller_may_read() and not shared.caller_inside:
            if not self.receive():
                return False
        if self.pidfd is not None and self.pidfd in events:
            self.unwatch_producer()  # (it stays readable: the producer ended)
            if not self.link.switched:  # what it sent last may still be in ZeroMQ's own thread
                self.link.socket.poll(_ZMQ_GRACE_MS)
            if not self.receive():  # what it sent before it ended comes first (END, say)
                return False
            if not shared.stream_over:
                return self._lost(self._died(), clock, dead=True)
        # Closed under us (read here or by the caller's thread): it died (while its pid still
        # looks alive as it exits, or it cut us off without a word, the pid and silence checks
        # below decide, as before sessions).
        if self.link.closed and not shared.stream_over and not pid_alive(self.producer_pid):
            return self._lost(self._died(), clock, dead=True)
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
        if self.producer_local and self.pidfd is None and now - clock.last_alive >= _ALIVE_EVERY:
            # At most this often: reading /proc/<pid>/stat at every turn of a busy loop was ~9%
            # of a consumer's CPU with small batches (py-spy).
            clock.last_alive = now
            if not pid_alive(self.producer_pid):
                return self._lost(self._died(), clock, dead=True)
        if now - self.last_seen > timeout:
            why = f"no message from the producer at {self.endpoint} for {timeout:g} s"
            note = stopped(self.producer_pid) if self.producer_local else ""  # alive, so say why
            return self._lost(f"{why}: {note}" if note else why, clock, dead=False)
        return True

    def _died(self) -> str:
        return f"the producer at {self.endpoint} (pid {self.producer_pid}) died"

    def _has_position(self) -> bool:
        """Has this consumer a place in its stream to rejoin at (``next_at``)? Once it received
        something of it, or switched to a stream that starts its epoch again (nothing of it yet)."""
        return self.last_seq >= 0 or self.rejoins_fresh

    def _ready_at(self, restored: list[Any] | None) -> list[Any] | None:
        """A group member's READY position: the batch after the last one it received (it
        rejoins a successor), else where it was restored, if it was."""
        if not self._has_position() or self.next_at is None:
            return None if restored is None else [*restored, False]
        return [self.stream, *self.next_at, True]

    def _lost(self, why: str, clock: _Clock, dead: bool) -> bool:
        """The producer died (``dead``) or went silent: with ``reconnect``, wait for a successor
        on the same endpoint and rejoin it after the last batch received (the batches held and
        queued stay valid: their memory stays mapped); else, or if none comes, ProducerLost."""
        # What it sent before it was lost comes first (EVICTED, END), and goes with its link
        if not self.receive():
            return False
        if self.shared.stream_over:
            return True
        wait = self.settings.reconnect
        if self.freed is not None and wait and self.before_freed is not None:
            # Unlinked by a successor (an eviction would have come first, and was read): we
            # never had that batch, nor any after it, so we rejoin from it. (A frozen consumer
            # had the BATCH queued for a place it had not mapped yet when the producer died.)
            self.rejoin_from_freed()
        elif self.freed is not None:  # a batch is lost already: a rejoin could not be exact
            why, wait = f"{why}; {self.freed}", 0
        if not wait:
            self.shared.fail(ProducerLost(why))
            return False
        if dead:
            # A STATUS asked after a freeze is never answered now, and no place under the
            # batches queued is written again (an eviction would have come first, and was
            # read): they may be taken while we wait for a successor, rather than next()
            # raising ProducerLost after `timeout` (wait_checks.catch_up_after_freeze).
            self.shared.synced.set()
        log.warning("%s; waiting up to %g s for a producer to continue the stream", why, wait)
        socket, monitor = handshake.connect(self.settings)
        self.link = self.link.renewed(socket)
        at = self._ready_at(self.settings.resume)  # (a rejoin only after what it received)
        try:
            welcome = handshake.join(socket, monitor, self.settings, at, wait, self.shared)
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
            self.link.send(self.shared.bye())
            self.shared.fail(
                ProducerLost(
                    f"the producer at {self.endpoint} (pid {self.producer_pid}) sent nothing for "
                    f"{self.settings.timeout:g} s (stopped or stalled), so this consumer gave it up; it answered "
                    "again, but it cannot be rejoined (this consumer's old connection is still registered there, "
                    "and the places under the batches it holds may be reused): a longer timeout rides out such pauses"
                )
            )
            return False
        if not self._same_stream(welcome):
            self.link.send(self.shared.bye())
            return False
        try:
            reader = handshake.open_reader_for(welcome, self.settings)
            recipes = Recipes(welcome["layouts"])
        except Exception as exc:
            self.link.send(self.shared.bye())
            self.shared.fail(ProducerLost(f"{why}; its successor's memory or layouts cannot be read: {exc}"))
            return False
        old, self.reader = self.reader, None  # type: ignore[assignment]
        old.close()  # the old producer's memory stays mapped under the batches still held
        self._welcomed(welcome, reader, recipes)
        # The lost producer never answers a STATUS asked after a freeze; what it sent was read
        # above, and it writes no place any more (a successor holds its name): this WELCOME is
        # the answer.
        self.shared.synced.set()
        self.ready_sent = False  # a group member says READY again, at its rejoin position
        now = time.monotonic()
        self.last_seen = clock.last_sent = clock.last_alive = clock.last_awake = now
        log.warning("rejoined the stream at %s (producer pid %d)", self.endpoint, self.producer_pid)
        return True

    def _same_stream(self, welcome: dict[str, Any]) -> bool:
        """Does the successor continue our stream? The same stream: drop what came before.
        Our epoch started again (its loader cannot repeat its order): say how many batches
        come again. Another stream: ProducerLost (we cannot go on exactly)."""
        restarted = welcome["restarted"]
        if welcome["stream"] == self.stream:
            # (one restored that received nothing yet: its restore says what it missed, once)
            self.drop_through = self.last_seq
            self.rejoined_at = self.next_at if self._has_position() else None
            return True
        if not self._has_position() and self.settings.resume is None:  # it had nothing yet: nothing to lose
            self.stream = welcome["stream"]
            self.shared.queue.put((RESTARTED, (self.stream, 0)))
            return True
        replaced = protocol.replaced_streams(restarted)
        if self.settings.group is not None:  # (a rank two restarts back: its group broke at the first)
            replaced = replaced[:1]
        if self.stream in replaced and self.next_at is not None:
            # Our epoch (the one started again, or one after it: each comes again, in a new order)
            # from its start: what we had of it comes again (a group rank had one batch a round).
            # Its READY, or a HELLO to the next successor, names that start on the new stream.
            epoch, index = self.next_at
            # What we had of it: from the first batch we got of it (a late joiner's first epoch
            # starts part-way; none of it, when nothing of it came: its end was our last entry)
            had_from = self.began[1] if self.began[0] == epoch else index
            again = (index - had_from) // self.size
            self.stream, self.drop_through, self.next_at = welcome["stream"], -1, (epoch, 0)
            self.began = (epoch, 0)  # (from its start on the new stream)
            if self.settings.group is None:
                # The new stream places us only at an epoch's start: the epochs between its
                # first and ours, which we had, are dropped. (A group's ranks are sent the same
                # epochs, which they may straddle: dropping could make their shares unequal.)
                # Placed past that start (we rejoin after it stopped waiting for us, and it no
                # longer has it), the first entry ends our epoch and counts what we missed.
                self.drop_before_epoch, self.rejoined_at = epoch, (epoch, 0)
            self.last_seq, self.rejoins_fresh = -1, True  # (its numbers are the old stream's)
            log.warning(
                "the producer at %s started epoch %d again from its first batch, as a new stream (its loader "
                "does not repeat its order): this consumer gets epoch %d from its start, %d batches of it again",
                self.endpoint, restarted[1], epoch, again,
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


def _send_quietly(sock: zmq.Socket, frame: bytes) -> None:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # no producer connected any more: nobody to tell
