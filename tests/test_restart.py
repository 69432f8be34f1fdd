"""Producer restarts under running trainers: a producer started with resume=True continues
its predecessor's stream from the state file beside its socket, and consumers created with
reconnect= ride through, exactly once. Real processes: the producer is ``tensorsocket serve
--resume`` under a supervisor loop that SIGKILLs it; consumers are spawned processes."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Producer, ProducerLost, StateFileError, TensorSocketError, endpoint
from tensorsocket.producer import restart
from tests import restart_pipeline
from tests.support import SPAWN, free_port, shm_segments, wait_until

EPOCHS, SAMPLES, ROWS = 3, 96, 4
ROOT = Path(__file__).resolve().parent.parent


def _consume(name: str, options: dict[str, Any], out: Any, first: Any = None, hold: int = 1) -> None:
    """A trainer: every epoch's (id, noise) samples, in order, and what it was told. With
    ``first`` (two events), holding its first ``hold`` batches (their places stay taken) it
    sets the first and waits for the second: it was sent no more than its prefetch when the
    producer died. Its timeout is generous: it may start before its producer, whose torch import
    alone took over 5 s on a loaded 2-core machine (a kill is seen at once: the session closes)."""
    seen: list[list[Any]] = []
    held: list[Any] = []
    with Consumer(name=name, **{"timeout": 30.0, "reconnect": 60.0, **options}) as consumer:
        while not consumer.finished:
            epoch = []
            for ids, noise in consumer:
                epoch += [(int(i), n.tolist()) for i, n in zip(ids, noise, strict=True)]
                if first is not None:
                    held.append((ids, noise))
                    if len(held) < hold:
                        continue
                    first[0].set()
                    assert first[1].wait(60)
                    first = None
                    held.clear()
            if epoch or not consumer.finished:
                seen.append(epoch)
        out.put({"options": options, "seen": seen, "repeated": consumer.repeated, "missed": consumer.missed})


def _serve(name: str, pipeline: str, log: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensorsocket", "serve", f"tests/restart_pipeline.py:{pipeline}"]
    command += ["--name", name, "--epochs", str(EPOCHS), "--resume", "--slots", "4", "--log-level", "INFO"]
    command += ["--arg", "delay=0.01", *extra]
    with open(log, "a") as f:
        return subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def _wait_serving(proc: subprocess.Popen, log: Path, lives: int) -> None:
    def serving() -> bool:
        assert proc.poll() is None, f"the producer exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        return log.read_text().count(" serving tests/restart_pipeline.py") >= lives

    wait_until(serving, 60, lambda: f"the producer to serve:\n{log.read_text()[-3000:]}")


def _supervise(name: str, pipeline: str, log: Path, kills: int, seed: int, consumers: int) -> list[int]:
    """Start the producer, SIGKILL it at a random moment ``kills`` times (restarting it each
    time, as a supervisor does), then let the last one finish; the producers' pids. The first
    kill waits until all ``consumers`` joined: one still joining then (a slow start on a
    loaded machine) has no stream yet to rejoin, and its constructor fails after ``timeout``."""
    rng, pids = random.Random(seed), []
    for life in range(1, kills + 2):
        proc = _serve(name, pipeline, log)
        try:
            pids.append(proc.pid)
            _wait_serving(proc, log, life)
            if life == 1:
                wait_until(
                    lambda: log.read_text().count(" joined (") >= consumers, 60, "every consumer to join"
                )
            if life <= kills:
                # A random batch position (a batch takes ~40 ms): at most 12 or so batches a life,
                # so the 72 of the stream outlast every kill (later kills once let it end first).
                time.sleep(rng.uniform(0.2, 0.5))
                assert proc.poll() is None, f"the stream ended before kill {life}:\n{log.read_text()[-3000:]}"
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
            else:
                assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:  # (a failure, or pytest-timeout's, must not leave it serving with nobody to stop it)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return pids


def _first_difference(got: list[list[Any]], expected: list[list[Any]]) -> str:
    """Where two runs part, for a readable failure."""
    if len(got) != len(expected):
        return f"{len(got)} epochs, expected {len(expected)}"
    for epoch, (a, b) in enumerate(zip(got, expected, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"epoch {epoch}, sample {i} (batch {i // ROWS}): {x} != {y}"
        if len(a) != len(b):
            return f"epoch {epoch}: {len(a)} samples, expected {len(b)}"
    return "none"


def _by_epoch(results: list[dict[str, Any]], options: dict[str, Any]) -> list[list[Any]]:
    return next(r["seen"] for r in results if r["options"] == options)


@pytest.mark.parametrize("pipeline", ["seeded", "stateful", "stateful_workers"])
def test_a_producer_killed_five_times_under_a_supervisor_loses_nothing(name, tmp_path, pipeline):
    """Three trainers (one re-cutting to its own batch size, one a DDP job of two ranks) ride
    through five SIGKILLs of the producer at random positions: each sees exactly the
    uninterrupted loader's sequence, noise included, and nothing is left behind."""
    kills = 5
    expected = restart_pipeline.uninterrupted(getattr(restart_pipeline, pipeline)(), EPOCHS)
    out = SPAWN.Queue()
    trainers = [{}, {"batch_size": 3}, *({"group": "job", "rank": r, "world_size": 2} for r in (0, 1))]
    procs = [SPAWN.Process(target=_consume, args=(name, options, out)) for options in trainers]
    for p in procs:
        p.start()
    log = tmp_path / "producer.log"
    seed = random.randrange(1 << 16)
    print(f"kill times seeded with {seed}")  # shown with a failure, to run it again
    pids = _supervise(name, pipeline, log, kills=kills, seed=seed, consumers=len(procs))
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    text = log.read_text()
    assert text.count("resuming stream") == kills, text[-3000:]  # the file is written before the first batch
    assert "starting that epoch again" not in text
    for result in results:
        assert result["repeated"] is None and result["missed"] is None, result
    for options in ({}, {"batch_size": 3}):  # every sample once, in order
        seen = _by_epoch(results, options)
        assert seen == expected, (options, _first_difference(seen, expected), text[-4000:])
    ranks = [_by_epoch(results, {"group": "job", "rank": r, "world_size": 2}) for r in (0, 1)]
    for epoch in range(EPOCHS):  # batch i went to rank i % 2: interleave them back
        batches = [ranks[i % 2][epoch][i // 2 * ROWS : (i // 2 + 1) * ROWS] for i in range(SAMPLES // ROWS)]
        assert [s for b in batches for s in b] == expected[epoch]
    for pid in pids:
        assert shm_segments(pid) == []
    assert not restart.state_path(f"ipc://{restart_pipeline_socket(name)}").exists()


def restart_pipeline_socket(name: str) -> str:
    return endpoint.resolve(name)[len("ipc://") :]


@pytest.mark.parametrize("when", ["streaming", "window-full"])
def test_a_loader_that_cannot_repeat_its_order_starts_the_epoch_again_and_says_how_many_come_again(
    name, tmp_path, when
):
    """window-full: the trainer holds its first batch and the producer filled its 4 places
    within the state file's 0.1 s between writes, then published nothing more. The file must
    still come to list every batch sent (its fingerprint): before, it said batch 0 and no
    fingerprint, the successor checked nothing, and the trainer got 96 samples, 81 distinct."""
    out, held = SPAWN.Queue(), (SPAWN.Event(), SPAWN.Event())
    proc = SPAWN.Process(target=_consume, args=(name, {}, out, held if when == "window-full" else None))
    proc.start()
    log = tmp_path / "producer.log"
    first = _serve(name, "unrepeatable", log, ("--arg", "delay=0") if when == "window-full" else ())
    _wait_serving(first, log, 1)
    state = restart.state_path(f"ipc://{restart_pipeline_socket(name)}")
    if when == "streaming":
        wait_until(
            lambda: state.exists() and restart.read(state).point.index >= 3, 30, "a few batches published"
        )
    else:
        assert held[0].wait(60)
        wait_until(
            lambda: state.exists() and len(restart.read(state).fingerprints) == 4,
            30,
            "the 4 batches sent in the file",
        )
        assert restart.read(state).point.index == 0
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    second = _serve(name, "unrepeatable", log)
    held[1].set()
    assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    result = out.get(timeout=60)
    proc.join(timeout=30)
    assert "starting that epoch again" in log.read_text()
    again = result["repeated"]
    assert again is not None and again >= 3, result
    epoch0 = [i for i, _ in result["seen"][0]]
    assert len(epoch0) == SAMPLES + again * ROWS  # what it had, then the whole epoch again
    assert sorted(epoch0[again * ROWS :]) == list(range(SAMPLES))
    for epoch in result["seen"][1:]:
        assert sorted(i for i, _ in epoch) == list(range(SAMPLES))
    assert shm_segments(first.pid) == [] and shm_segments(second.pid) == []


def _die_after_publishing(name: str, batches: int) -> None:
    """A producer process that SIGKILLs itself after ``batches`` batches of a resumable stream."""
    producer = Producer(restart_pipeline.seeded(), name=name, resume=True, slots=4)
    for n, _ in enumerate(producer, 1):
        if n == batches:
            time.sleep(0.3)  # the I/O thread sends it
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_consumer_waits_for_a_successor_only_as_long_as_it_was_told(name):
    killer = SPAWN.Process(target=_die_after_publishing, args=(name, 6))
    killer.start()
    with Consumer(name=name, timeout=5.0, reconnect=1.0) as consumer:
        taken, last = 0, 0.0
        with pytest.raises(ProducerLost, match=r"died; waited 1 s for a producer to continue the stream"):
            for _ in consumer:
                taken += 1
                last = time.monotonic()
        waited = time.monotonic() - last  # the kill came 0.3 s after the last batch was sent
        assert 1.0 <= waited < 10, waited
    killer.join(timeout=30)
    assert taken == 6


def _publish_then_die(name: str, batches: int, die: Any) -> None:
    """A resumable producer that publishes ``batches`` batches, then, its publishing thread
    in the loop body (away from the producer), waits for ``die`` and SIGKILLs itself."""
    producer = Producer(restart_pipeline.seeded(delay=0.03), name=name, resume=True, slots=8)
    for n, _ in enumerate(producer, 1):
        if n == batches - 1:  # the last batch's write then names a point past the epoch's start
            wait_until(
                lambda: producer._shared.flow.restart_point() >= batches - 2, 60, "the leader to catch up"
            )
        if n == batches:
            die.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)


def _join_then_resume(name: str, tmp_path: Path, first: Any, leader: Any, out: Any, holding: Any) -> None:
    """A replaying joiner (prefetch 2) sets ``holding`` with its first batch in hand and waits
    there until ``first``, the producer, SIGKILLed itself; then a ``serve --resume`` successor:
    the leader and the joiner each saw the uninterrupted stream, nothing missed."""
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    dead = SPAWN.Event()
    options = {"late_join": "replay", "prefetch": 2}
    joiner = SPAWN.Process(target=_consume, args=(name, options, out, (holding, dead)))
    joiner.start()
    first.join(timeout=90)
    assert first.exitcode == -signal.SIGKILL
    dead.set()
    log = tmp_path / "producer.log"
    second = _serve(name, "seeded", log)
    assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    results = [out.get(timeout=60) for _ in range(2)]
    for p in (leader, joiner):
        p.join(timeout=30)
    for result in results:
        assert result["missed"] is None, (result["options"], result["missed"])
        assert result["seen"] == expected, (result["options"], _first_difference(result["seen"], expected))


def test_a_joiner_replaying_when_the_producer_dies_gets_every_batch_from_the_successor(name, tmp_path):
    """A replaying joiner moves the restart point back: the state file must say so before
    its first batch goes out. Here the publishing thread is away (in the loop body) from
    before the join until the kill, so only the join itself can have written it. Before,
    the successor resumed where the leader was and the joiner missed the batches between."""
    die, out = SPAWN.Event(), SPAWN.Queue()
    first = SPAWN.Process(target=_publish_then_die, args=(name, 6, die))
    first.start()
    leader = SPAWN.Process(target=_consume, args=(name, {"late_join": "now"}, out))
    leader.start()
    state = restart.state_path(f"ipc://{restart_pipeline_socket(name)}")
    wait_until(
        lambda: state.exists() and restart.read(state).point.index >= 3, 30, "the leader to be 3 batches in"
    )
    _join_then_resume(name, tmp_path, first, leader, out, die)


def _consume_slowly(name: str, out: Any) -> None:
    """A trainer whose first batches take 0.2 s each (the next ones wait in its queue), with a
    timeout of 2 s: every epoch's samples, or what it raised."""
    seen: list[list[Any]] = []
    try:
        with Consumer(name=name, timeout=2.0, reconnect=60.0) as consumer:
            while not consumer.finished:
                epoch = []
                for ids, noise in consumer:
                    epoch += [(int(i), n.tolist()) for i, n in zip(ids, noise, strict=True)]
                    if len(epoch) <= 6 * ROWS:
                        time.sleep(0.2)
                if epoch or not consumer.finished:
                    seen.append(epoch)
    except TensorSocketError as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}", "seen": seen})
        return
    out.put({"seen": seen})


