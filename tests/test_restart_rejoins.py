"""Whom a successor waits for before it publishes: its predecessor's consumers that had
something to lose, counted by their rejoins. Real processes: a resumable producer SIGKILLed,
a ``tensorsocket serve --resume`` successor, trainers spawned."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from tensorsocket import (
    Consumer,
    Producer,
    ProducerLost,
    Refused,
    StateFileError,
    TensorSocketError,
    endpoint,
    protocol,
)
from tensorsocket.cli.query import NoProducer, query_status
from tensorsocket.consumer import handshake
from tensorsocket.consumer.shared import Shared as ConsumerShared
from tensorsocket.producer import restart
from tensorsocket.protocol import Kind
from tests import restart_pipeline
from tests.support import SPAWN, unshare_pid_works, wait_until
from tests.test_malformed import dealer, hello, receive
from tests.test_restart import (
    EPOCHS,
    ROOT,
    ROWS,
    SAMPLES,
    _consume,
    _first_difference,
    _publish_then_die,
    _serve,
    _state_of_a_run,
)


def _trainer(name: str, label: str, out: Any, options: dict[str, Any] | None = None) -> None:
    try:
        _consume(name, {"label": label, **(options or {})}, out)
    except TensorSocketError as exc:
        out.put({"options": {"label": label}, "error": f"{type(exc).__name__}: {exc}"})


def _trainers_4_batches_in(
    name: str, labels: tuple[str, ...], die: Any, out: Any, options: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """A resumable producer that SIGKILLs itself at ``die`` after 6 batches, and trainers
    (``labels``, with Consumer ``options``) spawned, once each was sent 4 batches."""
    first = SPAWN.Process(target=_publish_then_die, args=(name, 6, die))
    first.start()
    trainers = {label: SPAWN.Process(target=_trainer, args=(name, label, out, options)) for label in labels}
    for p in trainers.values():
        p.start()
    _wait_for_the_state_file(name, len(labels), f"the trainers {labels} to receive 4 batches")
    return first, trainers


def _wait_for_the_state_file(name: str, consumers: int, what: str) -> None:
    """Until ``name``'s state file names a restart point at batch 4 or later and ``consumers``
    consumers a successor waits for."""
    state = restart.state_path(endpoint.resolve(name))
    wait_until(
        lambda: (
            state.exists()
            and restart.read(state).point.index >= 4
            and restart.read(state).consumers == consumers
        ),
        60,
        what,
    )


def end_all(lives: list[subprocess.Popen], trainers: Any) -> None:
    """Kill the producers still running and join the trainers, going on any stopped one."""
    for life in lives:
        if life.poll() is None:
            life.kill()
            life.wait()
    for p in trainers:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)


def _joins(log: Any) -> int:
    return len(re.findall(r" (?:re)?joined[^(]*\(", log.read_text())) if log.exists() else 0


def test_a_successor_waits_for_its_predecessors_consumers_not_for_a_new_one(name, tmp_path):
    """Two trainers were sent batches when their producer died; one of them is stopped
    (SIGSTOP) while a new trainer joins the successor. The successor waits for the stopped
    one to rejoin, not for any second consumer. Before, it counted the new trainer as one of
    its predecessor's, started without the stopped one, and published its batches past it:
    here the whole stream went by, and it raised ProducerLost."""
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    die, out = SPAWN.Event(), SPAWN.Queue()
    first, trainers = _trainers_4_batches_in(name, ("steady", "stopped"), die, out)
    address = endpoint.resolve(name)
    os.kill(trainers["stopped"].pid, signal.SIGSTOP)
    log, second, new = tmp_path / "producer.log", None, None
    try:
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        second = _serve(name, "seeded", log, ("--grace", "60"))
        new = SPAWN.Process(target=_trainer, args=(name, "new", out))
        new.start()
        wait_until(lambda: _joins(log) >= 2, 60, "the steady trainer to rejoin and the new one to join")
        time.sleep(1.0)  # (before, the successor started at once: its stream takes ~3 s)
        status = query_status(address, 10)
        assert status["starts_with"] == 2 and status["published"] == 0, (status, log.read_text()[-3000:])
    finally:
        os.kill(trainers["stopped"].pid, signal.SIGCONT)
    try:
        results = {r["options"]["label"]: r for r in (out.get(timeout=120) for _ in range(3))}
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for proc in (second,):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in (*trainers.values(), new):
            if p is not None:
                p.join(timeout=30)
    for label in ("steady", "stopped"):
        result = results[label]
        assert "error" not in result and result["missed"] is None, result
        assert result["seen"] == expected, (label, _first_difference(result["seen"], expected))
    # The new one starts with the next epoch: the successor restarted inside the first, and
    # has not its first batches to replay.
    assert results["new"]["seen"] == expected[1:], results["new"]
    text = log.read_text()
    for label in ("steady", "stopped"):
        assert f"'{label}' (pid {trainers[label].pid}) rejoined (" in text, text[-3000:]
    assert f"'new' (pid {new.pid}) joined" in text, text[-3000:]


def _publish_and_wait(name: str, batches: int, go: Any, replay: int | None) -> None:
    """A resumable producer (4 slots) whose loop body, after ``batches`` batches, waits for
    ``go``; the next batch's wait for a place then writes a kept batch again for a replaying
    joiner (restage), or the process is killed there."""
    producer = Producer(restart_pipeline.seeded(delay=0.01), name=name, resume=True, slots=4, replay=replay)
    for n, _ in enumerate(producer, 1):
        if n == batches:
            go.wait(120)


def test_a_joiner_sent_its_first_batch_by_a_restage_is_counted_in_the_state_file(name):
    """The state file counts a consumer as it is sent its first batch, whatever sends it.
    Here a replaying joiner's first batch is a kept one written into a place again while the
    publishing thread waits for a place: no publish follows to write the file. Before, the
    file still said 1 consumer, and a successor started without the joiner (22 batches
    missed in the reviewer's run)."""
    go, out, holding, hold = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    first = SPAWN.Process(target=_publish_and_wait, args=(name, 12, go, None))
    first.start()
    leader = SPAWN.Process(target=_consume, args=(name, {"label": "leader", "late_join": "now"}, out))
    leader.start()
    state = restart.state_path(endpoint.resolve(name))
    try:
        wait_until(
            lambda: state.exists() and restart.read(state).point.index >= 6, 60, "the leader 6 batches in"
        )
        options = {"label": "joiner", "late_join": "replay", "prefetch": 2}
        joiner = SPAWN.Process(target=_consume, args=(name, options, out, (holding, hold)))
        joiner.start()
        wait_until(
            lambda: restart.read(state).point.index == 0, 60, "the joiner's join to move the point back"
        )
        assert restart.read(state).consumers == 1  # (it was sent nothing yet)
        go.set()
        assert holding.wait(60), "the joiner got no batch"
        written = restart.read(state)
        assert written.consumers == 2 and written.point.index == 0, written
    finally:
        first.kill()
        first.join(timeout=30)
        for p in (leader, joiner):
            p.kill()
            p.join(timeout=30)


def _restored(name: str, checkpoint: dict[str, Any], out: Any, joined: Any) -> None:
    """A trainer restored from ``checkpoint`` that waits for the next epoch: every batch it
    gets, and how many it was told it missed."""
    seen: list[int] = []
    try:
        options = {"timeout": 5.0, "reconnect": 60.0, "late_join": "next_epoch", "label": "restored"}
        with Consumer(name=name, **options) as consumer:
            consumer.load_state_dict(checkpoint)
            joined.set()
            while not consumer.finished:
                seen += [int(i) for ids, _ in consumer for i in ids]
            out.put({"options": {"label": "restored"}, "seen": seen, "missed": consumer.missed})
    except TensorSocketError as exc:
        out.put({"options": {"label": "restored"}, "error": f"{type(exc).__name__}: {exc}"})


def test_a_restored_trainer_that_received_nothing_does_not_stand_in_for_one_that_did(name, tmp_path):
    """A trainer restored from a checkpoint at batch 1, which the producer no longer has,
    waits for the next epoch, so it was sent nothing when the producer died. It rejoins the
    successor at its restored position, not as one of those that received batches: the
    successor waits for the leader, which is stopped. It is told once that it missed 23
    batches. Before, it rejoined as if it had received batch 0, the successor started
    without the leader (12 batches missed), and it was told it missed 46."""
    go, out, joined = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event()
    first = SPAWN.Process(target=_publish_and_wait, args=(name, 10, go, 0))  # (batch 1 is gone)
    first.start()
    with Consumer(name=name, timeout=10, late_join="now", label="early") as early:
        next(iter(early))
        checkpoint = early.state_dict()
    assert (checkpoint["epoch"], checkpoint["index"]) == (0, 1)
    leader = SPAWN.Process(target=_consume, args=(name, {"label": "leader", "late_join": "now"}, out))
    leader.start()
    address = endpoint.resolve(name)
    state = restart.state_path(address)
    wait_until(lambda: state.exists() and restart.read(state).point.index >= 6, 60, "the leader 6 batches in")
    restored = SPAWN.Process(target=_restored, args=(name, checkpoint, out, joined))
    restored.start()
    assert joined.wait(60)
    os.kill(leader.pid, signal.SIGSTOP)
    log, second = tmp_path / "producer.log", None
    try:
        first.kill()
        first.join(timeout=30)
        second = _serve(name, "seeded", log, ("--grace", "60", "--replay", "0"))
        wait_until(lambda: _joins(log) >= 1, 60, "the restored trainer to join")
        time.sleep(1.0)  # (before, the successor started at once)
        status = query_status(address, 10)
        assert status["published"] == 0, (status, log.read_text()[-3000:])
    finally:
        os.kill(leader.pid, signal.SIGCONT)
    try:
        results = {r["options"]["label"]: r for r in (out.get(timeout=120) for _ in range(2))}
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
        for p in (leader, restored):
            p.join(timeout=30)
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    leader_result = results["leader"]
    assert "error" not in leader_result and leader_result["missed"] is None, leader_result
    assert leader_result["seen"] == expected, _first_difference(leader_result["seen"], expected)
    assert "error" not in results["restored"], results["restored"]
    assert results["restored"]["missed"] == 96 // ROWS - 1, results["restored"]
    assert results["restored"]["seen"] == [i for epoch in expected[1:] for i, _ in epoch]
    text = log.read_text()
    assert f"'restored' (pid {restored.pid}) joined (" in text and "'leader'" in text, text[-3000:]


def _killed_after_a_hello(address: str, heard: Any) -> None:
    """A successor SIGKILLed after it read a trainer's HELLO, before it answered: it takes
    the name as a producer does, binds, reads until a HELLO comes, and kills itself."""
    endpoint.lock(address)
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(address)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if socket.poll(100) and protocol.decode(socket.recv_multipart()[-1])[0] is Kind.HELLO:
            heard.set()
            break
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_trainer_whose_hello_died_with_a_successor_rejoins_the_next_one(name, tmp_path):
    """The first successor reads the trainer's HELLO and is killed before it answers. The
    trainer sends its HELLO again when it connects to the next successor, and goes on with
    the uninterrupted stream. Before, it sent its HELLO once, waited out its `reconnect`
    (60 s) though the next successor was up, and raised ProducerLost."""
    die, out, heard = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event()
    first, trainers = _trainers_4_batches_in(name, ("trainer",), die, out)
    trainer = trainers["trainer"]
    address = endpoint.resolve(name)
    die.set()
    first.join(timeout=60)
    assert first.exitcode == -signal.SIGKILL
    deaf = SPAWN.Process(target=_killed_after_a_hello, args=(address, heard))
    deaf.start()
    log, second = tmp_path / "producer.log", None
    try:
        assert heard.wait(60), "the trainer sent the first successor no HELLO"
        deaf.join(timeout=30)
        assert deaf.exitcode == -signal.SIGKILL
        second = _serve(name, "seeded", log)
        try:
            result = out.get(timeout=45)  # (under the trainer's reconnect: 60 s)
        except queue.Empty:
            raise AssertionError(
                f"the trainer did not rejoin the next successor:\n{log.read_text()[-3000:]}"
            ) from None
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
        trainer.kill()
        trainer.join(timeout=30)
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    assert "error" not in result and result["missed"] is None, result
    assert result["seen"] == expected, _first_difference(result["seen"], expected)
    assert f"'trainer' (pid {trainer.pid}) rejoined (" in log.read_text(), log.read_text()[-3000:]


def _successor(name: str, ready: Any, go: Any, delay: float, slow_for: int) -> None:
    """A ``resume=True`` producer made (torch imported, loader built: then ``ready``) before
    ``go``, so that it binds a moment after it: the first ``slow_for`` samples it pulls take
    ``delay`` each."""
    loader = restart_pipeline.seeded(delay=delay, slow_for=slow_for)
    ready.set()
    assert go.wait(60)
    Producer(loader, name=name, resume=True, slots=4).serve(epochs=EPOCHS)


def _preparing(address: str) -> str | None:
    try:
        return query_status(address, 1)["preparing"]
    except NoProducer:  # (not bound yet)
        return None


def test_a_trainer_waits_for_a_successor_whose_rerun_outlasts_its_reconnect(name):
    """A plain DataLoader's successor runs the epoch again up to the restart point before it
    publishes: here about 5 s (its first 24 samples take 0.25 s each), longer than the
    trainer's `reconnect` (2 s). It binds first and holds the trainer's HELLO meanwhile,
    sending it heartbeats; its status says what it does. The trainer waits, then sees the
    uninterrupted stream. Before, the successor bound only after the rerun, and the trainer
    raised ProducerLost 2 s after its producer died. A HELLO it held and then refuses (a
    consumer on another host) is answered with the reason, as one not held is (before, it
    ended the successor's I/O thread)."""
    die, out, ready, go = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    first, trainers = _trainers_4_batches_in(name, ("trainer",), die, out, {"reconnect": 2.0})
    second = SPAWN.Process(target=_successor, args=(name, ready, go, 0.25, 24))
    second.start()
    address = endpoint.resolve(name)
    remote = dealer(address)
    try:
        # (its start, torch imported, can take longer than the trainer's reconnect on a busy machine)
        assert ready.wait(60), "the successor did not start"
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        go.set()
        said = wait_until(lambda: _preparing(address), 30, "the successor to say it prepares")
        assert said.startswith("resuming stream ") and ": running epoch 0 again up to batch " in said, said
        remote.send(protocol.encode(Kind.HELLO, **hello(boot_id="another-host", label="remote")))
        _, refused = receive(remote, {Kind.ERROR, Kind.WELCOME}, timeout=60)
        assert "another host" in refused["reason"], refused
        result = out.get(timeout=90)
        assert "error" not in result, result
        second.join(timeout=60)
        assert second.exitcode == 0
    finally:
        remote.close()
        for p in (second, *trainers.values()):
            p.kill()
            p.join(timeout=30)
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    assert "error" not in result and result["missed"] is None, result
    assert result["seen"] == expected, _first_difference(result["seen"], expected)


class _Shifted(restart_pipeline.Augmented):
    """Another dataset of the same length: ids from 1000."""

    def __getitem__(self, i: int) -> Any:
        ids, noise = super().__getitem__(i)
        return ids + 1000, noise


def test_a_consumer_held_by_a_successor_that_cannot_resume_is_told_why(name):
    """A StatefulDataLoader's successor over another dataset of the same length cannot resume:
    its loaded state gives another batch at the restart point. A consumer whose HELLO it held
    while it loaded and checked (0.8 s: its samples are slow) is refused with that reason,
    and the constructor raises StateFileError."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    _state_of_a_run(name, restart_pipeline.stateful(), 5)
    other = StatefulDataLoader(_Shifted(96, 0.2), batch_size=4, shuffle=True, generator=torch.Generator())
    told: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def join() -> None:
        try:
            Consumer(name=name, timeout=30.0).close()
            told.put(None)
        except TensorSocketError as exc:
            told.put(exc)

    joiner = threading.Thread(target=join)
    joiner.start()  # (it connects at once, and ZeroMQ retries until the successor binds)
    with pytest.raises(StateFileError, match="gives batch 4 of epoch 0 other than before the restart"):
        Producer(other, name=name, resume=True)
    joiner.join(timeout=30)
    error = told.get(timeout=1)
    assert isinstance(error, Refused), error
    assert "could not resume its stream" in str(error) and "other than before the restart" in str(error)


def test_a_trainer_held_by_a_successor_stopped_while_it_prepares_waits_for_the_next_one(name, tmp_path):
    """SIGINT to a `serve --resume` successor in the middle of its rerun: it ends (exit 130)
    and keeps the state file; the trainer whose HELLO it held is not refused (an interrupt
    is no reason to end its stream), so it waits on, rejoins the next successor and sees the
    uninterrupted stream. Before, it was refused with an empty reason and raised ProducerLost."""
    die, out = SPAWN.Event(), SPAWN.Queue()
    first, trainers = _trainers_4_batches_in(name, ("trainer",), die, out)
    address = endpoint.resolve(name)
    log, second, third = tmp_path / "producer.log", None, None
    try:
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        second = _serve(name, "seeded", log, ("--arg", "delay=0.25", "--arg", "slow_for=24"))
        wait_until(lambda: "; 1 HELLO(s) held" in (_preparing(address) or ""), 60, "the trainer to be held")
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 130, log.read_text()[-3000:]
        assert restart.state_path(address).exists()
        third = _serve(name, "seeded", log)
        result = out.get(timeout=90)
        assert third.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for proc in (second, third):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in trainers.values():
            p.kill()
            p.join(timeout=30)
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    assert "error" not in result and result["missed"] is None, result
    assert result["seen"] == expected, _first_difference(result["seen"], expected)


def test_a_consumers_constructor_waits_as_long_as_heartbeats_moved_its_handshakes_deadline(monkeypatch):
    """The constructor waits for the I/O thread's join up to its timeout (and a reader's
    set-up), or, past it, up to the deadline a preparing successor's heartbeats moved. Before,
    a rerun longer than timeout + 120 s made Consumer() raise ProducerLost while heartbeats came."""
    monkeypatch.setattr(handshake, "READER_SETUP_S", 0.2)
    shared, results = ConsumerShared(), queue.SimpleQueue()
    shared.join_deadline = time.monotonic() + 1.5
    threading.Timer(1.0, results.put, ("joined",)).start()
    assert handshake.outcome(results, shared, 0.1, "ipc://x") == "joined"
    shared = ConsumerShared()  # nothing moved its deadline: it gives up after timeout + set-up
    started = time.monotonic()
    lost = handshake.outcome(queue.SimpleQueue(), shared, 0.1, "ipc://x")
    assert isinstance(lost, ProducerLost) and shared.stop.is_set() and time.monotonic() - started < 1.0


needs_unshare = pytest.mark.skipif(
    not unshare_pid_works(), reason="unshare --pid needs root (CI runs as root)"
)

# A trainer as _consume, reporting on stdout: run in a PID namespace of its own.
_NAMESPACED_TRAINER = """
import json, sys
from tests.test_restart import _consume

