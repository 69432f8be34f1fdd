"""Liveness with real processes, sockets and shared memory: dead, silent and departing peers
are noticed within bounded time, the survivors stay exact, and nothing is left behind."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tensorsocket import Consumer, Evicted, Producer, ProducerLost
from tensorsocket.endpoint import holder, lock, resolve, runtime_dir, unlock
from tensorsocket.transport import shm
from tests.support import (
    SPAWN,
    NestedLoader,
    expected_batch,
    run_consumer,
    run_consumer_and_die,
    same,
    serve_producer,
    serving,
    shm_segments,
    unique_name,
    wait_until,
)

EPOCHS = 2
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def reaped(*procs: Any) -> Iterator[None]:
    """Start ``procs``; whatever happens, wake, kill and join every one of them."""
    try:
        for p in procs:
            p.start()
        yield
    finally:
        for p in procs:
            if p.pid is None:
                continue
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot die until resumed
                p.kill()
            p.join(timeout=10)


def tensorsocket_threads(before: Collection[threading.Thread] = ()) -> list[str]:
    """Live tensorsocket threads, other than those in ``before`` (left by other tests)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("tensorsocket") and t not in before]


def assert_exact(report: dict[str, Any], batches: int, epochs: int = EPOCHS) -> None:
    assert report["error"] is None, report["error"]
    assert report["bad"] == []
    assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]
    assert report["after_end"] == 0 and report["finished"] is True


def warm_up_zmq() -> None:
    """Create the process's zmq context and its I/O thread, so fd counts compare like with like."""
    zmq.Context.instance().socket(zmq.DEALER).close()


def open_fds(settle: int | None = None) -> int:
    """How many fds this process has open. With ``settle``, wait up to a second for the count
    to drop to it: zmq closes a socket's connections in its own thread, after a linger."""
    deadline = time.monotonic() + 1.0
    while True:
        count = len(os.listdir("/proc/self/fd"))
        if settle is None or count <= settle or time.monotonic() > deadline:
            return count
        time.sleep(0.01)


def start_producer_process(name: str, batches: int, delay: float) -> tuple[Any, Any]:
    ready = SPAWN.Queue()
    proc = SPAWN.Process(target=serve_producer, args=(name, batches, ready), kwargs={"delay": delay})
    return proc, ready


# ---------------------------------------------------------------------------- tests


def test_sigkilled_consumer_holding_slots_is_evicted_and_survivors_stay_exact(name):
    batches, kill_after = 6, 3
    results, doomed = SPAWN.Queue(), SPAWN.Queue()
    survivors = [SPAWN.Process(target=run_consumer, args=(name, EPOCHS, batches, results)) for _ in range(2)]
    # It keeps all 3 batches it took alive: with 3 slots nobody can progress until it is evicted.
    go = SPAWN.Event()  # (it dies once the producer shows it holding them all)
    victim = SPAWN.Process(target=run_consumer_and_die, args=(name, batches, doomed, kill_after, go))
    producer = Producer(NestedLoader(batches), name=name, slots=3, replay=0, min_consumers=3)
    with reaped(victim, *survivors), serving(producer, EPOCHS) as (server, errors):

        def held() -> int | None:
            assert all(p.exitcode in (None, 0) for p in survivors), "a survivor failed (see its stderr)"
            entries = [c for c in producer.status()["consumers"] if c["pid"] == victim.pid]
            return entries[0]["held"] if entries else None

        wait_until(
            lambda: held() == kill_after, 60, f"the victim to hold {kill_after} batches at the producer"
        )
        go.set()
        gone_at = None
        deadline = time.monotonic() + 60
        while gone_at is None and time.monotonic() < deadline and server.is_alive():
            if held() is None:
                gone_at = time.time()
            time.sleep(0.005)
        death = doomed.get(timeout=30)
        assert gone_at is not None, "the killed consumer was never evicted"
        assert death["pid"] == victim.pid and death["held"] == kill_after and death["bad"] == []
        delay = gone_at - death["killed_at"]
        assert delay < 2.0, f"evicted {delay:.2f} s after its SIGKILL"
        reports = [results.get(timeout=60) for _ in survivors]
        server.join(timeout=30)
        assert not server.is_alive() and errors == []
    victim.join(timeout=10)
    assert victim.exitcode == -signal.SIGKILL
    for report in reports:
        assert_exact(report, batches)
    assert producer.status()["consumers"] == []
    assert shm_segments(os.getpid()) == []