def test_a_consumer_frozen_while_its_producer_died_goes_on_with_its_successor(name, tmp_path):
    """A trainer stopped (SIGSTOP) for over half its timeout asks its producer, once it runs
    again, whether it was evicted meanwhile, and takes no batch it queued before it has the
    answer. Here that producer died while the trainer was stopped: it never answers, and the
    trainer must take its queued batches while it waits for a successor, and then the
    successor's. Before, it raised ProducerLost ("did not answer after this process was
    frozen") at its next batch, whether it had rejoined the successor by then or not."""
    expected = restart_pipeline.uninterrupted(restart_pipeline.seeded(), EPOCHS)
    die, out = SPAWN.Event(), SPAWN.Queue()
    first = SPAWN.Process(target=_publish_then_die, args=(name, 6, die))
    first.start()
    trainer = SPAWN.Process(target=_consume_slowly, args=(name, out))
    trainer.start()
    state = restart.state_path(f"ipc://{restart_pipeline_socket(name)}")
    wait_until(
        lambda: state.exists() and restart.read(state).point.index >= 4,
        60,
        "the trainer to receive 4 batches",
    )
    time.sleep(0.5)  # it reads the last two ahead (their places mapped: a sweep cannot take them)
    os.kill(trainer.pid, signal.SIGSTOP)
    try:
        die.set()
        first.join(timeout=60)
        assert first.exitcode == -signal.SIGKILL
        time.sleep(1.5)  # over half its timeout: its I/O thread notices the freeze
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
    log = tmp_path / "producer.log"
    second = _serve(name, "seeded", log)
    try:
        result = out.get(timeout=90)
        assert "error" not in result, result["error"]
        assert second.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
        trainer.join(timeout=30)
    assert result["seen"] == expected, _first_difference(result["seen"], expected)


