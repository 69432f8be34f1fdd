"""Where producers bind and consumers connect: names, ipc paths, tcp addresses, and the lock
that keeps a second producer from silently taking over a name."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO

from .host import stopped

ENV = "TENSORSOCKET_ENDPOINT"
DEFAULT_NAME = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_IPC_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL
_LOCK_TRIES = 5  # a lock file removed between our open and our flock: open it again
#: The lock files this process holds. An flock belongs to the open file, which a forked child
#: (a DataLoader's worker) shares: after a SIGKILL its children held the name until they noticed
#: (up to torch's 5 s watchdog), and the supervisor's restart was refused, naming the dead pid.
#: A child closes its copies at once (it never serves the name).
_HELD: set[IO[str]] = set()


def _drop_inherited_locks() -> None:
    for held in list(_HELD):
        with contextlib.suppress(OSError):
            held.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def runtime_dir() -> Path:
    """The per-user directory for ipc sockets, created with mode 0700 and checked.

    ``$XDG_RUNTIME_DIR/tensorsocket`` when that is set, else ``<tmp>/tensorsocket-<uid>``.
    A directory owned by someone else or open to others is refused: its sockets could be
    replaced by another user.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        Path(base) / "tensorsocket" if base else Path(tempfile.gettempdir()) / f"tensorsocket-{os.getuid()}"
    )
    return private_folder(path, "remove it or set XDG_RUNTIME_DIR")


