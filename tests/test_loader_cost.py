"""``benchmarks.loader_cost``: the loader alone, a model of sharing's copies, and the shared
producer with and without its replay budget, in turn, the order rotated each round (one round here). A small
real run (JPEGs, DataLoader workers, reader processes, a producer and consumers over real
sockets and shared memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.loader_cost import MODES, rounds


@pytest.mark.usefixtures("fresh_benchmark_processes")
def test_rounds_rotate_the_ways_and_attribute_each_process(tmp_path: Path) -> None:
    result = rounds(1, trainers=2, step_ms=1, workers=1, epochs=2, images=64, data=tmp_path / "jpeg")
    assert [r["order"] for r in result["rounds"]] == [list(MODES)]
    assert result["exact"] is True
    for r in result["rounds"]:
        # each way's own processes were found and charged: the model's readers apart from the
        # loader's workers, the producer apart from its consumers
        assert r["model"]["readers"] > 0 and r["model"]["loader_workers"] > 0 and r["model"]["trainer"] > 0
        for way in ("single", "shared", "shared-replay0"):
            assert r[way]["loader_workers"] > 0 and r[way]["trainers"] > 0
        assert r["shared"]["producer"] > 0 and r["shared-replay0"]["producer"] > 0
    ratios = result["paired"]["workers_shared_over_replay0"]
    assert ratios == [
        round(r["shared"]["loader_workers"] / r["shared-replay0"]["loader_workers"], 3)
        for r in result["rounds"]
    ]
    assert result["config"]["rounds"] == 1 and result["config"]["images"] == 64
