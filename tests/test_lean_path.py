"""``benchmarks.lean_path`` (part of ``benchmarks.protocol_cost``) end to end, small: its lean
producer and consumers speak the protocol themselves, so a change to a message breaks them
unseen unless something runs them (END's ``epoch`` field did, until a README walkthrough)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_way_runs_and_gets_every_batch_right(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.lean_path", "--batches", "50", "--repeat", "1"]
    proc = subprocess.run(
        [*command, "--consumers", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (written,) = tmp_path.glob("lean_path-*.json")
    runs = json.loads(written.read_text())["runs"]
    assert {r["variant"] for r in runs} == {"tensorsocket", "lean", "lean+threads"}
    for r in runs:
        assert r["every_batch"] is True and r.get("wrong_batches", 0) == 0, r


def test_a_benchmark_child_that_fails_ends_the_run_at_once_naming_it() -> None:
    """Before, each benchmark waited out its whole timeout (300 s) for a report a crashed
    child would never put on the queue."""
    from benchmarks.sharing import SPAWN, start_and_collect

    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=sys.exit, args=(3,))]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"0 of 1 processes reported; pids \[\d+\] failed"):
        start_and_collect(procs, out, 1, timeout=300)
    assert time.monotonic() - started < 60
    assert procs[0].exitcode == 3