def _die_after_a_stale_write(name: str, blocked: Any, go: Any) -> None:
    """A resumable producer whose publishing thread, having taken the restart point for batch
    6 under the lock, waits for ``go`` before writing it (a slow ``loader.state_dict()``),
    then SIGKILLs itself. The writes between lag (as WRITE_EVERY lets them), so the file still
    says the epoch's start when a joiner comes: its join moves the point back no further."""
    restart.WRITE_EVERY = 3600.0
    published = restart.Tracker.published

    def slow(self: Any, seq: int, epoch: int, first_seq: int, index: int) -> None:
        if index == 6:
            blocked.set()
            go.wait(60)
            restart.WRITE_EVERY = 0.0
        published(self, seq, epoch, first_seq, index)

    restart.Tracker.published = slow  # type: ignore[method-assign]
    producer = Producer(restart_pipeline.seeded(delay=0.01), name=name, resume=True, slots=8)
    for n, _ in enumerate(producer, 1):
        if n == 6:  # batch 6's point will be past what the leader got: 5, or 6
            wait_until(
                lambda: producer._shared.flow.restart_point() >= 5, 60, "the leader to be 5 batches in"
            )
        if n == 7:  # batch 6's point was written
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_point_taken_before_a_join_that_did_not_write_is_not_written_after_it(name, tmp_path):
    """The publishing thread takes batch 6's point, 5 or 6; a joiner joins and replays from
    batch 0, which is no earlier than the point last written (the epoch's start), so the join
    writes nothing; then the thread writes its point. The joiner was sent batches 0 and 1 by
    then: a successor resuming at 5 no longer has batch 2, and the joiner missed the rest of
    the epoch (22 batches, every run, before the join superseded such a point too)."""
    blocked, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    first = SPAWN.Process(target=_die_after_a_stale_write, args=(name, blocked, go))
    first.start()
    leader = SPAWN.Process(target=_consume, args=(name, {"late_join": "now"}, out))
    leader.start()
    assert blocked.wait(90)
    _join_then_resume(name, tmp_path, first, leader, out, go)


