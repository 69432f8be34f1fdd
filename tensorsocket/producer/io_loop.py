"""The producer's I/O thread: it creates and owns the ROUTER socket, applies every valid
incoming message to the shared record, evicts dead or silent consumers, sends heartbeats,
and drains the outbox in the order the flow decided.

The socket is created and bound in this thread (a ZeroMQ socket belongs to one thread); the
constructor waits for the bind's outcome, so a bind error still raises from ``Producer()``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Hashable
from typing import Any

import zmq

from .. import protocol
from ..errors import ProtocolError
from ..flow import UNSAID, LateJoin, Membership, Said, Tail
from ..host import boot_id, pid_alive, pid_namespace, same_host
from ..protocol import Kind
from ..wakeup import begins
from . import successor
from .listen import listen
from .room import check_group_fits, evict_group_that_does_not_fit
from .session_turns import HANDOVER, publisher_turn
from .sessions import QUEUE_PER_PEER, Sessions, send_zmq
from .shared import ROUTINE, TICK, TICK_MS, Peer, Shared, heartbeat_every
from .writes import report_modified

log = logging.getLogger("tensorsocket")

_BIND_TIMEOUT = 30.0


class IoLoop:
    """The I/O thread's state and its loop. Only this thread touches the socket."""

    def __init__(self, shared: Shared, endpoint: str, owner: object) -> None:
        self.shared = shared
        self._bound: queue.SimpleQueue[str | BaseException] = queue.SimpleQueue()
        # ``owner`` (the Producer) lives in the thread's arguments while it serves, let go when it ends:
        # kept longer, a closed producer's DataLoader would wait for the GC (torch waits 5 s a worker)
        self.thread = threading.Thread(
            target=self._run, args=(endpoint, owner), name="tensorsocket-producer-io", daemon=True
        )
        self.declined = False  # a session's message was left to the publishing thread's turn
        # Its begin and a stop (set under it) in one order: a thread whose start() Ctrl-C cut short
        # may run after the stop, unjoined (no ident yet): it must not bind the name given back
        # (an ipc bind takes the path from whoever holds it by then).
        self.gate = threading.Lock()

    def start(self) -> str:
        """Start the thread; return the endpoint it bound (a tcp ``:*`` resolved to its port),
        or raise RuntimeError naming the endpoint if the bind failed."""
        self.thread.start()
        try:
            outcome = self._bound.get(timeout=_BIND_TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"the producer's I/O thread did not bind within {_BIND_TIMEOUT:g} s") from None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # ------------------------------------------------------------------ the loop

    def _run(self, endpoint: str, owner: object) -> None:
        if not begins(self.shared.stop, self.gate):  # (see __init__)
            return
        try:
            socket, endpoint, unguard = listen(endpoint)
        except Exception as exc:  # (RuntimeError or KeysError: start() raises it)
            self._bound.put(exc)
            return
        self.sessions = Sessions()
        self.shared.direct = self.sessions.send_now
        self._bound.put(endpoint)
        self.socket, self.endpoint = socket, endpoint
        shared = self.shared
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(shared.wakeup.fd, zmq.POLLIN)
        polled: dict[int, int] = {}  # session descriptors registered, with their events
        next_tick = 0.0
        try:
            while not shared.stop.is_set():
                turn = publisher_turn(shared)
                polled = _repoll(poller, polled, self.sessions.fds(not turn))
                events = dict(poller.poll(_turn_left_ms(shared) if self.declined else TICK_MS))
                self.declined = False
                if shared.wakeup.fd in events:
                    shared.wakeup.drain()
                if socket in events:
                    if turn:  # what came over the sessions before it, first: a BYE before a later HELLO
                        for fd in list(self.sessions.cid_of):
                            self._session_event(fd, catch_up=True)
                    self._receive()
                left = list(self.sessions.stashed)  # (a snapshot: the caller's thread adds under the lock)
                for fd in (polled.keys() & events.keys()).union(left):
                    self._session_event(fd)
                now = time.monotonic()
                if now >= next_tick:
                    self._check_peers(now)
                    self.sessions.expire(now)
                    next_tick = now + TICK
                self._flush(now)
            self._flush(time.monotonic())
        except Exception:
            log.exception("producer I/O thread on %s failed", endpoint)
        finally:
            with shared.changed:
                shared.direct = None
                self.sessions.close()
            socket.close()
            unguard()
            with shared.changed:
                shared.notify()

    def _flush(self, now: float, switch: tuple[Hashable, Any] | None = None) -> None:
        """Send what is queued: over sessions under the lock (nothing the caller's thread sends
        straight may overtake it), then over ZeroMQ. ``switch``: a consumer moving to its session."""
        shared, zmq_frames = self.shared, []
        with shared.changed:
            shared.io_wanted = False
            while shared.outbox:
                cid, frame = shared.outbox.popleft()
                peer = shared.peers.get(cid)
                if peer is not None:
                    peer.last_sent = now
                if not self.sessions.send(self.socket, cid, frame):
                    zmq_frames.append((cid, frame))
            version = self.sessions.version
            full = [] if switch is None else self.sessions.switch(self.socket, switch, zmq_frames)
            self.sessions.close_gone(shared.peers)
            if self.sessions.version != version:
                shared.notify()  # (a publishing thread asleep on the sessions polls anew)
        _cut_off_unread(self, full + send_zmq(self.socket, zmq_frames))

    def _session_event(self, fd: int, catch_up: bool = False) -> None:
        """Something on a session descriptor: a connection to accept, one saying whose it is
        (then everything queued for that consumer goes over ZeroMQ, then SWITCHED, then the
        rest over the connection), room to send, or a consumer's messages (read in the
        publishing thread's turn too when ``catch_up``)."""
        sessions = self.sessions
        if sessions.listener is not None and fd == sessions.listener.fileno():
            sessions.accept()
        elif sessions.unbound(fd):
            with self.shared.changed:  # (an eviction in the publishing thread forgets a joiner's token)
                bound = sessions.bind(fd, self.shared.peers)
            if bound is not None:
                self._flush(time.monotonic(), switch=bound)
        elif fd in sessions.cid_of:
            cid = sessions.cid_of[fd]
            with self.shared.changed:  # (the caller's thread sends on it, and may read it, too)
                sessions.by_cid[cid].flush()
                left = fd in sessions.stashed
                if not catch_up and not left and publisher_turn(self.shared):
                    self.declined = not self.shared.publisher_polling  # (if polling, it reads it now)
                    return  # the caller's thread reads it
                frames, closed = sessions.read(fd)
                for frame in frames:
                    self._apply(cid, frame)
                if closed:  # (or cut off for breaking the protocol)
                    self._closed(cid)
                if left:  # the publishing thread waits for it (a bad message notifies nobody)
                    self.shared.notify()

    def _receive(self) -> None:
        for _ in range(1000):  # bounded, so ticks still run under a flood
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad(frames[0], f"expected 1 frame after the routing id, got {len(frames) - 1}")
                continue
            self._apply(*frames)

    def _apply(self, cid: bytes, frame: bytes) -> None:
        try:
            kind, msg = protocol.decode(frame)
            with self.shared.changed:
                self._handle(cid, kind, msg)
                self.shared.notify()
        except ProtocolError as exc:
            self._bad(cid, str(exc))

    def _closed(self, cid: bytes) -> None:
        """A consumer's session closed without a BYE: it died (if its pid still looks alive
        while it exits, the liveness checks evict it), or broke the protocol."""
        with self.shared.changed:
            self.sessions.drop(cid)
            peer = self.shared.peers.get(cid)
            if peer is not None and peer.local and not pid_alive(peer.pid):
                self.drop(cid, "died; evicted")
            self.shared.notify()

    def _bad(self, cid: bytes, reason: str) -> None:
        shared = self.shared
        with shared.changed:
            shared.stats["bad_messages"] = count = shared.stats["bad_messages"] + 1
            shared.post(cid, protocol.encode(Kind.ERROR, reason=reason[:4000]))
        if count <= 20 or count % 1000 == 0:
            log.warning("bad message from %r: %s (%d so far)", cid, reason, count)

    # ------------------------------------------------------------------ messages (lock held)

    def _handle(self, cid: bytes, kind: Kind, msg: dict[str, Any]) -> None:
        """Apply one valid message."""
        shared = self.shared
        now = time.monotonic()
        if shared.apply_routine(cid, kind, msg, now):
            return
        peer = shared.peers.get(cid)
        if peer is not None:
            peer.last_seen = now
        if kind is Kind.HELLO:
            self._hello(cid, msg, now)
        elif kind is Kind.STATUS:
            shared.post(cid, protocol.encode(Kind.STATUS, status=shared.status()))
        elif peer is None:
            _from_unknown(shared, cid, kind)
        elif kind is Kind.READY:
            if not evict_group_that_does_not_fit(shared, cid, self.drop):  # (else the stream goes on)
                shared.send_joined(shared.flow.ready(cid, *successor.position(shared.config, msg["resume"])))
        elif kind is Kind.BYE:
            self.drop(cid, "left", said=msg["epoch_done"])
        elif kind is Kind.MODIFIED:
            report_modified(shared, cid, peer, msg)
        else:
            raise ProtocolError(f"a consumer may not send {kind.value} messages")

    def _hello(self, cid: bytes, msg: dict[str, Any], now: float) -> None:
        shared, config = self.shared, self.shared.config
        if successor.holding(shared):  # (answered once the loader is there, in turn)
            return successor.hold(shared, cid, msg)
        if cid in shared.peers:
            if shared.peers[cid].pid == msg["pid"]:
                return  # its HELLO again, sent at a new handshake while the first was queued: welcomed
            raise ProtocolError("HELLO from a consumer that already joined")
        local = same_host(msg["boot_id"], msg["pidns"])
        transport = shared.store.admit(msg, local)
        peer = Peer(
            msg["label"], msg["pid"], float(msg["timeout"]), local, now, now, msg["device"], msg["batch_size"],
            transport=transport, check_writes=msg["check_writes"],
        )  # fmt: skip
        member = None
        if msg["group"] is not None:
            group, rank, size, tail = msg["group"]
            member = Membership(group, rank, size, Tail(tail))
        try:
            # A group member starts with its group once every rank is READY (began iterating:
            # after any load_state_dict, whatever order the trainers start in).
            at, rejoined = successor.position(config, msg["resume"])
            had = successor.had(config, msg["resume"], None if member is None else member.size)
            policy = LateJoin(msg["late_join"])
            check_group_fits(shared, member, policy)
            actions = shared.flow.join(
                cid, msg["prefetch"], policy, member, at, member is None, rejoined, had
            )
        except ValueError as exc:  # a group member that conflicts with the others
            log.warning("refused %s: %s", peer.describe(), exc)
            shared.post(cid, protocol.encode(Kind.ERROR, reason=str(exc)))
            return
        shared.peers[cid] = peer
        if shared.first_join is None:
            shared.first_join = now
        welcome = protocol.encode(
            Kind.WELCOME, pid=os.getpid(), boot_id=boot_id(), pidns=pid_namespace(),
            batches=config.batches_per_epoch, samples=config.samples_per_epoch, slots=config.slots,
            stragglers=config.stragglers, transport=transport,
            gpu=shared.store.gpu if transport == shared.store.kind else None,
            arenas=[d for d in shared.store.describe() if d[0] == transport],
            heartbeat=heartbeat_every(peer.timeout), stream=config.stream, restarted=config.restarted,
            layouts=shared.layouts.entries, session=self.sessions.offer(cid), starts_with=shared.starts_with,
        )  # fmt: skip
        shared.post(cid, welcome)
        shared.send_joined(actions)
        state = shared.flow.consumers[cid]
        if state.forming:
            assert state.group is not None
            where = f"waits for the rest of group {state.group.name!r} ({len(state.group.members)} of {state.group.size} ranks joined)"
        elif state.cursor is None:
            where = "waits for the next epoch"
        else:
            where = f"starts {shared.flow.lag(cid)} batches behind"
        if state.group is not None:
            where = f"is rank {state.rank} of group {state.group.name!r}; it {where}"
        came = "rejoined" if rejoined else "joined"
        log.info("%s %s (%d connected); it %s", peer.describe(), came, len(shared.peers), where)

    def drop(self, cid: Hashable, why: str, evicted: str | None = None, said: Said = UNSAID) -> None:
        """Forget ``cid`` (lock held; any thread); ``evicted``: tell it so, and why, first;
        ``said``: how far it read, if its BYE said (:meth:`Flow.leave`)."""
        shared = self.shared
        if evicted is not None:
            shared.post(cid, protocol.encode(Kind.EVICTED, reason=evicted))
        peer = shared.peers.pop(cid, None)
        state = shared.flow.consumers.get(cid)
        if peer is not None and state is not None and state.group is not None:
            shared.departed[cid] = f"{peer.describe()} {why}"  # named in its group's GROUP_BROKEN
            if len(shared.departed) > 256:  # the last few are enough
                shared.departed.popitem(last=False)
        shared.send_all(shared.flow.leave(cid, said))
        self.sessions.forget(cid)
        if peer is not None:
            log.info("%s %s (%d connected)", peer.describe(), why, len(shared.peers))

    def _check_peers(self, now: float) -> None:
        shared = self.shared
        with shared.changed:
            if successor.holding(shared):
                successor.serve_held(shared, now, self._hello, self._bad)
            for cid, peer in list(shared.peers.items()):
                if peer.local and not pid_alive(peer.pid):
                    self.drop(cid, "died; evicted")
                elif now - peer.last_seen > peer.timeout:
                    reason = f"evicted after {peer.timeout:g} s without a message"
                    self.drop(cid, f"was silent for {now - peer.last_seen:.1f} s; evicted", reason)
                elif now - peer.last_sent > heartbeat_every(peer.timeout):
                    shared.post(cid, protocol.encode(Kind.HEARTBEAT))
            if shared.tracker is not None and shared.tracker.catch_up_due(now):
                shared.tracker.save(*shared.restart_where())
            shared.notify()


