"""Waits as SCHED_BATCH: a thread blocked in ``yielding.poll`` is SCHED_BATCH while it waits
and what it was once it wakes; a thread of another policy is left alone; the switch can be
turned off; a consumer waiting in next() for a batch waits so, and every batch still
arrives once, bit for bit. Policies are read from
outside the waiting thread, through the kernel (``sched_getscheduler`` of its thread id)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tensorsocket import Consumer, yielding
from tests.support import SPAWN, expected_batch, same, serve_producer, unique_name, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or os.sched_getscheduler(0) != os.SCHED_OTHER,
    reason="Linux scheduling policies, from a SCHED_OTHER thread (new threads inherit it)",
)


def policy_of(thread: threading.Thread) -> int:
    """``thread``'s policy now, as the kernel reports it for its thread id."""
    return os.sched_getscheduler(thread.native_id)  # type: ignore[arg-type]


def policies_while(thread: threading.Thread, running: Callable[[], bool]) -> Counter[int]:
    """How often each policy was seen on ``thread`` (sampled each ms) while ``running()``."""
    seen: Counter[int] = Counter()
    while running():
        try:
            seen[policy_of(thread)] += 1
        except OSError:  # (it ended between the check and the read)
            break
        time.sleep(0.001)
    return seen


def sample_for(thread: threading.Thread, seconds: float) -> Counter[int]:
    """How often each policy was seen on ``thread`` over the next ``seconds``."""
    deadline = time.monotonic() + seconds
    return policies_while(thread, lambda: time.monotonic() < deadline)


def waiter(fd: int, policy: int | None, out: dict[str, Any]) -> None:
    """Thread body: (switch to ``policy``,) wait up to 10 s in yielding.poll for ``fd``, and
    record what it returned and this thread's policy before and after."""
    if policy is not None:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    out["before"] = os.sched_getscheduler(0)
    out["waiting"] = True
    out["ready"] = yielding.poll(poller, 10_000)
    out["waiting"] = False
    out["after"] = os.sched_getscheduler(0)


def wait_in_thread(policy: int | None, waits_as: int) -> tuple[Counter[int], dict[str, Any]]:
    """A thread waits for a pipe; the policies seen over 0.3 s of its wait (once it is
    ``waits_as``: it may not be in its poll yet when it says it begins), and what it recorded."""
    r, w = os.pipe()
    out: dict[str, Any] = {}
    thread = threading.Thread(target=waiter, args=(r, policy, out))
    thread.start()
    try:
        wait_until(lambda: out.get("waiting"), 5, "the thread to begin its wait")
        wait_until(
            lambda: policy_of(thread) == waits_as, 5, lambda: f"policy {waits_as}: {policy_of(thread)}"
        )
        seen = sample_for(thread, 0.3)
        out["caller"] = os.sched_getscheduler(0)  # (this thread: the policy is the waiter's alone)
        os.write(w, b"x")
        thread.join(timeout=5)
        assert not thread.is_alive(), "the waiting thread did not wake for its message"
        return seen, out
    finally:
        os.close(r)
        os.close(w)


def test_a_waiting_thread_is_batch_while_it_waits_and_what_it_was_once_it_wakes() -> None:
    seen, out = wait_in_thread(None, os.SCHED_BATCH)
    assert out["before"] == os.SCHED_OTHER
    assert set(seen) == {os.SCHED_BATCH}
    assert out["caller"] == os.SCHED_OTHER
    assert out["ready"] and out["ready"][0][1] & select.POLLIN
    assert out["after"] == os.SCHED_OTHER


def test_a_thread_of_another_policy_is_left_alone() -> None:
    # (batch already: were its policy not looked at, the wait would end it SCHED_OTHER)
    seen, out = wait_in_thread(os.SCHED_BATCH, os.SCHED_BATCH)
    assert set(seen) == {os.SCHED_BATCH}
    assert out["ready"] and out["after"] == os.SCHED_BATCH


def test_an_interrupted_wait_leaves_the_thread_as_it_was() -> None:
    """A signal handler raising in the wait (Ctrl-C in a notebook that goes on training)."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    r, w = os.pipe()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupted):
            yielding.poll(poller, 10_000)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(r)
        os.close(w)


def test_a_refused_switch_turns_switching_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a seccomp filter refuses sched_setscheduler (tests run as root here, so the
    refusal is simulated): the wait goes on plainly, and so do all later ones."""
    monkeypatch.setattr(yielding._State, "enabled", True)
    calls = []

    def refuse(pid: int, policy: int, param: Any) -> None:
        calls.append(policy)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    r, w = os.pipe()
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN)
        assert yielding.poll(poller, 20) == []  # a tick passes, plainly
        assert yielding.poll(poller, 20) == []
    finally:
        os.close(r)
        os.close(w)
    assert yielding._State.enabled is False
    assert calls == [os.SCHED_BATCH, os.SCHED_OTHER]  # (the way back is still tried), then no more
    assert [r.getMessage() for r in caplog.records if "SCHED_BATCH" in r.getMessage()] == [
        "waiting as SCHED_BATCH was refused ([Errno 1] Operation not permitted): waits are plain ones "
        "from now on"
    ]


def test_a_message_already_there_and_a_tick_with_nothing_return_as_poll_does() -> None:
    r, w = os.pipe()
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN)
        assert yielding.poll(poller, 0) == []
        started = time.monotonic()
        assert yielding.poll(poller, 50) == []  # a tick passes
        assert time.monotonic() - started >= 0.045
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        os.write(w, b"x")
        assert [fd for fd, _ in yielding.poll(poller, 10_000)] == [r]
    finally:
        os.close(r)
        os.close(w)


def test_turned_off_a_waiting_thread_keeps_its_policy() -> None:
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tests.test_yielding import wait_in_thread\n"
        f"seen, out = wait_in_thread(None, {os.SCHED_OTHER})\n"
        "print(sorted(seen), out['after'])\n"
    )
    env = {**os.environ, "TENSORSOCKET_YIELDING": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", script, root], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"[{os.SCHED_OTHER}]", str(os.SCHED_OTHER)]


def test_a_consumer_waits_for_a_slow_producer_as_batch_and_gets_every_batch() -> None:
    name, batches = unique_name("yield"), 6
    ready = SPAWN.Queue()
    proc = SPAWN.Process(
        target=serve_producer, args=(name, batches, ready), kwargs={"delay": 0.2, "slots": 8, "epochs": 1}
    )
    proc.start()
    out: dict[str, Any] = {"exact": [], "after": [], "error": None}

    def train() -> None:
        try:
            with Consumer(name=name, timeout=30) as consumer:
                for index, batch in enumerate(consumer):
                    out["after"].append(os.sched_getscheduler(0))  # (back from a wait in next())
                    out["exact"].append(same(batch, expected_batch(index, batches)))
                    del batch
        except Exception as exc:  # (shown by the assertion below)
            out["error"] = repr(exc)

    try:
        ready.get(timeout=60)
        thread = threading.Thread(target=train)
        thread.start()
        seen = policies_while(thread, thread.is_alive)
        thread.join(timeout=30)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert out["error"] is None
    assert out["exact"] == [True] * batches
    assert seen[os.SCHED_BATCH] >= 100  # samples: it waited ~0.2 s for each batch
    assert out["after"] == [os.SCHED_OTHER] * batches
