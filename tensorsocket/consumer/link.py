"""The consumer's link to its producer: the DEALER socket it joined through and, once the
producer says SWITCHED, the session connection of its own (see :mod:`tensorsocket.session`).
The loop above sees frames in, frames out, and whether the connection closed. One thread at a
time uses it (``Shared.link_lock``); only the I/O thread changes what its poller watches."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from .. import protocol, session
from ..protocol import Kind

log = logging.getLogger("tensorsocket")

ERR = int(zmq.POLLERR)  # (a closed connection's hang-up reads as an error in zmq_poll)


class Link:
    def __init__(
        self, socket: zmq.Socket, poller: zmq.Poller, large_within: float, stop: threading.Event
    ) -> None:
        self.socket, self.poller, self.stop = socket, poller, stop
        self.large_within = large_within  # seconds a LARGE's frame may lag behind it
        poller.register(socket, zmq.POLLIN)
        self.conn: session.Connection | None = None  # connected, SESSION sent
        self.switched = False  # SWITCHED came: everything goes over ``conn`` now
        self.closed = False  # ``conn`` closed under us: the producer died or cut us off
        self._polled = 0  # the events ``conn`` is polled for

    def open_session(self, welcome: dict[str, Any], local: bool) -> None:
        """Connect to the session the WELCOME offers (a producer on this host), and say whose
        it is; without one, or unreachable from here, everything stays on ZeroMQ."""
        offer = welcome["session"]
        if offer is None or not local:
            return
        try:
            conn = session.connect(offer[0])
        except OSError as exc:
            log.info("no session connection to the producer (%s): its messages stay on ZeroMQ", exc)
            return
        conn.send(protocol.encode(Kind.SESSION, token=offer[1]))
        self.conn = conn

    def readable(self, events: dict[Any, int]) -> bool:
        if self.switched:
            assert self.conn is not None
            ready = events.get(self.conn.fd, 0)
            if ready and self.conn.pending:  # room to send, or an error that says there is none
                self.conn.flush()
            return bool(ready & session.IN_ERR)
        return self.socket in events

    def recv(self) -> bytes | None:
        """The next message from the producer, None if none is waiting (or the connection
        closed: :attr:`closed`)."""
        if not self.switched:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if frame != session.SWITCHED or self.conn is None:
                return frame
            self.switched = True  # ZeroMQ said all it will: the rest comes over the connection
            self.poller.unregister(self.socket)
            self.watch(reading=True)
        assert self.conn is not None
        # At most a datagram: the producer sends anything larger over ZeroMQ (LARGE, below).
        # (Python allocates the whole limit for a recvmsg: in a bare process, 16 MiB made a
        # receive cost ~20 us instead of ~4 us while malloc served that with mmap.)
        frame = self.conn.recv(session.MAX_DATAGRAM)
        if frame == session.LARGE:  # too large for a datagram: its bytes came over ZeroMQ
            deadline = time.monotonic() + self.large_within
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.socket.poll(50):
                    return self.socket.recv()
            log.warning("a large message announced on the session never came: the producer is gone or broken")
            frame = b""  # as if the session closed: the producer is lost
        if frame == b"":
            self.closed = True  # (the I/O thread stops polling it at its next watch())
            return None
        return frame

    def send(self, frame: bytes) -> None:
        """Send ``frame`` (never blocks; to a producer that is gone it is dropped)."""
        if self.switched:
            assert self.conn is not None
            self.conn.send(frame)  # (if it waits in ``pending``, the I/O thread's watch() sees it)
            return
        try:
            self.socket.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no producer connected any more: nobody to tell

    def watch(self, reading: bool) -> None:
        """(I/O thread) Poll the session for messages while this thread reads them, else only
        for its end (the producer closed it: it evicted us, or it is gone, so what it said last
        is read at once, not at our next tick); for room to send while sends wait; not once it
        closed."""
        if not self.switched:
            return
        assert self.conn is not None
        want = (
            0 if self.closed else (session.IN if reading else ERR) | (session.OUT if self.conn.pending else 0)
        )
        if want != self._polled:
            if want:
                self.poller.register(self.conn.fd, want)
            else:
                self.poller.unregister(self.conn.fd)
            self._polled = want

    def renewed(self, socket: zmq.Socket) -> Link:
        """This link closed, and a new one over ``socket`` (joining a successor)."""
        self.close(linger_ms=0)
        return Link(socket, self.poller, self.large_within, self.stop)

    def close(self, linger_ms: int) -> None:
        """Close the socket and the session (again: nothing)."""
        if self.socket.closed:
            return
        self.closed = True  # (the caller's thread reads a link only while it is open)
        if not self.switched:
            self.poller.unregister(self.socket)
        elif self._polled:
            self.poller.unregister(self.conn.fd)  # type: ignore[union-attr]
            self._polled = 0
        if self.conn is not None:
            self.conn.flush()
            self.conn.close()
        self.socket.close(linger=linger_ms)
