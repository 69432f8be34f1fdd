"""The consumer's link to its producer: the DEALER socket it joined through and, once the
producer says SWITCHED, the session connection of its own (see :mod:`tensorsocket.session`).
Only the I/O thread uses it; the loop above sees frames in, frames out, and whether the
connection closed."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from .. import protocol, session
from ..protocol import Kind

log = logging.getLogger("tensorsocket")


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
        self._out = False  # ``conn`` is polled for room to send too

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
            if ready & session.OUT:
                self.conn.flush()
                self._watch_out()
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
            self.poller.register(self.conn.fd, zmq.POLLIN)
        assert self.conn is not None
        frame = self.conn.recv(protocol.MAX_REPLY_BYTES)
        if frame == session.LARGE:  # too large for a datagram: its bytes came over ZeroMQ
            deadline = time.monotonic() + self.large_within
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.socket.poll(50):
                    return self.socket.recv()
            log.warning("a large message announced on the session never came: the producer is gone or broken")
            frame = b""  # as if the session closed: the producer is lost
        if frame == b"":
            self.closed = True
            self.poller.unregister(self.conn.fd)
            return None
        return frame

    def send(self, frame: bytes) -> None:
        """Send ``frame`` (never blocks; to a producer that is gone it is dropped)."""
        if self.switched:
            assert self.conn is not None
            self.conn.send(frame)
            self._watch_out()
            return
        try:
            self.socket.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no producer connected any more: nobody to tell

    def _watch_out(self) -> None:
        """Poll the connection for room to send while sends wait, and only then."""
        assert self.conn is not None
        out = bool(self.conn.pending)
        if out != self._out and not self.closed:
            self._out = out
            self.poller.register(self.conn.fd, session.IN_OUT if out else session.IN)

    def renewed(self, socket: zmq.Socket) -> Link:
        """This link closed, and a new one over ``socket`` (joining a successor)."""
        self.close(linger_ms=0)
        return Link(socket, self.poller, self.large_within, self.stop)

    def close(self, linger_ms: int) -> None:
        """Close the socket and the session (again: nothing)."""
        if self.socket.closed:
            return
        if not self.switched:
            self.poller.unregister(self.socket)
        elif not self.closed:
            self.poller.unregister(self.conn.fd)  # type: ignore[union-attr]
        if self.conn is not None:
            self.conn.flush()
            self.conn.close()
        self.socket.close(linger=linger_ms)