def private_folder(path: Path, remedy: str) -> Path:
    """``path``, made with mode 0700 if missing, and checked: a directory (not a link) owned by
    this user and closed to others, who could otherwise read or replace what it holds (sockets,
    keys). PermissionError saying what was found, and ``remedy``."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); {remedy}"
        )
    return path


def resolve(name: str | None = None, endpoint: str | None = None) -> str:
    """Turn ``name`` / ``endpoint`` / ``$TENSORSOCKET_ENDPOINT`` into one zmq endpoint.

    Exactly one of name and endpoint may be given; with neither, the environment variable
    is used (an endpoint, or a name: a value without ``://``), then the name "default".
    Raises ValueError naming what was wrong (and the variable, when the value came from it).
    """
    if name is not None and endpoint is not None:
        raise ValueError("give either name= or endpoint=, not both")
    if name is None and endpoint is None:
        value = os.environ.get(ENV) or None
        if value is None:
            name = DEFAULT_NAME
        else:
            try:
                return resolve(endpoint=value) if "://" in value else resolve(name=value)
            except ValueError as exc:
                raise ValueError(f"${ENV}={value!r}: {exc}") from None
    if name is not None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"name={name!r} must be 1-64 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        path = runtime_dir() / f"{name}.sock"
        if len(str(path)) > _IPC_PATH_MAX:
            raise ValueError(
                f"ipc path {path} is longer than {_IPC_PATH_MAX} bytes; use a shorter name or XDG_RUNTIME_DIR"
            )
        return f"ipc://{path}"
    assert endpoint is not None
    if not isinstance(endpoint, str):
        raise ValueError(
            f"endpoint must be a string like 'ipc:///path' or 'tcp://127.0.0.1:5555', got {endpoint!r}"
        )
    if endpoint.startswith("ipc://"):
        if len(endpoint) - 6 > _IPC_PATH_MAX or len(endpoint) == 6:
            raise ValueError(f"endpoint {endpoint!r}: the ipc path must be 1-{_IPC_PATH_MAX} bytes")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if not sep or not (port == "*" or port.isdigit() and 0 <= int(port) < 65536):
            raise ValueError(f"endpoint {endpoint!r}: expected tcp://[host]:port with a port number or *")
        port = "*" if port != "*" and int(port) == 0 else port  # port 0: any free one, as *
        return f"tcp://{host or '127.0.0.1'}:{port}"
    raise ValueError(f"endpoint {endpoint!r}: only ipc:// and tcp:// endpoints are supported")


def beyond_this_machine(endpoint: str) -> bool:
    """A tcp endpoint bound to an address other than loopback (``*``, ``0.0.0.0``, a host's
    address or name): other hosts may reach it, so it is secured with CURVE keys
    (:mod:`tensorsocket.keys`)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[6:].rpartition(":")[0].strip("[]")
    try:
        return host != "localhost" and not ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", a host name, an interface: it may be
        return True


def ipv6(endpoint: str) -> bool:
    """Whether a tcp endpoint names an IPv6 address (``tcp://[::1]:5555``): a ZeroMQ socket
    binds or connects to one only with its IPV6 option set."""
    return endpoint.startswith("tcp://[")


def connect_address(endpoint: str) -> str:
    """The address a consumer connects to for an endpoint a producer binds."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        if port == "*":
            raise ValueError(f"endpoint {endpoint!r}: a consumer needs the producer's actual port")
        if host in ("*", "0.0.0.0", "[::]", "::"):
            return f"tcp://127.0.0.1:{port}"
    return endpoint


def lock(endpoint: str) -> IO[str] | None:
    """Take the single-producer lock of an ipc endpoint; None for tcp (bind itself refuses).

    The lock is an flock on ``<path>.lock``, released by the kernel when the holder dies,
    so a crashed producer never blocks the name. Its holder removes the file when it is done
    (:func:`unlock`), so the lock taken must be on the file still at the path: a file opened
    just before its holder removed it is locked in vain, and is opened again.
    """
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[6:] + ".lock"
    for _ in range(_LOCK_TRIES):
        try:
            f = open(path, "a+")
        except OSError as exc:  # (a wrong argument, named: not a traceback from deep inside)
            raise ValueError(
                f"endpoint {endpoint!r}: cannot create its lock file {path} ({exc.strerror}); "
                "the ipc path's folder must exist and be writable"
            ) from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RuntimeError(
                f"another producer (pid {holder}) is already serving {endpoint}; stop it or use another name"
            ) from None
        try:
            current = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
            _HELD.add(f)
            return f
        f.close()
    raise RuntimeError(
        f"the lock file of {endpoint} kept being removed under us: is a clean-up loop running?"
    )


def holder(endpoint: str) -> int | None:
    """The pid of the process holding an ipc endpoint's lock now (0 where its pid is not
    visible from here: another pid namespace), or None: a tcp endpoint, nobody holds it, or
    the kernel's lock table cannot be read. Read from ``/proc/locks`` rather than by trying
    the lock: a probe holding it even for an instant could make a producer starting then
    refuse the name."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        st = os.stat(endpoint[6:] + ".lock")
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    found = []
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 25628 fe:00:2147407 0 EOF" (a waiter's has "->" after
        # the id; a lock taken with LOCK_NB has none)
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rpartition(":")[2] == str(st.st_ino):
            pid = max(0, int(fields[4])) if fields[4].lstrip("-").isdigit() else 0
            if fields[5].startswith(device + ":"):
                return pid
            found.append(pid)  # (overlayfs: stat's device is not always the one locks name)
    return found[0] if len(found) == 1 else None


def silent_holder(endpoint: str, wait: float) -> str | None:
    """When nothing answered at ``endpoint`` for ``wait`` seconds though a process holds its
    name: which one, and why it may be silent; None when nobody holds it. (A new producer
    would be refused the name until that one ends, so "start one" would mislead.)"""
    pid = holder(endpoint)
    if pid is None:
        return None
    who = f"the producer at {endpoint} (pid {pid})" if pid else f"the producer at {endpoint}"
    where = f" (py-spy dump --pid {pid} shows where)" if pid else ""
    why = (
        stopped(pid)
        or f"it is running but not answering: stuck, or busy without letting its I/O thread run{where}"
    )
    return (
        f"{who} holds the name but did not answer within {wait:g} s: {why}; "
        "another producer can take the name only once it ends"
    )


def unlock(endpoint: str, held: IO[str] | None) -> None:
    """Give up an ipc endpoint whose lock ``held`` is: remove its socket file (a stale one if
    the bind's own clean-up did not) and its lock file, then release the lock. So a
    runtime directory holds files only for names served now (and for crashed producers', which
    the next producer of the name removes when it is done). A state file stays: it is what a
    restarted producer resumes from."""
    if held is None:
        return
    _HELD.discard(held)
    path = endpoint[6:]
    try:
        for leftover in (path, path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    finally:
        held.close()
