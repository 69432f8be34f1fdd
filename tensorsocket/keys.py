"""CURVE keys for a producer bound beyond this machine (DESIGN: "CURVE keys for non-loopback
tcp"). There, other hosts may reach its port; with CURVE, ZeroMQ encrypts every connection and
the producer admits only clients holding the key folder, so nobody else can join, ask its
status or hold the stream up.

One folder holds two key pairs, as pyzmq's ``zmq.auth`` writes them: ``producer.key`` /
``producer.key_secret`` and ``consumer.key`` / ``consumer.key_secret``. The producer serves
with its own pair and admits a client whose public key has a ``*.key`` file in the folder
(pyzmq's ZAP authenticator, in a ZeroMQ context of the producer's own: ZAP is one handler a
context); a client connects with the consumer pair and the producer's public key. The folder is
``TENSORSOCKET_KEYS``, else ``$XDG_CONFIG_HOME/tensorsocket/keys`` (``~/.config/...``); a
producer bound beyond loopback makes it (0700) the first time. A consumer in another container
gets a copy of it.

Which connections: a tcp endpoint whose host is not a loopback address
(:func:`.endpoint.beyond_this_machine`), the same rule on both sides, from the endpoint each
is given: a consumer given the producer's ``tcp://*:5555`` (or the host's address, from a
container) uses CURVE, one given ``tcp://127.0.0.1:5555`` does not, and is refused there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .endpoint import beyond_this_machine
from .errors import KeysError

ENV = "TENSORSOCKET_KEYS"
_PRODUCER, _CONSUMER = "producer", "consumer"


def folder() -> Path:
    """Where the keys are: ``TENSORSOCKET_KEYS``, else the user's config folder."""
    given = os.environ.get(ENV)
    if given:
        return Path(given)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "tensorsocket" / "keys"


def ensure(where: Path) -> None:
    """Make the folder (0700) and whichever key pair it lacks."""
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in (_PRODUCER, _CONSUMER):
        if not (where / f"{name}.key_secret").is_file():
            zmq.auth.create_certificates(where, name)


def _load(where: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = where / (f"{name}.key_secret" if secret else f"{name}.key")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(
            f"no usable CURVE key {path} ({exc}): a tcp endpoint beyond loopback needs the producer's key "
            f"folder; copy it from the producer's machine (where it made it) and set {ENV} to the copy"
        ) from None
    if secret and private is None:
        raise KeysError(f"{path} holds no secret key: copy the producer's key folder again")
    return public, private


class Guard:
    """A producer socket's CURVE server side: its own ZeroMQ context with the ZAP handler that
    admits the folder's clients. :meth:`close` after the socket is closed."""

    def __init__(self, where: Path) -> None:
        ensure(where)
        self.public, self.secret = _load(where, _PRODUCER, secret=True)
        self.context = zmq.Context()
        self.auth = ThreadAuthenticator(self.context)
        try:
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(where))
        except BaseException:
            self.close()
            raise

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.secret, self.public, True
        return sock

    def close(self) -> None:
        self.auth.stop()
        self.context.term()


def server_socket(endpoint: str, kind: int) -> tuple[zmq.Socket, Callable[[], None]]:
    """A socket to bind ``endpoint`` with, and what to call once it is closed: a CURVE server
    in a context of its own where the endpoint is beyond loopback (KeysError if the folder's
    keys cannot be read), else a plain one from the shared context."""
    if not beyond_this_machine(endpoint):
        return zmq.Context.instance().socket(kind), _nothing
    guard = Guard(folder())
    return guard.socket(kind), guard.close


def _nothing() -> None:
    pass


def secure_client(sock: zmq.Socket, endpoint: str) -> bool:
    """Make ``sock`` a CURVE client if ``endpoint`` (as given, before
    :func:`.endpoint.connect_address`) is beyond loopback; whether it did. KeysError if the
    folder's keys are missing."""
    if not beyond_this_machine(endpoint):
        return False
    where = folder()
    server, _ = _load(where, _PRODUCER, secret=False)
    public, secret = _load(where, _CONSUMER, secret=True)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server, public, secret
    return True


#: The monitor events of a failed handshake (a client's or the producer's keys do not match,
#: or one side uses CURVE and the other does not).
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def handshake_failure(endpoint: str, event: dict[str, Any], times: int) -> str:
    """What a client says when its handshake with the producer at ``endpoint`` failed
    (``event``, the last of ``times`` in a row)."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = "the producer refused this client's CURVE key"
    else:
        why = f"the ZeroMQ handshake failed ({zmq.Event(event['event']).name}, {times} time(s) in a row)"
    if beyond_this_machine(endpoint):
        hint = (
            f"this client used CURVE with the keys in {folder()}, which must be a copy of the producer's key "
            f"folder (set {ENV} to it); or the producer does not use CURVE (it is bound to loopback)"
        )
    else:
        hint = (
            "this client did not use CURVE, as the endpoint is a loopback address, and a producer bound beyond "
            "loopback (tcp://*:PORT, say) requires it: connect with the endpoint it bound, or the host's address"
        )
    return f"cannot join the producer at {endpoint}: {why}; {hint}"