def _from_unknown(shared: Shared, cid: bytes, kind: Kind) -> None:
    """A message (not HELLO or STATUS) from a consumer that is not joined (lock held)."""
    if kind is Kind.BYE:
        shared.held.pop(cid, None)  # (one that gave up waiting for its WELCOME)
    elif shared.config.succeeds and kind in ROUTINE and cid not in shared.departed:
        # Our predecessor's consumer, its connection re-made to us by ZeroMQ before it noticed
        # the restart (in another PID namespace it cannot watch the pid, only our silence): it
        # rejoins with a HELLO once it does. An EVICTED would end its stream.
        pass
    else:
        reason = "unknown consumer: it was evicted or never joined"
        shared.post(cid, protocol.encode(Kind.EVICTED, reason=reason))


def _cut_off_unread(io: IoLoop, full: list[Hashable]) -> None:
    """Peers whose queue is full read none of the last QUEUE_PER_PEER messages they were sent.
    A consumer is evicted (what it is sent next would be lost: it cannot be served exactly);
    anyone else's replies are dropped (a flood it never reads costs bounded memory)."""
    if not full:
        return
    shared = io.shared
    with shared.changed:
        before = shared.stats["dropped_replies"]
        count = shared.stats["dropped_replies"] = before + len(full)
        for cid in dict.fromkeys(full):
            if cid in shared.peers:
                reason = f"it read none of the last {QUEUE_PER_PEER} messages it was sent"
                io.drop(cid, f"evicted: {reason}", reason)
            if before < 20 or before // 1000 != count // 1000:  # (rate-limited: a flood would flood the log)
                log.warning("dropped messages to %r: it reads nothing (%d dropped so far)", cid, count)


def _repoll(poller: zmq.Poller, polled: dict[int, int], wanted: dict[int, int]) -> dict[int, int]:
    """Bring ``poller``'s session descriptors from ``polled`` to ``wanted`` (fd: events)."""
    if wanted != polled:
        for fd in polled.keys() - wanted.keys():
            poller.unregister(fd)
        for fd, flags in wanted.items():
            if polled.get(fd) != flags:
                poller.register(fd, flags)
    return wanted


def _turn_left_ms(shared: Shared) -> int:
    """How long the publishing thread's turn lasts yet: the I/O thread, having left a message
    to it, polls no longer than that (it may not come back to read it: a slow loader)."""
    left = shared.publisher_at + HANDOVER - time.monotonic()
    return min(TICK_MS, max(0, int(left * 1000) + 1))