def test_a_successor_on_another_stream_is_not_mistaken_for_ours(name):
    """A producer started without resume=True (or whose state file was removed) publishes
    other batches under the same numbers: a rejoining consumer must not go on there."""
    killer = SPAWN.Process(target=_die_after_publishing, args=(name, 3))
    killer.start()
    with Consumer(name=name, timeout=5.0, reconnect=30.0) as consumer:
        it = iter(consumer)
        for _ in range(3):
            next(it)
        killer.join(timeout=30)
        restart.remove(restart.state_path(f"ipc://{restart_pipeline_socket(name)}"))
        with Producer(restart_pipeline.seeded(), name=name):
            with pytest.raises(ProducerLost, match="serves another stream"):
                next(it)


# ---------------------------------------------------------------------- the state file


def _state_of_a_run(name: str, loader: Any, batches: int) -> Path:
    """Publish ``batches`` batches with resume=True (continuing a state file left there, if
    any) and leave the state file a crash would have left."""
    producer = Producer(loader, name=name, resume=True, slots=4)
    flow, tracker = producer._shared.flow, producer._shared.tracker
    assert tracker is not None
    with Consumer(name=name, late_join="now") as consumer:
        it, published = iter(consumer), iter(producer)
        for n in range(batches):
            if n == batches - 1:  # the last one is written, with every earlier release in
                # (and no write left to make: one the I/O thread made later would be of the point
                # after it, with the consumer's release of it in)
                wait_until(
                    lambda: flow.restart_point() == flow.next_seq and not tracker.lagging, 30, "the releases"
                )
                time.sleep(restart.WRITE_EVERY)
            next(published)
            next(it)
    wait_until(
        lambda: not tracker.lagging, 30, "the state file to be written"
    )  # (a first send's write: soon after)
    path = restart.state_path(producer.endpoint)
    assert path.stat().st_mode & 0o077 == 0 and path.parent == endpoint.runtime_dir()  # private
    data = path.read_bytes()
    producer.close()  # a clean end removes the file: put back what a crash would have left
    assert not path.exists()
    path.write_bytes(data)
    return path


