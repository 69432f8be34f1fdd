"""The producer's ROUTER socket, bound: where consumers' HELLOs and status queries arrive. A
CURVE server where the endpoint is beyond loopback (:mod:`tensorsocket.keys`)."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from .. import endpoint as endpoints
from .. import keys, protocol
from .sessions import QUEUE_PER_PEER


def listen(endpoint: str) -> tuple[zmq.Socket, str, Callable[[], None]]:
    """The socket bound to ``endpoint``, the endpoint bound (a tcp ``:*`` resolved to its
    port), and what to call once the socket is closed. RuntimeError naming the endpoint if it
    cannot be bound; KeysError if it needs keys that cannot be read or made."""
    socket, unguard = keys.server_socket(endpoint, zmq.ROUTER)
    try:
        socket.setsockopt(zmq.LINGER, 500)
        socket.setsockopt(zmq.SNDHWM, QUEUE_PER_PEER)  # (a consumer's: credits bound what is queued)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, so it is never dropped unseen
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REQUEST_BYTES)
        socket.setsockopt(zmq.IPV6, endpoints.ipv6(endpoint))  # ([::] takes IPv4 too)
        if endpoint.startswith("tcp://") and endpoint.endswith(":*"):
            port = socket.bind_to_random_port(endpoint[: -len(":*")])
            endpoint = f"{endpoint[:-2]}:{port}"
        else:
            socket.bind(endpoint)
    except BaseException as exc:
        socket.close(0)
        unguard()
        if isinstance(exc, zmq.ZMQError):
            raise RuntimeError(f"cannot bind {endpoint}: {exc}") from None
        raise
    return socket, endpoint, unguard
