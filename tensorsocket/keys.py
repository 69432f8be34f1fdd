"""CURVE keys for a producer bound beyond this machine (DESIGN: "CURVE keys for non-loopback
tcp"). There, other hosts may reach its port; with CURVE, ZeroMQ encrypts every connection and
the producer admits only clients holding the key folder's consumer key, so nobody else can
join, ask its status or hold the stream up.

One folder holds two key pairs, as pyzmq's ``zmq.auth`` writes them: ``producer.key`` /
``producer.key_secret`` and ``consumer.key`` / ``consumer.key_secret``. The producer serves
with its own pair and admits a client whose public key has a ``*.key`` file in the folder
(pyzmq's ZAP authenticator, in a ZeroMQ context of the producer's own: ZAP is one handler a
context); a client connects with the consumer pair and the producer's public key, so it needs
``producer.key``, ``consumer.key`` and ``consumer.key_secret`` (not the producer's secret). The
folder is ``TENSORSOCKET_KEYS``, else ``$XDG_CONFIG_HOME/tensorsocket/keys``
(``~/.config/...``), read once by each producer and consumer; a producer bound beyond loopback
makes it (0700, secrets 0600) the first time, and refuses one that others may read or write.

Which connections: a tcp endpoint whose host is not a loopback address
(:func:`.endpoint.beyond_this_machine`), the same rule on both sides, from the endpoint each
is given: a consumer given the producer's ``tcp://*:5555`` (or the host's address, from a
container) uses CURVE, one given ``tcp://127.0.0.1:5555`` does not, and is refused there.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .endpoint import beyond_this_machine, connect_address, ipv6, private_folder
from .errors import KeysError

log = logging.getLogger("tensorsocket")

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
    """Make the folder (0700) and whichever key pair it has neither file of, secrets 0600; under
    a lock, so producers starting together make one set. KeysError for a folder others may read
    or write (they could read the secrets, or add a key the producer would admit)."""
    try:
        private_folder(where, f"or set {ENV} to a private folder")
    except PermissionError as exc:
        raise KeysError(f"the CURVE key folder {exc}") from None
    with _locked(where / ".lock"):
        for name in (_PRODUCER, _CONSUMER):
            if not any((where / f"{name}{suffix}").exists() for suffix in (".key", ".key_secret")):
                _, secret = zmq.auth.create_certificates(where, name)
                os.chmod(secret, 0o600)  # (written as the umask says; the folder's 0700 kept it meanwhile)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (held for the few ms two key pairs take to write)
        yield
    finally:
        os.close(fd)


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
        self.where = where
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
        """Stop the ZAP thread and end the context, dropping what any socket left open on it
        still holds (``destroy``: a plain ``term`` would wait for such a socket for ever)."""
        self.auth.stop()
        self.context.destroy(linger=0)


def server_socket(endpoint: str, kind: int) -> tuple[zmq.Socket, Callable[[], None]]:
    """A socket to bind ``endpoint`` with, and what to call once it is closed: a CURVE server
    in a context of its own where the endpoint is beyond loopback (KeysError if the folder's
    keys cannot be read or made), else a plain one from the shared context."""
    if not beyond_this_machine(endpoint):
        return zmq.Context.instance().socket(kind), _nothing
    guard = Guard(folder())
    log.info(
        "%s listens beyond this machine: only clients with the CURVE keys in %s may connect (give a consumer "
        "in another container a copy of producer.key, consumer.key and consumer.key_secret, and "
        "TENSORSOCKET_KEYS=<the copy>)",
        endpoint,
        guard.where,
    )
    try:
        return guard.socket(kind), guard.close
    except BaseException:
        guard.close()
        raise


def _nothing() -> None:
    pass


def client_keys(where: Path | None) -> tuple[bytes, bytes, bytes] | None:
    """A client's (producer public, consumer public, consumer secret) keys from ``where``, or None
    for a plain client (None given: the endpoint is on loopback). KeysError if they are missing,
    or if others may read the secret (only its mode is checked: a copy in a container may
    belong to another uid)."""
    if where is None:
        return None
    server, _ = _load(where, _PRODUCER, secret=False)
    public, secret = _load(where, _CONSUMER, secret=True)
    assert secret is not None  # (_load checked it)
    path = where / f"{_CONSUMER}.key_secret"
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:  # (as ssh refuses an unprotected private key)
        raise KeysError(
            f"{path} may be read or written by other users (mode {oct(mode)}): whoever reads it can join "
            f"the producer as a consumer; chmod 600 {path}"
        )
    return server, public, secret


def client_folder(endpoint: str) -> Path | None:
    """The key folder a client of ``endpoint`` (as given, before
    :func:`.endpoint.connect_address`) uses, or None where it connects in the clear."""
    return folder() if beyond_this_machine(endpoint) else None


def connect(sock: zmq.Socket, endpoint: str, keys: tuple[bytes, bytes, bytes] | None) -> None:
    """Connect a client's socket to the producer at ``endpoint`` (as given): a CURVE client
    with ``keys`` (:func:`client_keys`; None: in the clear), IPv6 where the address is one."""
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.setsockopt(zmq.IPV6, ipv6(endpoint))
    sock.connect(connect_address(endpoint))


def refusal(endpoint: str, where: Path | None, event: int) -> str:
    """What a client (with the keys in ``where``; None: a plain one) says when its handshake with
    the producer at ``endpoint`` ended in ``event``: its CURVE key refused by the producer's ZAP
    handler, or CURVE on one side only."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = f"the producer at {endpoint} refused this client's CURVE key"
    else:
        why = f"the ZeroMQ handshake with the producer at {endpoint} failed ({zmq.Event(event).name})"
    if where is not None:
        hint = (
            f"this client used CURVE with the keys in {where}, which must come from the producer's key folder "
            f"(set {ENV} to them); or the producer does not use CURVE (it is bound to loopback)"
        )
    else:
        hint = (
            "this client did not use CURVE, as the endpoint is a loopback address, and a producer bound beyond "
            "loopback (tcp://*:PORT, say) requires it: connect with the endpoint it bound, or the host's address"
        )
    return f"{why}; {hint}"


#: The monitor events of a failed handshake (a client's or the producer's keys do not match,
#: or one side uses CURVE and the other does not).
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
HANDSHAKE_FAILED = sum(HANDSHAKE_FAILED_EVENTS)  # (the monitor's mask)
#: Those that say for sure the client is refused (the others may be a producer killed mid-handshake)
HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
