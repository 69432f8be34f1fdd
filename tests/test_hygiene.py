"""The suite's leak check (tests/conftest.py ``_no_leaks``) fails a test that leaves a
segment, a non-daemon thread, a socket or a signal handler behind, and passes one that
cleans up: run on a file of such tests in a pytest of its own, with the conftest as its
plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LEAKY = textwrap.dedent(
    """
    import signal
    import socket
    import threading

    import zmq

    from tensorsocket.transport.shm import ShmStore

    kept = []


    def test_leaves_a_segment():
        store = ShmStore()
        store.install(store.prepare(0, 16))
        kept.append(store)


    def test_leaves_a_thread():
        stop = threading.Event()
        kept.append(stop)
        threading.Thread(target=stop.wait, args=(30,), name="leaked-thread").start()


    def test_leaves_a_zmq_socket():
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:*")
        kept.append(sock)


    def test_leaves_a_plain_socket():
        kept.append(socket.socket())


    def test_leaves_a_signal_handler():
        signal.signal(signal.SIGUSR2, lambda *_: None)


    def test_finds_the_signal_handler_put_back():
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


    def test_cleans_up():
        with ShmStore() as store:
            store.install(store.prepare(0, 16))
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:*")
        sock.close(linger=0)
        worker = threading.Thread(target=lambda: None)
        worker.start()
        worker.join()


    def test_zz_release():  # let the process exit
        for item in kept:
            if isinstance(item, threading.Event):
                item.set()
            else:
                item.close()
    """
)


def test_the_leak_check_fails_exactly_the_tests_that_leak(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-rE", "-o",
         "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=ROOT,
        env={**os.environ, "TENSORSOCKET_TEST_HYGIENE_GRACE": "0.5", "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "8 passed, 5 errors" in out, out
    for test, leak in [
        ("test_leaves_a_segment", "shared-memory segments"),
        ("test_leaves_a_thread", "leaked-thread"),
        ("test_leaves_a_zmq_socket", "sockets"),
        ("test_leaves_a_plain_socket", "sockets"),
        ("test_leaves_a_signal_handler", "SIGUSR2"),
    ]:
        line = next(
            (x for x in out.splitlines() if x.startswith("ERROR") and f"test_leaky.py::{test} " in x), ""
        )
        assert leak in line, out
    assert "test_leaky.py::test_cleans_up " not in out