def test_a_clean_end_removes_the_state_file_and_a_fresh_start_writes_one(name):
    path = _state_of_a_run(name, restart_pipeline.seeded(), 5)
    state = restart.read(path)
    # the consumer released batches 0..3 and holds (or just dropped) batch 4
    assert (state.point.epoch, state.point.index) == (0, 4) and state.loader["mode"] == "rerun"
    with Producer(restart_pipeline.seeded(), name=name):  # a fresh stream: the old state must go
        assert not path.exists()


@pytest.mark.parametrize("resume", [True, False])
def test_a_state_file_write_cut_short_by_a_kill_leaves_nothing_once_the_name_is_served_again(name, resume):
    """The temporary file a producer SIGKILLed while it wrote its state left behind goes when
    the name is served again (by a successor, or a fresh stream); another name's stays."""
    path = restart.state_path(endpoint.resolve(name))
    leftover = path.with_name(f".{path.name}.x1y2z3ab.tmp")
    other = path.with_name(f".{path.name}-other.state.x1y2z3ab.tmp")
    for p in (leftover, other):
        p.write_bytes(b"half a state")
    try:
        with Producer(restart_pipeline.seeded(), name=name, resume=resume):
            assert not leftover.exists() and other.exists()
    finally:
        other.unlink()


def test_a_fresh_producer_that_cannot_bind_leaves_the_serving_ones_state_file():
    """A tcp endpoint has no lock file: a second producer without resume on one already served
    fails to bind, and must leave the state of the one serving there (stalled, it may not write
    again for long: a crash then would lose the stream). Before, it removed the file first."""
    address = f"tcp://127.0.0.1:{free_port()}"
    path = restart.state_path(address)
    with Producer(restart_pipeline.seeded(), endpoint=address, resume=True, slots=2) as serving:
        with Consumer(endpoint=address, late_join="now") as consumer:
            it, published = iter(consumer), iter(serving)
            next(published)
            held = next(it)
            assert path.exists()
            with pytest.raises(RuntimeError, match="Address already in use"):
                Producer(restart_pipeline.seeded(), endpoint=address)
            assert path.exists()
            del held


