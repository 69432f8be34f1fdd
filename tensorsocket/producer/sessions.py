"""The producer's side of consumers' sessions (see :mod:`tensorsocket.session`): the listener,
connections waiting for their SESSION message, and the connection each consumer moved to.
The I/O thread polls :meth:`Sessions.fds` with its socket, accepts, binds and closes; a
consumer's connection is read under the producer's lock, by the I/O thread or, in its turn
(:mod:`.session_turns`), by the caller's thread, which leaves what it does not apply in
:attr:`Sessions.stashed` for the I/O thread."""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Hashable

import zmq

from .. import protocol, session
from ..errors import ProtocolError
from ..protocol import Kind

log = logging.getLogger("tensorsocket")

_BIND_WITHIN = 10.0  # seconds a connection may take to say whose it is
_MAX_UNBOUND = 64  # connections at once that have not said whose they are; more are closed
_ACCEPT_PAUSE = 1.0  # seconds the listener is not polled after accept() failed (out of descriptors)
#: Messages queued for a ZeroMQ peer that reads none of them, at most (its SNDHWM): a STATUS
#: flood never read would grow the producer without bound. A consumer's are far fewer: batches
#: wait for its credits, and a heartbeat a second takes hours to fill it (it is evicted then).
QUEUE_PER_PEER = 10_000


