"""A consumer's session with its producer: after the HELLO / WELCOME handshake over ZeroMQ, a
consumer on the producer's host moves every later message to a Unix ``SOCK_SEQPACKET``
connection of its own.

Why: a message through ZeroMQ wakes its I/O thread on both sides, a large part of what a
tiny batch costs on a small VM. Unlike a ZeroMQ socket a connection may be written by more
than one thread, so the producer's publishing thread sends each batch itself
(``benchmarks.protocol_cost`` against its ``zeromq`` variant: the producer's CPU per batch
0.61x with 1 consumer, 0.77x with 4). The kernel keeps message boundaries and order, and a
peer's death closes the connection.

The producer listens on an abstract address (no file to clean up); a connection is bound to
the consumer that received the WELCOME naming its random token, so nobody else can speak for
it. The move, in order:

1. the producer's WELCOME names the address and a token;
2. the consumer connects and sends SESSION(token) on the connection;
3. the producer sends everything queued for it so far over ZeroMQ, then SWITCHED, the last
   message it sends there, and from then on uses the connection;
4. the consumer reads ZeroMQ until SWITCHED, then only the connection.

A consumer that cannot connect (another network namespace) stays on ZeroMQ. A producer's
message too large for one datagram goes over ZeroMQ, with a LARGE placeholder on the
connection where it belongs in the order.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import socket
import struct

import zmq

from . import protocol
from .protocol import Kind

log = logging.getLogger("tensorsocket")

#: Largest message sent as one datagram (a consumer's are all smaller: protocol.MAX_REQUEST_BYTES).
MAX_DATAGRAM = 64 * 1024
#: A connection's poll events for a ``zmq.Poller``, as plain ints: ``zmq.POLLIN`` is an IntFlag,
#: whose ``|`` and ``&`` run Python code (16,800 calls per 5,000 batches in the producer's I/O
#: thread, cProfile; as ints, 0.96x the CPU per batch of all processes together).
IN, OUT = int(zmq.POLLIN), int(zmq.POLLOUT)
IN_OUT, IN_ERR = IN | OUT, IN | int(zmq.POLLERR)
_TRUNC = int(socket.MSG_TRUNC)  # (an IntFlag too)
_BUFFER = 1 << 20  # socket buffer asked for (the kernel caps it at net.core.[rw]mem_max)
#: Bytes a connection keeps for a peer that reads none of them, at most; then it is cut off
#: (both ends see it closed). A frozen consumer's are far fewer: its batches wait for its
#: credits, and its heartbeats are a few dozen bytes a second.
MAX_PENDING_BYTES = 64 << 20
#: The two markers, as both sides send and compare them (byte for byte: they carry no fields).
SWITCHED = protocol.encode(Kind.SWITCHED)
LARGE = protocol.encode(Kind.LARGE)
_ENV = "TENSORSOCKET_SESSION"  # "0": the producer offers no session (everything over ZeroMQ)


def offered() -> bool:
    """Whether a producer offers sessions (``TENSORSOCKET_SESSION=0`` turns them off, to run
    everything over ZeroMQ as a consumer in another network namespace does)."""
    return os.environ.get(_ENV, "1") != "0"


def listen() -> tuple[socket.socket, str]:
    """A non-blocking listener on a fresh abstract address, and the address as WELCOME says it."""
    name = f"tensorsocket-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    listener.setblocking(False)
    return listener, name


def token() -> str:
    return secrets.token_hex(16)


def connect(name: str) -> Connection:
    """Connect to a producer's session address; OSError if it cannot be reached from here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(1.0)
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        raise
    return Connection(sock)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (as the kernel saw it)."""
    _, uid, _ = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return uid


class Connection:
    """One end of a session: non-blocking, in order. A send the kernel cannot take now waits
    in :attr:`pending` (in order) until :meth:`flush`; the owner polls for POLLOUT meanwhile.
    Not locked itself: a consumer's threads use one under its link lock; on the producer both
    threads send and read (the publishing thread in its turn: producer/session_turns), always
    under the producer's lock, and only its I/O thread closes."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, _BUFFER)
            except OSError:
                pass  # the default size works too
        self.sock = sock
        self.fd = sock.fileno()
        self.pending: collections.deque[bytes] = collections.deque()
        self.pending_bytes = 0
        self.broken = False  # the peer is gone, or was cut off: sends are dropped

    def send(self, frame: bytes) -> None:
        if not self.pending:
            try:
                self.sock.send(frame)
                return
            except BlockingIOError:
                pass
            except OSError:
                self.broken = True
                return
        if self.broken:
            return
        self.pending.append(frame)
        self.pending_bytes += len(frame)
        if self.pending_bytes > MAX_PENDING_BYTES:
            self.cut_off(f"its peer read none of the last {self.pending_bytes >> 20} MiB sent to it")

    def cut_off(self, why: str) -> None:
        """The peer reads nothing (``why``): stop keeping what waits for it, and shut the
        connection down so both ends see it closed (the producer's liveness checks then
        evict a consumer that is still alive)."""
        log.warning("cut off a session connection: %s", why)
        self.broken, self.pending_bytes = True, 0
        self.pending.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def flush(self) -> None:
        """Send what waited, as far as the kernel takes it now."""
        while self.pending and not self.broken:
            try:
                self.sock.send(self.pending[0])
            except BlockingIOError:
                return
            except OSError:
                self.broken = True
                return
            self.pending_bytes -= len(self.pending.popleft())
        if self.broken:
            self.pending.clear()
            self.pending_bytes = 0

    def recv(self, limit: int) -> bytes | None:
        """The next message, None if none is waiting; ``b""`` once the peer closed its end (or
        sent something longer than ``limit``: a peer that breaks the protocol is cut off)."""
        try:
            frame, _, flags, _ = self.sock.recvmsg(limit + 1)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            # The peer closed with our messages unread, and the kernel says so before what it
            # sent last (a consumer's BYE): the error is reported once, then the rest comes.
            try:
                frame, _, flags, _ = self.sock.recvmsg(limit + 1)
            except OSError:
                return b""
        except OSError:
            return b""
        if len(frame) > limit or flags & _TRUNC:
            return b""
        return frame

    def close(self) -> None:
        self.sock.close()