def test_a_stateful_successor_that_dies_at_once_can_itself_be_resumed(name):
    """The successor's first state names the point it restarted at, with the loader's state
    there (not after the batch it pulled to check it), so its own successor resumes too."""
    path = _state_of_a_run(name, restart_pipeline.stateful(), 5)
    before = restart.read(path).point
    _state_of_a_run(name, restart_pipeline.stateful(), 1)  # resumes, publishes one, "dies"
    assert restart.read(path).point.index >= before.index
    with Producer(restart_pipeline.stateful(), name=name, resume=True) as third:  # no ValueError
        assert third.epoch == 0


class _Unreadable(restart_pipeline.Augmented):
    """The same dataset, failing as a DataLoader does when a worker was killed."""

    def __getitem__(self, i: int) -> Any:
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")


def test_a_loader_failing_in_a_successors_rerun_raises_its_own_error_and_keeps_the_state(name):
    """The loader's own error (a worker killed), not a StateFileError telling the user to
    remove a good state file (and from the CLI, a usage error)."""
    path = _state_of_a_run(name, restart_pipeline.seeded(), 5)
    failing = torch.utils.data.DataLoader(_Unreadable(96, 0.0), batch_size=4, shuffle=True)
    with pytest.raises(RuntimeError, match="is killed by signal") as info:
        Producer(failing, name=name, resume=True)
    assert not isinstance(info.value, StateFileError)
    assert path.exists()
    with Producer(restart_pipeline.seeded(), name=name, resume=True) as successor:  # it resumes
        assert successor.epoch == 0 and successor._publisher.resumed is not None


def test_a_point_taken_before_a_join_does_not_undo_the_joiners_write(tmp_path):
    """The publishing thread takes a point under the producer's lock and writes it after;
    between, the I/O thread may write a joiner's older one, which must stay."""
    loader = restart_pipeline.seeded()
    tracker = restart.Tracker(tmp_path / "x.state", loader, restart.describe(loader, 24, 96), "stream")
    tracker.epoch_started(0, 0)
    for seq in range(6):
        tracker.fingerprinted(seq, 0, seq, fingerprint=seq)
        tracker.published(seq, 0, 0, seq)
    taken_before = (5, 0, 1, 0)  # (restart point, keep from, consumers, joins)
    tracker.save(2, 0, 2, 1, force=True)  # the I/O thread: a joiner replays from batch 2
    tracker.save(*taken_before, force=True)
    assert restart.read(tracker.path).point.index == 2
    tracker.save(4, 0, 2, 1, force=True)  # a point taken after the join is written
    assert restart.read(tracker.path).point.index == 4


