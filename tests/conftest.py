import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorsocket.endpoint import runtime_dir
from tests.support import SPAWN, shm_segments, unique_name, wait_until

# How long a test's resources may take to go after it returned: zmq closes a socket's
# connections in its own I/O thread, and a joined thread's fd may close a tick later.
HYGIENE_GRACE = float(os.environ.get("TENSORSOCKET_TEST_HYGIENE_GRACE", "5"))


@pytest.fixture
def name() -> Iterator[str]:
    """A producer name no other test uses. Its files in the runtime directory go afterwards:
    those a killed producer or a raw ZeroMQ peer left (a closed Producer removes its own, see
    test_liveness), and a restarted producer's state file, which stays by design."""
    name = unique_name()
    yield name
    for path in runtime_dir().glob(f"{name}.sock*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def fresh_benchmark_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The JPEG benchmarks start their processes with ``spawn``, each a fresh interpreter that
    imports torch (~3.5 s of CPU on the 2-core VM, a dozen times in a small run); their harness
    tests start the same processes from the suite's server that has torch imported already
    (``tests.support.SPAWN``). What each process runs, and how its CPU is attributed (by the
    process tree under the benchmark), stays the same."""
    import benchmarks.loader_cost
    import benchmarks.pooled_collate
    import benchmarks.sharing

    for module in (benchmarks.sharing, benchmarks.loader_cost, benchmarks.pooled_collate):
        monkeypatch.setattr(module, "SPAWN", SPAWN)


@pytest.fixture(autouse=True)
def _tensorsocket_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorsocket")


def _socket_inodes() -> set[str]:
    """The sockets this process has open (``socket:[inode]`` entries of /proc/self/fd)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, or one closed meanwhile
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon and t.is_alive()}


# Every signal but SIGCHLD, whose handler torch's DataLoader sets once in a process, for good.
_SIGNALS = sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD})


def _handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in _SIGNALS}


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal past SIGRTMIN
        return f"signal {sig}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves behind, in this (the pytest) process, any of:

    * a tensorsocket shared-memory segment owned by this pid (``/dev/shm/tensorsocket-<uid>-
      <pid>-*``) that was not there before it: an unclosed producer or store;
    * a non-daemon thread that it started and that is still alive: it would hang the exit;
    * a socket (``socket:[inode]`` in /proc/self/fd) that it opened and did not close: an
      unclosed producer, consumer or zmq socket;
    * a signal handler other than the one it found (put back, then reported): a CLI run in
      the process that did not give back its handlers. Later tests in that worker would see
      Ctrl-C differently (``_thread.interrupt_main`` does nothing under SIG_DFL or SIG_IGN).

    Each may take up to ``HYGIENE_GRACE`` seconds to go. What is not counted, because it stays
    by design: zmq's global context (``zmq.Context.instance()``, shared by every producer and
    consumer of the process) keeps its own eventfd / epoll fds and C threads for the life of
    the process; none is a socket or a Python thread. A test that already failed is not
    checked (its cleanup may not have run). Fixtures of a wider scope (module, session) are torn down after this check and are not
    seen by it.
    """
    segments = set(shm_segments(os.getpid()))
    threads = _threads()
    sockets = _socket_inodes()
    handlers = _handlers()
    yield
    if request.node.stash.get(_CALL_FAILED, False):
        return

    def leftovers() -> dict[str, list[str]]:
        return {
            "shared-memory segments": sorted(set(shm_segments(os.getpid())) - segments),
            "non-daemon threads": sorted(t.name for t in _threads() - threads),
            "sockets": sorted(_socket_inodes() - sockets),
            "signal handlers": [_signal_name(sig) for sig, h in _handlers().items() if h != handlers[sig]],
        }

    try:
        wait_until(lambda: not any(leftovers().values()), HYGIENE_GRACE, "the test's resources to go")
        return
    except AssertionError:
        pass
    left = {kind: names for kind, names in leftovers().items() if names}
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    if left:  # else they went just after the deadline
        pytest.fail(
            f"the test left behind {left} (close every producer, consumer and store it makes, and give "
            "back the signal handlers it sets)",
            pytrace=False,
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
