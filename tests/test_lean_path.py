"""``benchmarks.lean_path`` (part of ``benchmarks.protocol_cost``) end to end, small: its lean
producer and consumers speak the protocol themselves, so a change to a message breaks them
unseen unless something runs them (END's ``epoch`` field did, until a README walkthrough)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