def _with_a_bad_python_rng_state(path: Any) -> None:
    """Readable, but random.setstate refuses its Python generator's state (a fuzzing helper
    found its ValueError did not name the file)."""
    state = restart.read(path)
    rng = {**state.point.rng, "python": [3, [1, 2], None]}
    restart.write(
        path, restart.encode(dataclasses.replace(state, point=dataclasses.replace(state.point, rng=rng)))
    )


def _with_a_bad_restarted_stream(path: Any) -> None:
    """Readable, but the stream it started again is not [stream id, epoch]."""
    restart.write(path, restart.encode(dataclasses.replace(restart.read(path), restarted=["x" * 65, 0])))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(b"\x00garbage"), "not a readable producer state"),
        (lambda p: torch.save({"weights": torch.zeros(2)}, p), "not a tensorsocket producer state"),
        (
            lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
            "not a readable producer state",
        ),
        (lambda p: torch.save(_Hostile(), p), "not a readable producer state"),
        (_with_a_bad_python_rng_state, "state vector is the wrong size"),  # (random.setstate's words)
        (_with_a_bad_restarted_stream, "is damaged: bad restarted stream"),
    ],
    ids=["garbage", "foreign", "truncated", "hostile", "bad-rng", "bad-restarted"],
)
def test_a_damaged_state_file_is_refused_by_name_and_never_resumed(name, damage, message, tmp_path):
    path = _state_of_a_run(name, restart_pipeline.seeded(), 5)
    os.environ["TENSORSOCKET_TEST_PWNED"] = str(tmp_path / "pwned")
    damage(path)
    with pytest.raises(StateFileError, match=message) as info:  # (a ValueError, as before)
        Producer(restart_pipeline.seeded(), name=name, resume=True)
    assert str(path) in str(info.value) and "remove it to begin a fresh stream" in str(info.value)
    assert "weights_only" not in str(info.value)  # (torch's advice to load it unsafely)
    assert not (tmp_path / "pwned").exists()  # weights_only: nothing in the file ran
    restart.remove(path)


class _Hostile:
    """Unpickling this would run a shell command (a plain torch.load would)."""

    def __reduce__(self) -> Any:
        return (os.system, ('touch "$TENSORSOCKET_TEST_PWNED"',))


@pytest.mark.parametrize(
    "other",
    [lambda: restart_pipeline.seeded(n=100), lambda: [torch.zeros(2)] * 24],
    ids=["another-dataset-length", "another-loader"],
)
def test_a_state_saved_over_another_loader_is_refused(name, other):
    path = _state_of_a_run(name, restart_pipeline.seeded(), 5)
    with pytest.raises(ValueError, match="was saved by a producer over"):
        Producer(other(), name=name, resume=True)
    with Producer(other(), name=name) as fresh:  # without resume: a fresh stream, as documented
        assert fresh.epoch == 0
    restart.remove(path)


def test_resume_needs_an_endpoint_consumers_can_find_again():
    with pytest.raises(ValueError, match="fixed endpoint"):
        Producer([torch.zeros(1)], endpoint="tcp://127.0.0.1:*", resume=True)


def test_only_a_stateful_loader_without_workers_is_resumed_from_its_state():
    """A StatefulDataLoader's saved state does not hold its workers' random states: with
    workers it is resumed as a plain DataLoader (the five-kill test runs both)."""
    assert restart.mode_of(restart_pipeline.stateful()) == restart.STATEFUL
    assert restart.mode_of(restart_pipeline.stateful_workers()) == restart.RERUN
    assert restart.mode_of(restart_pipeline.seeded()) == restart.RERUN
