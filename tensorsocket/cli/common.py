"""What every ``tensorsocket`` subcommand shares: exit codes, the usage error, option types, formatting.

Kept free of torch, zmq and the producer, so ``tensorsocket --help`` and ``tensorsocket
status`` start fast (each command imports what it needs when it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import stat
import sys
from collections.abc import Iterator

from .. import endpoint as endpoints

# 0 success (a graceful stop included); 1 a runtime failure (nothing serves the name, a trial
# failed, the loader failed mid-stream); 2 a usage error; 130 interrupted (Ctrl-C)
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one message, exit code 2."""


def error(message: str) -> None:
    print(f"tensorsocket: error: {message}", file=sys.stderr)


def detach_output() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal (after SIGHUP: a closed
    terminal fails writes with EIO, which would stop the clean-up before it is done); a file
    or a pipe keeps what is written. A terminal is a character device: once hung up it is no
    longer ``isatty()`` (its ioctls fail), so that is not what is asked."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            if stat.S_ISCHR(os.fstat(stream.fileno()).st_mode):
                os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def handling(*kinds: type[BaseException]) -> bool:
    """Is this thread handling an exception of one of ``kinds``, or one raised while it did
    (a TimeoutError as serve's close lingers)? A stop signal's handler asks: while its stop
    runs, a second signal must not cut it short; elsewhere a second signal means the first's
    exception was swallowed by the code it landed in (an ``except Exception``, an extension
    module's import, a ``__del__``), so it is raised again, or nothing would stop the command."""
    exc = sys.exc_info()[1]
    while exc is not None and not isinstance(exc, kinds):
        exc = exc.__context__
    return exc is not None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold the stop signals' Python handlers while a child process is started and recorded,
    then run them: an exception they raise inside ``subprocess.Popen`` leaves a child running
    that nothing has recorded, so nothing stops it. (Not ``pthread_sigmask``: a child started
    with the signals blocked would keep them blocked.) In the main thread only, as handlers are."""
    held: list[int] = []
    try:
        previous = {
            sig: signal.signal(sig, lambda signum, frame: held.append(signum))
            for sig in STOP_SIGNALS
            if callable(signal.getsignal(sig))
        }
    except ValueError:  # (not the main thread: no handler runs here anyway)
        previous = {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in held:
            signal.raise_signal(signum)  # (its handler runs now, or at the next line)


# ---------------------------------------------------------------------------- option types


def _int_at_least(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def count(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])i?)?b?", re.IGNORECASE)
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def size(text: str) -> int:
    """argparse type: a number of bytes: ``0``, ``1048576``, ``512M``, ``2G``, ``1.5GiB``.
    K, M, G and T are powers of 1024, with or without ``i`` / ``B`` (``2GB`` is ``2G``)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes like 0, 1048576, 512M or 2G, got {text!r}"
        )
    number, unit = match.groups()
    value = float(number) * 1024 ** _POWER[unit.lower()] if unit else float(number)
    if not math.isfinite(value) or value >= 2**63:
        raise argparse.ArgumentTypeError(f"size {text!r} is too large")
    return int(value)


# ---------------------------------------------------------------------------- endpoints


def add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--name",
        help="producer name (an ipc socket in the per-user runtime directory); "
        f"default: ${endpoints.ENV}, then '{endpoints.DEFAULT_NAME}'",
    )
    group.add_argument("--endpoint", help="an explicit endpoint: ipc:///path or tcp://127.0.0.1:5555")


def resolve(args: argparse.Namespace) -> str:
    try:
        return endpoints.resolve(args.name, args.endpoint)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ---------------------------------------------------------------------------- formatting


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