class Sessions:
    def __init__(self) -> None:
        self.listener, self.address = None, None
        if session.offered():
            try:
                self.listener, self.address = session.listen()
            except OSError as exc:
                log.warning("no sessions (%s): every consumer's messages go over ZeroMQ", exc)
        self._tokens: dict[str, Hashable] = {}  # offered in a WELCOME, not yet used
        self._left: collections.deque[str] = collections.deque(maxlen=64)  # theirs left unused
        self._unbound: dict[int, tuple[session.Connection, float]] = {}  # by fd: and its deadline
        self._accept_from = 0.0  # (monotonic) when the listener is polled again after a failure
        self.by_cid: dict[Hashable, session.Connection] = {}
        self.cid_of: dict[int, Hashable] = {}  # by fd
        # by fd: frames the caller's thread read but left to the I/O thread, read first (b"": closed)
        self.stashed: dict[int, list[bytes]] = {}
        # moves when the connections or their stashes change (the caller's thread polls them)
        self.version = 0

    def offer(self, cid: Hashable) -> list[str] | None:
        """WELCOME's ``session`` for ``cid``: the address and a fresh token, or None."""
        if self.address is None:
            return None
        token = session.token()
        self._tokens[token] = cid
        return [self.address, token]

    def fds(self, reading: bool) -> dict[int, int]:
        """Every descriptor to poll, with its events (POLLOUT where sends wait); consumers'
        connections are polled for their messages only when ``reading`` (not the caller's turn)."""
        listening = self.listener is not None and time.monotonic() >= self._accept_from
        out = {self.listener.fileno(): session.IN} if listening else {}  # type: ignore[union-attr]
        out.update((fd, session.IN) for fd in self._unbound)
        wanted = session.IN if reading else 0
        for conn in self.by_cid.values():
            events = wanted | session.OUT if conn.pending else wanted
            if events:
                out[conn.fd] = events
        return out

    def accept(self) -> None:
        """Take new connections: only from this user's processes, and a bounded number at a
        time (a consumer refused here stays on ZeroMQ: it never gets SWITCHED)."""
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: poll it again a little later
                log.warning("could not accept a consumer's session connection: %s", exc)
                self._accept_from = time.monotonic() + _ACCEPT_PAUSE
                return
            try:
                mine = session.peer_uid(sock) == os.getuid()
            except OSError:
                mine = False
            if not mine or len(self._unbound) >= _MAX_UNBOUND:
                sock.close()
                continue
            conn = session.Connection(sock)
            self._unbound[conn.fd] = (conn, time.monotonic() + _BIND_WITHIN)

    def bind(self, fd: int, peers: dict[Hashable, object]) -> tuple[Hashable, session.Connection] | None:
        """Read a new connection's SESSION message: the consumer it speaks for and the
        connection, to :meth:`switch` once what was queued for it went; or None (nothing
        yet; or refused: closed)."""
        conn, _ = self._unbound[fd]
        frame = conn.recv(protocol.MAX_REQUEST_BYTES)
        if frame is None:
            return None
        del self._unbound[fd]
        token = None
        try:
            kind, msg = protocol.decode(frame) if frame else (None, {})
            token = msg["token"] if kind is Kind.SESSION else None
        except ProtocolError:
            pass
        cid = self._tokens.pop(token, None) if token is not None else None
        if cid is None or cid not in peers or cid in self.by_cid:
            # (a consumer that left at once, before its session was read, is no intruder)
            left = (cid is not None and cid not in peers) or token in self._left
            log.log(
                logging.DEBUG if left else logging.WARNING,
                "closed a session connection that did not present a valid token%s",
                " (its consumer had left)" if left else "",
            )
            conn.close()
            return None
        return cid, conn

    def switch(
        self,
        socket: zmq.Socket,
        bound: tuple[Hashable, session.Connection],
        queued: list[tuple[Hashable, bytes]],
    ) -> list[Hashable]:
        """Move ``bound``'s consumer to its connection (lock held): what is ``queued`` for
        ZeroMQ goes first, then SWITCHED, the last message it gets there; ``queued`` is left
        empty. The peers whose queue was full, as :func:`send_zmq` says (their messages are
        dropped: the caller evicts them)."""
        cid, conn = bound
        full = send_zmq(socket, [*queued, (cid, session.SWITCHED)])
        queued.clear()
        self.by_cid[cid], self.cid_of[conn.fd] = conn, cid
        self.version += 1
        return full

    def read(self, fd: int, most: int = 1000) -> tuple[list[bytes], bool]:
        """A consumer's messages, those stashed first (at most ``most`` more, so ticks still
        run under a flood), and True if its connection closed (:meth:`drop` it then); lock held."""
        conn = self.by_cid[self.cid_of[fd]]
        frames = self.stashed.pop(fd, [])
        if frames:
            self.version += 1  # (the caller's thread polls it again)
            if frames[-1] == b"":
                return frames[:-1], True
        for _ in range(most):
            frame = conn.recv(protocol.MAX_REQUEST_BYTES)
            if frame is None:
                break
            if not frame:
                return frames, True
            frames.append(frame)
        return frames, False

    def expire(self, now: float) -> None:
        """Close connections that never said whose they are (unused tokens go with their consumer: :meth:`forget`)."""
        for fd, (conn, deadline) in list(self._unbound.items()):
            if now > deadline:
                del self._unbound[fd]
                conn.close()

    def forget(self, cid: Hashable) -> None:
        """``cid`` left: its unused token goes (its connection closes once flushed: :meth:`close_gone`)."""
        for token, owner in list(self._tokens.items()):
            if owner == cid:
                del self._tokens[token]
                self._left.append(token)

    def unbound(self, fd: int) -> bool:
        return fd in self._unbound

    def send(self, socket: zmq.Socket, cid: Hashable, frame: bytes) -> bool:
        """Send ``frame`` over ``cid``'s connection (a large one over ``socket``, with its
        place kept on the connection); False if ``cid`` has none."""
        conn = self.by_cid.get(cid)
        if conn is None:
            return False
        if len(frame) > session.MAX_DATAGRAM:
            if send_zmq(socket, [(cid, frame)]):  # dropped: LARGE would announce bytes that never come
                conn.cut_off(f"its peer read none of the last {QUEUE_PER_PEER} messages sent over ZeroMQ")
                return True
            frame = session.LARGE
        conn.send(frame)
        return True

    def send_now(self, cid: Hashable, frame: bytes) -> bool | None:
        """From any thread, under the producer's lock: send ``frame`` over ``cid``'s session
        if it has one and the frame fits a datagram; None if not (the I/O thread sends it),
        True if it had to wait for room (the I/O thread polls for it), False if sent."""
        conn = self.by_cid.get(cid)
        if conn is None or len(frame) > session.MAX_DATAGRAM:
            return None
        conn.send(frame)
        return bool(conn.pending)

    def close_gone(self, peers: dict[Hashable, object]) -> None:
        """Close the connections of consumers that left, once what was sent to them went. (A
        connection a send failed on stays until its reader sees the end: what the consumer
        sent before closing, its BYE, is still queued there.)"""
        for cid, conn in list(self.by_cid.items()):
            if cid not in peers and (conn.broken or not conn.pending):
                self._close(cid, conn)

    def drop(self, cid: Hashable) -> None:
        conn = self.by_cid.get(cid)
        if conn is not None:
            self._close(cid, conn)

    def _close(self, cid: Hashable, conn: session.Connection) -> None:
        del self.by_cid[cid]
        self.cid_of.pop(conn.fd, None)
        self.stashed.pop(conn.fd, None)
        self.version += 1
        conn.close()

    def close(self) -> None:
        for conn, _ in self._unbound.values():
            conn.close()
        for cid, conn in list(self.by_cid.items()):
            conn.flush()
            self._close(cid, conn)
        self._unbound.clear()
        if self.listener is not None:
            self.listener.close()


def send_zmq(socket: zmq.Socket, frames: list[tuple[Hashable, bytes]]) -> list[Hashable]:
    """Send ``(cid, frame)`` pairs over the ROUTER socket (its I/O thread only); the peers
    whose queue is full (they read none of the last :data:`QUEUE_PER_PEER` messages): what
    they were sent is dropped. So is a message to a peer that disconnected."""
    full = []
    for cid, frame in frames:
        try:
            socket.send_multipart([cid, frame], zmq.NOBLOCK)  # type: ignore[list-item]
        except zmq.Again:
            full.append(cid)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
    return full