def test_sigkilled_producer_raises_producer_lost_and_its_segments_are_swept(name):
    batches = 8
    proc, ready = start_producer_process(name, batches, delay=0.05)
    with reaped(proc):
        pid = ready.get(timeout=60)
        assert pid == proc.pid
        consumer = Consumer(name=name, timeout=5)
        try:
            killed_at = None
            with pytest.raises(ProducerLost, match="died") as lost:
                for index, batch in enumerate(consumer):
                    assert same(batch, expected_batch(index, batches))
                    if index == 2:
                        # Listed while it lives: any Producer made meanwhile (another xdist
                        # worker's too) may sweep them once it is dead, so not after the kill.
                        held = shm_segments(pid)
                        os.kill(pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            elapsed = time.monotonic() - killed_at
        finally:
            consumer.close()
        assert killed_at is not None
        assert elapsed < 5.0, f"ProducerLost came {elapsed:.2f} s after the kill"
        assert elapsed < 2.0, f"the pid watch took {elapsed:.2f} s"  # the silence path would take 5 s
        assert str(pid) in str(lost.value)
        proc.join(timeout=10)
        assert proc.exitcode == -signal.SIGKILL
        assert held, "the producer held no segments: nothing to sweep"
        Producer(NestedLoader(1), name=unique_name()).close()
        assert shm_segments(pid) == []


def test_stopped_producer_is_lost_after_the_silence_timeout(name):
    batches, timeout = 8, 1.5
    threads = set(threading.enumerate())
    proc, ready = start_producer_process(name, batches, delay=0.05)
    with reaped(proc):
        pid = ready.get(timeout=60)
        consumer = Consumer(name=name, timeout=timeout)
        try:
            stopped_at = None
            with pytest.raises(ProducerLost, match="no message") as lost:
                for index, batch in enumerate(consumer):
                    assert same(batch, expected_batch(index, batches))
                    if index == 2:
                        os.kill(pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
            elapsed = time.monotonic() - stopped_at
        finally:
            consumer.close()
        assert stopped_at is not None
        # Alive but silent: only the silence timeout can notice it, never sooner.
        assert timeout - 0.5 <= elapsed < timeout + 1.0, f"ProducerLost after {elapsed:.2f} s"
        assert consumer.endpoint in str(lost.value)
        assert f"it is stopped (SIGSTOP, Ctrl-Z or a debugger): kill -CONT {pid} resumes it" in str(
            lost.value
        )
        assert tensorsocket_threads(threads) == []


def test_a_trainer_whose_stopped_producer_goes_on_within_its_reconnect_is_told_it_gave_it_up(name):
    """The producer is stopped past the trainer's timeout, then resumed within its ``reconnect``:
    the trainer raises ProducerLost as soon as the producer answers (it cannot rejoin one it gave
    up), not after timeout + reconnect. Before, its message still said the producer was stopped
    and how to resume it (a chaos helper saw it), though it had just been resumed."""
    batches, timeout = 50, 1.0
    proc, ready = start_producer_process(name, batches, delay=0.05)
    with reaped(proc):
        pid = ready.get(timeout=60)
        consumer = Consumer(name=name, timeout=timeout, reconnect=30)
        try:
            it = iter(consumer)
            assert same(next(it), expected_batch(0, batches))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(timeout + 1.5)  # (it gave the producer up, and waits for a successor)
            os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            with pytest.raises(ProducerLost) as lost:
                for _ in range(batches):
                    next(it)
            elapsed = time.monotonic() - resumed
        finally:
            consumer.close()
        assert elapsed < 10, f"ProducerLost {elapsed:.1f} s after the producer went on"
        message = str(lost.value)
        assert (
            f"(pid {pid}) sent nothing for 1 s (stopped or stalled), so this consumer gave it up" in message
        )
        assert "it answered again, but it cannot be rejoined" in message and "kill -CONT" not in message


def test_a_stopped_producer_is_named_to_joiners_and_to_trainers_waiting_for_a_successor(name):
    """A producer that is stopped still holds its name, so no successor can come: a joiner, and
    a trainer that waited its ``reconnect`` for one, are told which process holds the name and
    how to resume it, not to start a producer (which would be refused)."""
    batches = 50
    proc, ready = start_producer_process(name, batches, delay=0.05)
    with reaped(proc):
        pid = ready.get(timeout=60)
        consumer = Consumer(name=name, timeout=1, reconnect=1)
        try:
            it = iter(consumer)
            assert same(next(it), expected_batch(0, batches))
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(ProducerLost) as lost:
                for _ in range(batches):
                    next(it)
        finally:
            consumer.close()
        resume = f"it is stopped (SIGSTOP, Ctrl-Z or a debugger): kill -CONT {pid} resumes it"
        waited = str(lost.value).split("waited 1 s for a producer to continue the stream: ", 1)[1]
        assert waited.startswith(
            f"the producer at {consumer.endpoint} (pid {pid}) holds the name but did not answer"
        )
        assert resume in waited and waited.endswith("another producer can take the name only once it ends")
        with pytest.raises(ProducerLost) as refused:
            Consumer(name=name, timeout=0.5)
        assert f"(pid {pid}) holds the name but did not answer within 0.5 s: {resume}" in str(refused.value)
        assert "start one" not in str(refused.value)
        status = subprocess.run(
            [sys.executable, "-m", "tensorsocket", "status", "--name", name, "--timeout", "0.5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 1 and f"(pid {pid}) holds the name" in status.stderr, status
        assert resume in status.stderr, status.stderr
        os.kill(pid, signal.SIGCONT)  # resumed, it serves again
        with Consumer(name=name, timeout=10, late_join="now") as joiner:
            assert next(iter(joiner)) is not None


def test_consumer_without_producer_times_out_naming_the_endpoint(name):
    warm_up_zmq()
    threads, fds = set(threading.enumerate()), open_fds()
    t0 = time.monotonic()
    with pytest.raises(ProducerLost) as lost:
        Consumer(name=name, timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 2.0, elapsed
    message = str(lost.value)
    assert f"{name}.sock" in message and "ipc://" in message and "0.5 s" in message
    assert tensorsocket_threads(threads) == []
    # Nothing to close and nothing left open: no "was not closed" warning, no leaked fds.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del lost
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert open_fds(settle=fds) <= fds


def test_consumer_closing_mid_epoch_leaves_at_once(name):
    batches = 6
    results = SPAWN.Queue()
    # The other consumer steps slowly enough (10 batches left, 0.2 s each) to still be there
    # when the producer is checked: a fast one could finish and leave first (seen in CI).
    other = SPAWN.Process(target=run_consumer, args=(name, EPOCHS, batches, results), kwargs={"step": 0.2})
    producer = Producer(NestedLoader(batches), name=name, slots=3, replay=0, min_consumers=2)
    with reaped(other), serving(producer, EPOCHS) as (server, errors):
        consumer = Consumer(name=name, timeout=10)  # silence alone would take 10 s to notice
        try:
            for index, batch in enumerate(consumer):
                assert same(batch, expected_batch(index, batches))
                if index == 1:
                    break
            del batch
            t0 = time.monotonic()
            consumer.close()
            closed = time.monotonic() - t0
        finally:
            consumer.close()
        assert closed < 3.0, f"close() took {closed:.2f} s"  # (its silence: 10 s)

        def one_left() -> list[dict[str, Any]] | None:
            consumers = producer.status()["consumers"]
            return consumers if len(consumers) == 1 else None

        remaining = wait_until(one_left, 5, "the producer to see the closed consumer leave", interval=0.005)
        left_after = time.monotonic() - t0
        assert [c["pid"] for c in remaining] == [other.pid]
        assert left_after < 3.0, f"the producer noticed the close after {left_after:.2f} s"
        report = results.get(timeout=60)
        server.join(timeout=30)
        assert not server.is_alive() and errors == []
    assert_exact(report, batches)


def test_a_consumer_whose_io_thread_failed_leaves_at_once(name, monkeypatch):
    """A consumer's I/O thread that fails (here mapping an arena: out of descriptors, say)
    ends its stream with ProducerLost, and must leave the producer then, as the caller's
    thread does when it fails while reading: its process goes on (a notebook, a trainer that
    makes a new Consumer), and until its `timeout` of silence it would pace every other
    consumer, its places held. Before, it said no BYE, and stayed joined for that timeout."""
    monkeypatch.setenv("TENSORSOCKET_SESSION", "0")  # over ZeroMQ: the I/O thread builds every batch
    real, maps = shm.open_segment, []

    def out_of_descriptors(*args: Any, **kwargs: Any) -> Any:
        maps.append(args)
        if len(maps) == 2:
            raise OSError(24, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(shm, "open_segment", out_of_descriptors)
    producer = Producer(NestedLoader(6), name=name, slots=3, replay=0)
    with serving(producer, None) as (server, errors):
        consumer = Consumer(name=name, timeout=30)
        try:
            with pytest.raises(ProducerLost, match="consumer I/O failed: OSError"):
                for _ in consumer:
                    pass
            wait_until(  # (its silence would take its timeout, 30 s)
                lambda: producer.status()["consumers"] == [],
                5,
                "the producer to see the failed consumer leave",
            )
        finally:
            consumer.close()
    assert errors == []


def test_normal_run_leaks_nothing(name):
    batches = 4
    pid = os.getpid()
    assert shm_segments(pid) == []
    warm_up_zmq()
    threads, fds = set(threading.enumerate()), open_fds()
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, 1) as (server, errors):
        with Consumer(name=name, timeout=10) as consumer:
            got = [
                index for index, batch in enumerate(consumer) if same(batch, expected_batch(index, batches))
            ]
            assert got == list(range(batches))
            assert list(consumer) == [] and consumer.finished
        server.join(timeout=30)
        assert not server.is_alive() and errors == []
    del consumer, producer
    gc.collect()
    assert shm_segments(pid) == []
    assert tensorsocket_threads(threads) == []
    assert open_fds(settle=fds) <= fds  # sockets, wake-up pipes, lock file and mappings all closed
    again = Producer(NestedLoader(1), name=name)  # the name's lock was released
    again.close()
    assert shm_segments(pid) == []


def test_second_producer_on_a_served_name_is_refused(name):
    batches = 3
    producer = Producer(NestedLoader(batches), name=name, slots=2, replay=0)
    with serving(producer, 1) as (server, errors):
        with pytest.raises(RuntimeError, match="already serving") as refused:
            Producer(NestedLoader(batches), name=name)
        assert str(os.getpid()) in str(refused.value)
        # The refused one disturbed nothing: the first still serves its whole epoch.
        with Consumer(name=name, timeout=10) as consumer:
            assert [same(b, expected_batch(i, batches)) for i, b in enumerate(consumer)] == [True] * batches
        server.join(timeout=30)
        assert not server.is_alive() and errors == []


def test_a_killed_producers_forked_children_do_not_hold_its_name(name):
    """A producer SIGKILLed while its loader's forked workers live: the name is free at once for
    its successor (a supervisor's restart). The flock belonged to the open file the workers
    inherited, so they held the name until they noticed their parent's death (torch checks
    every 5 s) and the restart was refused, naming the dead producer."""
    script = (
        "import os, signal, sys, time\n"
        "from tensorsocket.endpoint import lock, resolve\n"
        f"held = lock(resolve({name!r}, None))\n"
        "child = os.fork()\n"
        "if child == 0:  # (off the pipes, which run() reads to their end)\n"
        "    null = os.open(os.devnull, os.O_RDWR)\n"
        "    os.dup2(null, 1), os.dup2(null, 2)\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "print(child, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    try:
        with open(f"/proc/{child}/stat") as stat:  # the forked child still runs
            assert stat.read().split(")")[-1].split()[0] != "Z"
        endpoint = resolve(name, None)
        held = lock(endpoint)  # not refused
        unlock(endpoint, held)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_closed_producer_leaves_no_files_for_its_name(name):
    """Its socket and lock files go with it (a sweep of generated names does not fill the
    runtime directory); a crashed one's are taken over and removed by the name's next producer."""
    socket_path = runtime_dir() / f"{name}.sock"
    lock_path = runtime_dir() / f"{name}.sock.lock"
    producer = Producer(NestedLoader(2), name=name)
    assert socket_path.exists() and lock_path.exists()
    producer.close()
    assert not socket_path.exists() and not lock_path.exists()
    lock_path.write_text("4194304")  # what a SIGKILLed producer leaves: a lock file nobody holds
    socket_path.touch()
    with Producer(NestedLoader(2), name=name) as again:
        assert lock_path.read_text() == str(os.getpid())
        with serving(again, 1) as (server, errors):
            with Consumer(name=name, timeout=10) as consumer:
                assert [same(b, expected_batch(i, 2)) for i, b in enumerate(consumer)] == [True, True]
            server.join(timeout=30)
            assert errors == []
    assert not socket_path.exists() and not lock_path.exists()


def _take_and_give_back(endpoint: str, rounds: int, inside: str, out: Any) -> None:
    """Lock the endpoint ``rounds`` times; while holding it, be the only one in ``inside``."""
    taken = clashes = 0
    while taken < rounds:
        try:
            held = lock(endpoint)
        except RuntimeError:
            continue
        try:
            fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            clashes += 1
        else:
            os.close(fd)
            os.unlink(inside)
        unlock(endpoint, held)
        taken += 1
    out.put(clashes)


def test_the_name_lock_excludes_while_holders_remove_its_file(name, tmp_path):
    """unlock() removes the lock file, so a lock() that opened it just before must not count
    the (unlinked) file it then locks: three processes taking and giving back the lock many
    times are never inside together."""
    endpoint = resolve(name=name)
    inside, out = str(tmp_path / "inside"), SPAWN.Queue()
    procs = [SPAWN.Process(target=_take_and_give_back, args=(endpoint, 800, inside, out)) for _ in range(3)]
    for p in procs:
        p.start()
    clashes = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert clashes == [0, 0, 0]
    assert not os.path.exists(endpoint[len("ipc://") :] + ".lock")


def test_the_holder_of_a_name_is_read_from_the_kernels_lock_table(name):
    endpoint = resolve(name=name)
    assert holder(endpoint) is None  # no lock file
    held = lock(endpoint)
    try:
        assert holder(endpoint) == os.getpid()
    finally:
        unlock(endpoint, held)
    assert holder(endpoint) is None
    Path(endpoint[len("ipc://") :] + ".lock").write_text("12345")  # a crashed holder's file: not held
    assert holder(endpoint) is None
    assert holder("tcp://127.0.0.1:5555") is None


def test_second_producer_on_a_bound_tcp_port_is_refused_without_leaking():
    with Producer(NestedLoader(1), endpoint="tcp://127.0.0.1:*") as producer:
        fds = open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with pytest.raises(RuntimeError, match="cannot bind"):
                    Producer(NestedLoader(1), endpoint=producer.endpoint)
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
        assert open_fds(settle=fds) <= fds


def test_stopped_consumer_is_evicted_after_its_timeout_and_the_other_stays_exact(name):
    batches, timeout = 6, 2.0  # also its handshake timeout: generous on a loaded machine
    results = SPAWN.Queue()
    victim = SPAWN.Process(
        target=run_consumer,
        args=(name, EPOCHS, batches, results),
        kwargs={"hold": 2, "options": {"timeout": timeout}},
    )
    producer = Producer(NestedLoader(batches), name=name, slots=3, replay=0, min_consumers=2)
    with reaped(victim), serving(producer, EPOCHS) as (server, errors):
        consumer = Consumer(name=name, timeout=10)
        try:
            seen = []
            for epoch in range(EPOCHS):
                for index, batch in enumerate(consumer):
                    assert same(batch, expected_batch(index, batches))
                    seen.append((epoch, index))
                    if not seen[1:]:  # after our first batch: stop the victim holding slots

                        def victim_holds_two() -> bool:
                            assert victim.is_alive(), "the victim died (see its stderr)"
                            consumers = producer.status()["consumers"]
                            return any(c["pid"] == victim.pid and c["held"] >= 2 for c in consumers)

                        wait_until(victim_holds_two, 30, "the victim to hold 2 batches", interval=0.005)
                        assert victim.is_alive(), "the victim died (see its stderr)"
                        os.kill(victim.pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
                        wait_until(
                            lambda: not any(c["pid"] == victim.pid for c in producer.status()["consumers"]),
                            10,
                            "the stopped consumer to be evicted",
                            interval=0.005,
                        )
                        evicted_after = time.monotonic() - stopped_at
            assert list(consumer) == [] and consumer.finished
        finally:
            consumer.close()
        server.join(timeout=30)
        assert not server.is_alive() and errors == []
        # Alive (its pid is watched, but stopped counts as alive) and silent: the timeout decides.
        # (Its last heartbeat may have gone out late, on a loaded machine, just before the stop:
        # the lower bound only rules out an eviction that did not wait for the silence.)
        assert timeout / 2 <= evicted_after < timeout + 1.0, f"evicted after {evicted_after:.2f} s"
        assert seen == [(e, i) for e in range(EPOCHS) for i in range(batches)]
        os.kill(victim.pid, signal.SIGCONT)
        report = results.get(timeout=30)
        victim.join(timeout=10)
        assert victim.exitcode == 0
    # Back from the freeze it raises Evicted instead of blocking: it reads what the producer
    # sent before it acts on its own silence clock (a batch whose segment is already unlinked
    # is dropped and the EVICTED after it read).
    assert report["error"] is not None and "Evicted" in report["error"], report
    # (Batches it held when it was evicted may have changed: eviction dropped its holds.)
    assert report["seen"] == [(0, i) for i in range(len(report["seen"]))]


def test_evicted_consumer_never_yields_the_batches_it_had_queued(name):
    """Its holds were dropped and their slots reused by the time it hears EVICTED: the batches
    still in its queue show other data, so it must raise Evicted instead of yielding them.
    White box: a consumer whose heartbeat never fires stands in for a frozen process."""
    batches = 6
    producer = Producer(NestedLoader(batches), name=name, slots=3, replay=0, min_consumers=2)
    with serving(producer, 1) as (server, errors):
        silent = Consumer(name=name, timeout=0.5)
        silent._conn.heartbeat = 3600.0  # says nothing, so the producer evicts it after 0.5 s
        try:
            with Consumer(name=name, timeout=10) as other:
                # Blocked behind the silent one's 3 held slots until it is evicted.
                assert [same(b, expected_batch(i, batches)) for i, b in enumerate(other)] == [True] * batches
            server.join(timeout=30)
            assert not server.is_alive() and errors == []
            # It heard EVICTED: its I/O thread reads it at a tick, which a loaded machine can put
            # after all of the above (a frozen process would catch up before next(): see
            # test_liveness's SIGSTOP tests; this one's thread never stopped). The CI once ran here first.
            wait_until(lambda: silent._shared.cut_off is not None, 10, "the silent consumer to read EVICTED")
            # Its queued batches 0-2 sit in slots that now hold batches 3-5.
            with pytest.raises(Evicted):
                next(iter(silent))
        finally:
            silent.close()


def test_consumer_that_gave_up_on_a_slow_welcome_leaves_no_ghost(name, caplog):
    """A producer that answers HELLO after the consumer's handshake timeout must not keep a
    registration nobody uses (it would hold slots until its silence timeout). White box:
    holding the producer's lock stands in for a producer too busy to answer in time."""
    producer = Producer(NestedLoader(2), name=name, slots=2, replay=0)
    try:
        with producer._shared.changed:  # the I/O thread cannot handle the HELLO until we let go
            with pytest.raises(ProducerLost) as lost:
                Consumer(name=name, timeout=0.5, label="impatient")
            # It holds the name (this process does), so "start one" would mislead.
            assert (
                f"(pid {os.getpid()}) holds the name but did not answer within 0.5 s: it is running"
                in str(lost.value)
            )
            assert f"py-spy dump --pid {os.getpid()}" in str(lost.value)
        wait_until(
            lambda: any("impatient" in r.getMessage() and "left" in r.getMessage() for r in caplog.records),
            5,
            lambda: (
                f"the producer to log that 'impatient' left; it logged {[r.getMessage() for r in caplog.records]}"
            ),
            interval=0.01,
        )
        assert producer.status()["consumers"] == []
    finally:
        producer.close()


def test_consumer_resumed_after_eviction_raises_before_handing_out_a_queued_batch(name):
    """Frozen past its timeout, the consumer is evicted while batches wait in its queue and
    their slots are reused; resumed, its first next() must raise Evicted, not yield one."""
    from tests.support import run_frozen_victim

    ready, go, results = SPAWN.Event(), SPAWN.RawValue("b", 0), SPAWN.Queue()
    victim = SPAWN.Process(target=run_frozen_victim, args=(name, ready, go, results))
    producer = Producer(NestedLoader(50), name=name, slots=4, replay=0, min_consumers=2)
    with reaped(victim), serving(producer, 1) as (server, errors):
        with Consumer(name=name, timeout=10) as leader:
            it = iter(leader)
            next(it)
            assert ready.wait(30)
            os.kill(victim.pid, signal.SIGSTOP)
            wait_until(
                lambda: not any(c["pid"] == victim.pid for c in producer.status()["consumers"]),
                10,
                "the stopped consumer to be evicted",
                interval=0.01,
            )
            for _ in range(8):  # the leader moves on: the victim's queued batches' slots are reused
                next(it)
            go.value = 1
            os.kill(victim.pid, signal.SIGCONT)
            report = results.get(timeout=30)
        producer.close()
    assert report == {"error": "Evicted", "stale": None}


def _stopped_before_its_first_batch(name: str, ready: Any, results: Any) -> None:
    consumer = Consumer(name=name, timeout=1.0)
    ready.set()  # the test stops us now, before the stream starts: we map no place
    error = None
    try:
        for _ in consumer:
            pass
    except Exception as exc:  # reported: the test checks which
        error = f"{type(exc).__name__}: {exc}"
    finally:
        consumer.close()
    results.put(error)


@pytest.mark.parametrize("stragglers", ["stall", "skip"])
def test_consumer_resumed_after_its_producer_closed_is_told_it_was_evicted(name, stragglers):
    """Stopped past its timeout before its first batch, the consumer is evicted; the stream
    goes on, ends, and the producer closes, unlinking its places. Resumed, the consumer reads
    what was queued for it: BATCH messages whose segments it never mapped and that are gone
    now, then EVICTED. It must raise Evicted (README: "gets Evicted when it resumes"), not
    ProducerLost for a missing segment (each batch's place was taken back with the eviction)."""
    ready, results = SPAWN.Event(), SPAWN.Queue()
    victim = SPAWN.Process(target=_stopped_before_its_first_batch, args=(name, ready, results))
    producer = Producer(NestedLoader(6), name=name, slots=3, replay=0, min_consumers=2, stragglers=stragglers)
    with reaped(victim), serving(producer, 1) as (server, errors):
        assert ready.wait(30)
        os.kill(victim.pid, signal.SIGSTOP)
        with Consumer(name=name, timeout=10) as other:  # the second consumer: the stream starts
            assert [same(b, expected_batch(i, 6)) for i, b in enumerate(other)] == [True] * 6
        server.join(timeout=30)
        assert not server.is_alive() and errors == []
        assert shm_segments(os.getpid()) == []  # closed: every place unlinked
        os.kill(victim.pid, signal.SIGCONT)
        error = results.get(timeout=30)
        victim.join(timeout=10)
    assert error is not None and error.startswith("Evicted: "), error


def _stopped_with_reconnect(name: str, ready: Any, results: Any) -> None:
    consumer = Consumer(name=name, timeout=1.0, reconnect=10)
    error = None
    try:
        it = iter(consumer)
        next(it)
        ready.set()  # the test stops us now, past our timeout
        for _ in it:
            time.sleep(0.01)
    except Exception as exc:  # reported: the test checks which
        error = f"{type(exc).__name__}: {exc}"
    finally:
        consumer.close()
    results.put(error)


def test_a_trainer_with_reconnect_stopped_past_its_timeout_is_told_it_was_evicted(name):
    """README: a consumer stopped past its timeout gets Evicted when it resumes, ``reconnect``
    or not: its own freeze, not its producer's silence, so it does not wait for a successor
    (the producer it would rejoin evicted it) nor say the producer was lost."""
    proc, ready = start_producer_process(name, 50, delay=0.05)
    started, results = SPAWN.Event(), SPAWN.Queue()
    victim = SPAWN.Process(target=_stopped_with_reconnect, args=(name, started, results))
    with reaped(proc):
        ready.get(timeout=60)
        with reaped(victim):
            assert started.wait(60)
            os.kill(victim.pid, signal.SIGSTOP)
            time.sleep(3.0)  # (evicted after 1 s of silence)
            os.kill(victim.pid, signal.SIGCONT)
            error = results.get(timeout=30)
    assert error is not None and error.startswith("Evicted: "), error
    assert "evicted after 1 s without a message" in error