class Out:
    def put(self, report):
        print("REPORT " + json.dumps(report), flush=True)

_consume(sys.argv[1], {"timeout": 4.0}, Out())
"""


@needs_unshare
def test_a_trainer_in_another_pid_namespace_rejoins_a_successor_that_bound_before_it_noticed(name):
    """In another PID namespace (a container) a trainer cannot watch its producer's pid: it
    notices the death by its silence, after `timeout`. A successor that binds sooner gets its
    heartbeats on its old connection, which ZeroMQ made again to the new producer; it must
    leave them be, so the trainer rejoins once it notices. Before, it answered EVICTED
    ('unknown consumer') to its next heartbeat, and the trainer failed with Evicted."""
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    die = SPAWN.Event()
    first = SPAWN.Process(target=_publish_then_die, args=(name, 6, die))
    first.start()
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _NAMESPACED_TRAINER, name]
    trainer = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_the_state_file(name, 1, "the trainer to receive 4 batches")
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        with Producer(restart_pipeline.seeded(), name=name, resume=True, slots=8) as successor:
            successor.serve(epochs=EPOCHS)  # (bound at once, well within the trainer's 4 s)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    reports = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert trainer.returncode == 0 and reports, f"exit {trainer.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    report = json.loads(reports[-1][len("REPORT ") :])
    seen = [[(i, noise) for i, noise in epoch] for epoch in report["seen"]]
    assert seen == expected and report["repeated"] is None and report["missed"] is None


def _publish_pause_publish_die(name: str, first: int, go: Any, die: Any) -> None:
    """A resumable producer (8 places) that publishes ``first`` batches, waits for ``go``,
    publishes one more, waits for ``die`` and SIGKILLs itself."""
    producer = Producer(restart_pipeline.seeded(), name=name, resume=True, slots=8)
    for n, _ in enumerate(producer, 1):
        if n == first:
            go.wait(60)
        elif n == first + 1:
            die.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_trainer_frozen_with_a_batch_unread_when_its_producer_died_rejoins_from_that_batch(name):
    """A trainer stopped (SIGSTOP) while its producer sends a batch into a place it never
    mapped, then dies; the successor unlinks what it left, and the trainer, let go on, finds
    that batch's memory gone. It never had the batch: it rejoins from it, exactly. Before, it
    took the batch for one lost (as after an eviction) and raised ProducerLost."""
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    go, die, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    holding, let_go = SPAWN.Event(), SPAWN.Event()
    first = SPAWN.Process(target=_publish_pause_publish_die, args=(name, 3, go, die))
    first.start()
    # (it keeps its first 3 batches: batch 3 goes to a place it never mapped)
    trainer = SPAWN.Process(target=_consume, args=(name, {}, out, (holding, let_go), 3))
    trainer.start()
    try:
        assert holding.wait(60)
        os.kill(trainer.pid, signal.SIGSTOP)
        go.set()
        state = restart.state_path(endpoint.resolve(name))
        wait_until(lambda: (0, 3) in restart.read(state).fingerprints, 30, "batch 3 to be sent")
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        with Producer(restart_pipeline.seeded(), name=name, resume=True, slots=8) as successor:
            os.kill(trainer.pid, signal.SIGCONT)
            let_go.set()
            successor.serve(epochs=EPOCHS)
        result = out.get(timeout=60)
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
        trainer.join(timeout=30)
    assert result["seen"] == expected and result["missed"] is None, _first_difference(
        result["seen"], expected
    )


@pytest.mark.parametrize("pipeline", ["seeded", "unrepeatable"])
def test_a_group_rank_that_does_not_rejoin_the_successor_breaks_its_group(name, tmp_path, pipeline):
    """A group of 2 ranks; its producer is SIGKILLed, then rank 1 dies before the successor is
    up. Before: rank 0 rejoined, its group waited for rank 1 to the end of the stream, and rank
    0 ended cleanly, its epochs cut short as if whole (a chaos helper saw [12, 7, 0, 0] of 4
    epochs of 24; in a group of 4, unequal shares: DDP's all-reduces would not line up). Now
    when the successor starts without rank 1 (its wait for rejoins, --grace 2 here), rank 0
    gets GroupBroken naming the rank that did not rejoin. ``unrepeatable``: the successor
    starts the epoch again as a new stream; it used to wait for nobody, and rank 0 for ever."""
    first, ranks, die, out = _a_group_of_2_with_a_producer_to_kill(name, pipeline)
    log, second = tmp_path / "producer.log", None
    try:
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        os.kill(ranks[1].pid, signal.SIGKILL)
        ranks[1].join(timeout=30)
        second = _serve(name, pipeline, log, ("--grace", "2"))
        result = out.get(timeout=120)
    finally:
        if second is not None:
            second.kill()
            second.wait()
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():  # (before: rank 0 waited for ever)
                p.kill()
    assert result["options"]["label"] == "rank0", result
    assert result.get("error", "").startswith("GroupBroken: "), (result, log.read_text()[-3000:])
    assert "rank 1 of group 'job' (did not rejoin the restarted producer within its wait)" in result["error"]
    assert f"'rank0' (pid {ranks[0].pid}) rejoined (" in log.read_text()


def _a_group_of_2_with_a_producer_to_kill(name: str, pipeline: str) -> tuple[Any, list[Any], Any, Any]:
    """A resumable producer of ``pipeline`` that SIGKILLs itself once told (the event) after
    10 batches, and a group of 2 ranks (spawned; what each saw goes to the queue) that
    received batches from it."""
    die, out = SPAWN.Event(), SPAWN.Queue()
    first = SPAWN.Process(target=_publish_10_then_die, args=(name, die, pipeline))
    first.start()
    ranks = [
        SPAWN.Process(
            target=_trainer, args=(name, f"rank{r}", out, {"group": "job", "rank": r, "world_size": 2})
        )
        for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    _wait_for_the_state_file(name, 2, "both ranks to receive batches")
    return first, ranks, die, out


def _publish_10_then_die(name: str, die: Any, pipeline: str = "seeded") -> None:
    """A resumable producer that publishes 10 batches, then waits for ``die`` and SIGKILLs
    itself (each rank of a group of 2 holds a batch of the last round as it waits for more)."""
    loader = getattr(restart_pipeline, pipeline)(delay=0.03)
    producer = Producer(loader, name=name, resume=True, slots=8)
    for n, _ in enumerate(producer, 1):
        if n == 10:
            die.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_group_rejoining_a_successor_that_starts_its_epoch_again_gets_each_sample_once(name, tmp_path):
    """A group of 2 ranks, 10 batches into epoch 0 of a loader no restart can repeat; the
    producer is SIGKILLed and a successor starts that epoch again as a new stream. Before:
    the ranks' READY named their position on the old stream (batch 10) as one on the new
    stream, the group started there, and epoch 0 was its 10 batches from the old order and
    the last 14 of the new: 96 samples, 71 distinct, each rank told it got 10 batches again.
    Now each rank gets its share of the whole epoch again, after the 5 batches it had, and
    is told how many came again (5)."""
    first, ranks, die, out = _a_group_of_2_with_a_producer_to_kill(name, "unrepeatable")
    log = tmp_path / "producer.log"
    results = _kill_and_serve_unrepeatable(name, first, die, ranks, out, log)
    results.sort(key=lambda r: r["options"]["rank"])
    again = [r["repeated"] for r in results]  # (5 each, unless the kill cut the 10th batch's send)
    assert all(a is not None and a >= 2 for a in again), results
    epoch0 = [[i for i, _ in r["seen"][0]] for r in results]
    assert [len(e) for e in epoch0] == [(a + SAMPLES // ROWS // 2) * ROWS for a in again]
    after = [i for e, a in zip(epoch0, again, strict=True) for i in e[a * ROWS :]]  # the epoch started again
    assert sorted(after) == list(range(SAMPLES))
    for epoch in range(1, EPOCHS):
        assert sorted(i for r in results for i, _ in r["seen"][epoch]) == list(range(SAMPLES))
    assert "starting that epoch again; 2 consumer(s) to rejoin first" in log.read_text()


def _kill_and_serve_unrepeatable(
    name: str,
    first: Any,
    die: Any,
    trainers: list[Any],
    out: Any,
    log: Path,
    go: Any = None,
    extra: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """SIGKILL ``first`` (set ``die``), serve ``unrepeatable`` in its place (its successor
    starts the epoch again; ``extra``: more of ``tensorsocket serve``'s options), set ``go``, and
    return what each of ``trainers`` put in ``out`` once the successor served the stream to its end."""
    second = None
    try:
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        second = _serve(name, "unrepeatable", log, extra)
        if go is not None:
            go.set()
        results = [out.get(timeout=120) for _ in trainers]
        assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
        for p in trainers:
            p.join(timeout=30)
    assert "starting that epoch again" in log.read_text()
    return results


def _pausing_trainer(name: str, label: str, out: Any, pause: tuple[int, int], paused: Any, go: Any) -> None:
    """A trainer that stops at batch ``pause`` (epoch, index), setting ``paused``, until ``go``:
    every epoch's (id, noise) samples, and how many batches came again."""
    seen: list[list[Any]] = []
    with Consumer(name=name, label=label, timeout=30.0, reconnect=60.0) as consumer:
        while not consumer.finished:
            epoch = []
            for ids, noise in consumer:
                epoch += [(int(i), n.tolist()) for i, n in zip(ids, noise, strict=True)]
                if (len(seen), len(epoch) // ROWS - 1) == pause:
                    paused.set()
                    assert go.wait(60)
            if epoch or not consumer.finished:
                seen.append(epoch)
    out.put({"label": label, "seen": seen, "repeated": consumer.repeated})


def _publish_until_told_then_die(
    name: str, die: Any, samples: int = SAMPLES, slots: int = 4, epochs: int = EPOCHS, consumers: int = 1
) -> None:
    """A resumable producer of ``unrepeatable`` (``samples`` an epoch, from the first of
    ``consumers`` on) that SIGKILLs itself once ``die`` is set (whatever it is doing then:
    waiting for a place, say)."""

    def kill_when_told() -> None:
        die.wait()
        time.sleep(0.3)  # (the I/O thread sends what it has)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_when_told, daemon=True).start()
    loader = restart_pipeline.unrepeatable(samples, delay=0.005)
    producer = Producer(loader, name=name, resume=True, slots=slots, min_consumers=consumers)
    for _ in range(epochs):
        for _ in producer:
            pass
    time.sleep(60)  # (SIGKILLed as told)


def _ahead_of_an_unrepeatable_restart(
    name: str,
    tmp_path: Path,
    pauses: dict[str, tuple[int, int]],
    samples: int = SAMPLES,
    slots: int = 4,
    epochs: int = EPOCHS,
) -> dict[str, dict[str, Any]]:
    """Trainers that each stop at their ``pauses`` batch (epoch, index) and hold it, the
    producer SIGKILLed once all stopped, an ``unrepeatable`` successor (it starts the restart
    point's epoch again) served in its place: what each trainer saw, by label."""
    die, out, go = SPAWN.Event(), SPAWN.Queue(), SPAWN.Event()
    paused = {label: SPAWN.Event() for label in pauses}
    args = (name, die, samples, slots, epochs, len(pauses))
    first = SPAWN.Process(target=_publish_until_told_then_die, args=args)
    first.start()
    trainers = [
        SPAWN.Process(target=_pausing_trainer, args=(name, label, out, at, paused[label], go))
        for label, at in pauses.items()
    ]
    for p in trainers:
        p.start()
    assert all(event.wait(60) for event in paused.values())
    log = tmp_path / "producer.log"
    extra = ("--slots", str(slots), "--epochs", str(epochs), "--arg", f"n={samples}")
    results = _kill_and_serve_unrepeatable(name, first, die, trainers, out, log, go, extra)
    return {r["label"]: r for r in results}


def _each_epoch_once_after_what_came_again(result: dict[str, Any], samples: int, epochs: int) -> None:
    again, seen = result["repeated"] or 0, result["seen"]
    assert len(seen) == epochs, (result["label"], again, [len(e) for e in seen])
    assert sum(len(e) for e in seen) == epochs * samples + again * ROWS, result["label"]
    for epoch in seen:  # (what it had of an epoch started again, first)
        assert sorted(i for i, _ in epoch[len(epoch) - samples :]) == list(range(samples)), result["label"]


def test_trainers_ahead_of_a_successor_that_starts_an_epoch_again_get_no_extra_epoch(name, tmp_path):
    """Trainer b stops at batch 22 of epoch 0 (of 24), holding it, so the restart point stays
    in epoch 0; a, free to run a window ahead, stops at epoch 1's first batch, and both have
    received batches of epoch 1 when the producer is SIGKILLed. Its loader cannot repeat its
    order: the successor starts epoch 0 again. Before: both were sent epoch 0 again, as their
    epoch 1 after the batches they had of it (4 epochs of a 3-epoch stream). Now each goes on
    at epoch 1's start (it comes again, drawn anew: what it had of it, then all of it)."""
    results = _ahead_of_an_unrepeatable_restart(name, tmp_path, {"a": (1, 0), "b": (0, 22)})
    assert results["a"]["repeated"] >= 1  # (b too, unless the kill beat epoch 1's first batch to it)
    for r in results.values():
        _each_epoch_once_after_what_came_again(r, SAMPLES, EPOCHS)


def test_a_successor_that_started_an_epoch_again_killed_before_its_first_batch_is_succeeded_exactly(
    name, tmp_path
):
    """A chaos helper's case. Producer 1 dies mid-epoch; successor 1 starts the epoch again as
    a new stream and waits for its consumers: P rejoins, F (stopped a few seconds, under its
    timeout) does not yet; successor 1 is SIGKILLed before its first batch, and successor 2
    continues the new stream. Before: its state file had lost the old stream (F got
    ProducerLost, "serves another stream") and named no consumer to wait for, and P, which had
    nothing of the new stream, took its old stream's last seq for a place in the new one: it
    dropped the epoch's first 13 batches and called them missed. Now both get what they had,
    then the whole epoch."""
    out, log = SPAWN.Queue(), tmp_path / "producer.log"
    trainers = {label: SPAWN.Process(target=_trainer, args=(name, label, out)) for label in ("P", "F")}
    for p in trainers.values():
        p.start()
    state, lives = restart.state_path(endpoint.resolve(name)), []
    extra = ("--epochs", "2")

    def point() -> tuple[int, int]:
        try:
            s = restart.read(state)
        except (OSError, ValueError):  # (read as it is replaced)
            return (-1, -1)
        return (-1, -1) if s is None else (s.point.epoch, s.point.index)

    try:
        lives.append(_serve(name, "unrepeatable", log, extra))
        wait_until(lambda: point()[0] == 0 and point()[1] >= 6, 60, "6 batches of epoch 0")
        os.kill(trainers["F"].pid, signal.SIGSTOP)
        time.sleep(0.2)
        lives[0].kill()
        lives[0].wait()
        lives.append(_serve(name, "unrepeatable", log, extra))  # successor 1: starts epoch 0 again
        wait_until(lambda: "' (pid" in log.read_text().partition("resuming stream")[2], 60, "P to rejoin")
        time.sleep(0.3)  # (it waits for F)
        lives[1].kill()
        lives[1].wait()
        lives.append(_serve(name, "unrepeatable", log, extra))  # successor 2: continues that stream
        wait_until(lambda: log.read_text().count("resuming stream") >= 2, 60, "successor 2 to resume")
        os.kill(trainers["F"].pid, signal.SIGCONT)
        results = [out.get(timeout=120) for _ in trainers]
        assert lives[2].wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        end_all(lives, trainers.values())
    for r in results:
        assert "error" not in r and r["missed"] is None, r
        again, seen = r["repeated"], r["seen"]
        assert again is not None and again >= 6 and len(seen) == 2, (
            r["options"],
            again,
            [len(e) for e in seen],
        )
        epoch0 = [i for i, _ in seen[0]]
        assert len(epoch0) == SAMPLES + again * ROWS and sorted(epoch0[again * ROWS :]) == list(
            range(SAMPLES)
        )
        assert sorted(i for i, _ in seen[1]) == list(range(SAMPLES))
    text = log.read_text()
    assert "starting that epoch again" in text and "(rerun; 2 consumer(s) to rejoin first)" in text, text[
        -3000:
    ]


def test_a_trainer_epochs_ahead_of_a_successor_that_starts_an_epoch_again_gets_none_twice(name, tmp_path):
    """Epochs of 2 batches and a window of 8: trainer b stops holding epoch 0's first batch, so
    the restart point stays there, while a runs on to epoch 2 (its I/O thread reads on into
    epoch 3). The loader cannot repeat its order: the successor starts epoch 0 again, as a new
    stream, and can place a only at that stream's next epoch's start. Before: a was sent the
    epochs between again (10 epochs of a 6-epoch stream). Now it drops them, and goes on at its
    own epoch's start (what it had of that epoch, then all of it)."""
    samples, epochs = 2 * ROWS, 6
    pauses = {"a": (2, 0), "b": (0, 0)}
    results = _ahead_of_an_unrepeatable_restart(name, tmp_path, pauses, samples, slots=8, epochs=epochs)
    for r in results.values():
        _each_epoch_once_after_what_came_again(r, samples, epochs)


def test_a_late_joiner_restarted_in_its_partial_first_epoch_is_told_what_it_had(name, tmp_path):
    """A chaos helper's case. Trainer N joins epoch 0 part-way (``late_join="now"``, no replay)
    and holds its first 2 batches when the producer is SIGKILLed; the loader cannot repeat its
    order, so the successor starts epoch 0 again. N had only the batches from where it joined:
    ``repeated`` counts those. Before, it counted from the epoch's batch 0 (its position in the
    epoch, not what it had received): 10 said where N had 7, its join index too many."""
    out, log, first = SPAWN.Queue(), tmp_path / "producer.log", (SPAWN.Event(), SPAWN.Event())
    extra = ("--epochs", "1", "--replay", "0", "--arg", "delay=0.05")  # (5 batches a second)
    state = restart.state_path(endpoint.resolve(name))
    lives: list[subprocess.Popen] = []
    trainers = {"P": SPAWN.Process(target=_trainer, args=(name, "P", out))}
    trainers["P"].start()
    try:
        lives.append(_serve(name, "unrepeatable", log, extra))
        wait_until(
            lambda: state.exists() and restart.read(state).point.index >= 3, 60, "3 batches of epoch 0"
        )
        trainers["N"] = SPAWN.Process(
            target=_consume, args=(name, {"label": "N", "late_join": "now"}, out, first, 2)
        )
        trainers["N"].start()
        assert first[0].wait(60)  # (N holds its first 2 batches)
        lives[0].kill()
        lives[0].wait()
        lives.append(_serve(name, "unrepeatable", log, extra))
        first[1].set()
        results = {r["options"]["label"]: r for r in (out.get(timeout=120) for _ in trainers)}
        assert lives[1].wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        first[1].set()
        end_all(lives, trainers.values())
    assert "starting that epoch again" in log.read_text()
    for r in results.values():
        assert "error" not in r and r["missed"] is None, r
        [epoch0] = r["seen"]
        again = r["repeated"] or 0
        assert len(epoch0) == SAMPLES + again * ROWS, (r["options"]["label"], again, len(epoch0))
        assert sorted(i for i, _ in epoch0[again * ROWS :]) == list(range(SAMPLES))
    assert results["N"]["repeated"] >= 2
