"""Joining a producer: a DEALER socket with a fresh identity, the HELLO / WELCOME exchange
(at a position, for a restored or rejoining consumer), and the reader for the transport the
WELCOME names. Used by the I/O thread when it starts and when it rejoins a successor."""

from __future__ import annotations

import logging
import os
import queue
import time
import uuid
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import endpoint as endpoints
from .. import keys, protocol
from ..errors import ProducerLost, ProtocolError, Refused
from ..host import boot_id, pid_namespace
from ..protocol import Kind
from ..transport import Reader, open_reader
from .shared import Settings, Shared

log = logging.getLogger("tensorsocket")

_STOP_CHECK = 0.05  # seconds between checks for close() while waiting for WELCOME
READER_SETUP_S = 120.0  # beyond the handshake's timeout: a first CUDA context can take a while


def connect(settings: Settings) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER socket with a fresh identity, connecting (zmq retries until a producer binds),
    and the monitor that tells join() of each handshake with a producer (made first, so that
    it sees the first one), or of each that failed. A CURVE client where the endpoint is beyond
    loopback (:mod:`tensorsocket.keys`), with the keys read at construction."""
    identity = uuid.uuid4()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    # (a name of its own: pyzmq's default is named by the socket's fd, which a later socket
    # reuses, and an inproc name is unbound by ZeroMQ's reaper thread, later than close())
    monitor = socket.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | keys.HANDSHAKE_FAILED, f"inproc://hello-{identity.hex}"
    )
    socket.setsockopt(zmq.ROUTING_ID, identity.bytes)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_BYTES)
    keys.connect(socket, settings.endpoint, settings.curve_keys)
    return socket, monitor


def open_reader_for(welcome: dict[str, Any], settings: Settings) -> Reader:
    """The reader of the transport the WELCOME names, with the arenas it announced."""
    reader = open_reader(
        welcome["transport"], welcome["gpu"], settings.device, settings.stream, settings.check_writes
    )
    for arena in welcome["arenas"]:
        reader.announce(arena)
    return reader


def join(
    socket: zmq.Socket,
    monitor: zmq.Socket,
    settings: Settings,
    resume: list[Any] | None,
    wait: float,
    shared: Shared,
) -> dict[str, Any]:
    """Send HELLO (at ``resume``, if any) and return the WELCOME, waiting up to ``wait``
    seconds (a rejoin waits for a successor to bind; close() ends the wait). Closes the
    ``monitor`` that connect() made.

    The HELLO goes out at each ZeroMQ handshake with a producer, not once: one written to a
    successor that was killed before it answered is lost with it, and the next successor
    must get its own (a producer ignores a HELLO repeated by a consumer it has welcomed)."""
    hello = protocol.encode(
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
        resume=resume,
        check_writes=settings.check_writes,
    )
    try:
        return _welcome(socket, monitor, hello, settings, wait, shared)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def _welcome(
    socket: zmq.Socket, monitor: zmq.Socket, hello: bytes, settings: Settings, wait: float, shared: Shared
) -> dict[str, Any]:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + wait
    # Past the deadline, one more slice before giving up: a process frozen across it (SIGSTOP,
    # a debugger) must first let its ZeroMQ I/O thread deliver a WELCOME already sent.
    overdue, preparing, failed = False, False, 0
    while True:
        slice_s = _STOP_CHECK if overdue else min(_STOP_CHECK, max(0.0, deadline - time.monotonic()))
        ready = dict(poller.poll(int(slice_s * 1000)))
        if monitor in ready:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # (a new producer, after the first)
                socket.send(hello)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # A wrong producer key shows only so, and so does a connection cut mid-handshake,
                # as when a producer is killed (a restart's consumers see several): said at the end
                failed += 1
            else:  # our CURVE key refused by its ZAP handler, or CURVE on one side only
                raise Refused(keys.refusal(settings.endpoint, settings.key_folder, event))
            continue
        if socket in ready:
            kind, msg = protocol.decode(socket.recv(), protocol.MAX_REPLY_BYTES)
            if kind is not Kind.HEARTBEAT:
                break
            # A successor holds our HELLO while it brings its loader to the restart point
            # (producer/successor.py): it lives, so we wait on, up to `timeout` past each beat.
            if not preparing:
                log.info(
                    "the producer at %s is preparing its stream (a restart); waiting for it",
                    settings.endpoint,
                )
            preparing, overdue = True, False
            deadline = shared.join_deadline = max(deadline, time.monotonic() + settings.timeout)
            continue
        shared.io_tick = time.monotonic()  # turning, not frozen (see Batches.catch_up_after_freeze)
        if overdue or shared.stop.is_set():
            silent = f"went silent for {settings.timeout:g} s while it prepared its stream"
            raise ProducerLost(
                (
                    (f"the producer at {settings.endpoint} {silent}" if preparing else None)
                    or endpoints.silent_holder(settings.endpoint, wait)
                    or f"no producer answered at {settings.endpoint} within {wait:g} s; start one with "
                    "Producer(loader, name=...) or check the name / endpoint"
                )
                + _failed_with_keys(settings, failed)
            )
        overdue = time.monotonic() >= deadline
    if kind is Kind.WELCOME:
        return msg
    if kind in (Kind.ERROR, Kind.EVICTED):
        raise Refused(f"the producer at {settings.endpoint} refused to serve us: {msg['reason']}")
    raise ProtocolError(f"expected WELCOME from {settings.endpoint}, got {kind.value}")


def _failed_with_keys(settings: Settings, failed: int) -> str:
    """What a CURVE client adds when it gave up after handshakes failed without detail: a
    producer key that does not match the producer's shows only so."""
    if not failed or settings.key_folder is None:
        return ""
    return (
        f"; {failed} handshake(s) with a producer there failed without detail, as they do when this client's "
        f"producer.key (in {settings.key_folder}) is not the producer's: copy it from the producer's key folder"
    )


def outcome(results: queue.SimpleQueue[Any], shared: Shared, timeout: float, endpoint: str) -> Any:
    """What the I/O thread's join gave (WELCOME, reader, state; or the error), waited for as
    long as its handshake may take: ``timeout``, or up to a preparing successor's last
    heartbeat and ``timeout`` (``shared.join_deadline``); then opening a GPU reader may take
    a CUDA init more."""
    started = time.monotonic()
    while True:
        bound = max(started + timeout, shared.join_deadline or 0.0) + READER_SETUP_S
        try:
            return results.get(timeout=max(0.0, min(1.0, bound - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= bound:
                shared.stop.set()
                return ProducerLost(f"joining {endpoint} took over {time.monotonic() - started:.0f} s")
