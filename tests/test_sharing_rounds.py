"""``benchmarks.sharing.rounds``: the loader alone and the shared producer in turn, the order
swapped each round, summarised by medians. A small real run (JPEGs, DataLoader workers, a
producer and consumers over real sockets and shared memory)."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.sharing import rounds


def test_rounds_alternate_and_summarise_what_each_round_measured(tmp_path: Path) -> None:
    result = rounds(
        2, trainers=2, step_ms=1, images=64, epochs=2, workers=1, data=tmp_path / "jpeg", log=lambda *a: None
    )
    assert [r["order"] for r in result["rounds"]] == [["single", "shared"], ["shared", "single"]]
    summary = result["summary"]
    assert summary["exact"] is True
    gaps = [r["per_trainer_samples_per_s"]["shared_gap_to_single_pct"] for r in result["rounds"]]
    assert summary["gap_pct"] == gaps
    assert summary["gap_pct_median"] == round(statistics.median(gaps), 2)
    for r, own in zip(result["rounds"], summary["tensorsocket_cpu_ms_per_batch"], strict=True):
        cpu = r["cpu_ms_per_batch"]
        assert cpu["shared"]["producer"] > 0 and cpu["single"]["loader_workers"] > 0
        expected = cpu["shared"]["producer"] + cpu["shared"]["trainers"] - cpu["single"]["trainers"]
        assert own == round(expected, 2)
    assert result["config"]["rounds"] == 2 and result["config"]["trainers"] == 2
