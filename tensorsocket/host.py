"""Facts about this host and its processes that tell whether a peer is alive and local."""

from __future__ import annotations

import os

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id (same value for every process on the host), or "" where unknown."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return f.read().strip()[:64]
    except OSError:
        return ""


def pid_namespace() -> int:
    """The inode of this process's pid namespace: equal pids mean the same process only
    when this matches too (containers)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (a zombie counts as dead)."""
    if not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return process_state(pid) != "Z"


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R`` running, ``S`` sleeping, ``T`` stopped,
    ``t`` stopped by a debugger, ``Z`` a zombie, ...), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 3, after the parenthesised command name, is the state.
            return f.read().rsplit(b")", 1)[1].split()[0].decode("ascii", "replace")
    except (OSError, IndexError):
        return None


def stopped(pid: int) -> str:
    """If process ``pid`` is stopped, a line saying so and how to resume it; else "". A
    stopped peer is alive, so only silence gives it away: this says why it is silent."""
    if pid > 0 and process_state(pid) in ("T", "t"):
        return f"it is stopped (SIGSTOP, Ctrl-Z or a debugger): kill -CONT {pid} resumes it"
    return ""


def pid_watch(pid: int) -> int | None:
    """A file descriptor that becomes readable when process ``pid`` ends (a pidfd), so a
    watcher learns of its death without polling; None where there is none (Linux < 5.3, no
    such process): the caller then polls :func:`pid_alive`."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError, ValueError, OverflowError):
        return None


def same_host(other_boot_id: str, other_pidns: int) -> bool:
    """True when a peer reporting these values shares our kernel and pid namespace."""
    return bool(other_boot_id) and other_boot_id == boot_id() and other_pidns == pid_namespace()
