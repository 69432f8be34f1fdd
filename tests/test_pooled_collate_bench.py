"""``benchmarks.pooled_collate``: the JPEG loader alone with torch's collate and with the one a
producer installs, in turn (one small round here: real DataLoader workers and shared memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pooled_collate import WAYS, rounds


@pytest.mark.usefixtures("fresh_benchmark_processes")
def test_a_round_runs_both_ways_and_their_batches_match(tmp_path: Path) -> None:
    result = rounds(1, epochs=2, step_ms=1, images=128, data=tmp_path / "jpeg")
    assert result["identical"] is True
    row = result["rounds"][0]
    assert set(row) == set(WAYS)
    assert row["default"]["buffers_tracked"] == 0 and row["pooled"]["buffers_tracked"] > 0
    for way in WAYS:
        assert row[way]["batches"] == 7  # 2 epochs of 4 batches, less the first (start-up)
        assert row[way]["workers_ms"] > 0 and row[way]["main_ms"] > 0
    assert result["paired_pooled_over_default"]["workers_ms"] == [
        round(row["pooled"]["workers_ms"] / row["default"]["workers_ms"], 3)
    ]
