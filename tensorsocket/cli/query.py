"""Ask the producer serving an endpoint for its status, over one zmq round trip (no torch)."""

from __future__ import annotations

import os
import time

from ..status import ProducerStatus, check


class NoProducer(Exception):
    """Nothing answers at the endpoint (the argument)."""


def _ipc_listening(path: str) -> bool:
    """False when nothing can be listening on the ipc socket ``path``: no such file, or a
    file left behind that refuses connections. True otherwise (ask to know for sure)."""
    import socket

    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # something else: let the query decide
    finally:
        probe.close()
    return True


def query_status(endpoint: str, timeout: float) -> ProducerStatus:
    """Send STATUS to the producer at ``endpoint`` and return its status.

    Raises NoProducer when nothing answers within ``timeout`` (at once when the ipc socket
    file does not exist)."""
    import uuid

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from .. import keys, protocol
    from ..errors import KeysError, ProtocolError
    from ..protocol import Kind

    if endpoint.startswith("ipc://") and not _ipc_listening(endpoint[len("ipc://") :]):
        raise NoProducer(endpoint)
    where = keys.client_folder(endpoint)
    try:
        client_keys = keys.client_keys(where)
    except KeysError as exc:
        raise RuntimeError(str(exc)) from None
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    # (a handshake refused for its keys, or for CURVE on one side only, is said at once)
    monitor = sock.get_monitor_socket(keys.HANDSHAKE_REFUSED, f"inproc://status-{uuid.uuid4().hex}")
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_BYTES)
        keys.connect(sock, endpoint, client_keys)
        sock.send(protocol.encode(Kind.STATUS, status=None))
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if monitor in ready:
                raise RuntimeError(keys.refusal(endpoint, where, recv_monitor_message(monitor)["event"]))
            if sock not in ready:
                raise NoProducer(endpoint)
            try:
                kind, msg = protocol.decode(sock.recv(), protocol.MAX_REPLY_BYTES)
            except ProtocolError as exc:
                raise RuntimeError(f"the producer at {endpoint} sent a malformed reply: {exc}") from None
            if kind is Kind.STATUS and isinstance(msg["status"], dict):
                try:
                    return check(msg["status"])
                except ValueError as exc:
                    raise RuntimeError(
                        f"the producer at {endpoint} sent a status this version cannot read: {exc}"
                    ) from None
            if kind in (Kind.ERROR, Kind.EVICTED):
                raise RuntimeError(f"the producer at {endpoint} refused the query: {msg['reason']}")
            # anything else (a heartbeat) is not for us: keep waiting
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
