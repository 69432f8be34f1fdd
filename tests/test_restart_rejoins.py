"""Whom a successor waits for before it publishes: its predecessor's consumers that had
something to lose, counted by their rejoins. Real processes: a resumable producer SIGKILLed,
a ``tensorsocket serve --resume`` successor, trainers spawned."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

from tensorsocket import TensorSocketError, endpoint
from tensorsocket.cli.query import query_status
from tensorsocket.producer import restart
from tests import restart_pipeline
from tests.support import SPAWN, wait_until
from tests.test_restart import EPOCHS, _consume, _first_difference, _publish_then_die, _serve


def _trainer(name: str, label: str, out: Any) -> None:
    try:
        _consume(name, {"label": label}, out)
    except TensorSocketError as exc:
        out.put({"options": {"label": label}, "error": f"{type(exc).__name__}: {exc}"})


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
    first = SPAWN.Process(target=_publish_then_die, args=(name, 6, die))
    first.start()
    trainers = {
        label: SPAWN.Process(target=_trainer, args=(name, label, out)) for label in ("steady", "stopped")
    }
    for p in trainers.values():
        p.start()
    address = endpoint.resolve(name)
    state = restart.state_path(address)
    wait_until(
        lambda: (
            state.exists() and restart.read(state).point.index >= 4 and restart.read(state).consumers == 2
        ),
        60,
        "both trainers to receive 4 batches",
    )
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
