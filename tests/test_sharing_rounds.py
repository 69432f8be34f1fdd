"""``benchmarks.sharing.rounds``: the loader alone and the shared producer in turn, the order
swapped each round, summarised by medians. A small real run (JPEGs, DataLoader workers, a
producer and consumers over real sockets and shared memory)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.sharing import rounds


@pytest.mark.usefixtures("fresh_benchmark_processes")
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
    slowest = [r["per_trainer_samples_per_s"]["slowest_shared_gap_to_single_pct"] for r in result["rounds"]]
    assert summary["slowest_gap_pct"] == slowest
    assert all(s >= g for s, g in zip(slowest, gaps, strict=True))  # the slowest is at most the mean
    later = [r["per_trainer_samples_per_s"]["after_first_epoch_gap_to_single_pct"] for r in result["rounds"]]
    assert summary["after_first_epoch_gap_pct"] == later
    assert summary["after_first_epoch_gap_pct_median"] == round(statistics.median(later), 2)
    for r, own in zip(result["rounds"], summary["tensorsocket_cpu_ms_per_batch"], strict=True):
        cpu = r["cpu_ms_per_batch"]
        assert cpu["shared"]["producer"] > 0 and cpu["single"]["loader_workers"] > 0
        expected = cpu["shared"]["producer"] + cpu["shared"]["trainers"] - cpu["single"]["trainers"]
        assert own == round(expected, 2)
    assert result["config"]["rounds"] == 2 and result["config"]["trainers"] == 2


def test_a_trainer_reports_its_rate_past_the_first_epoch() -> None:
    """The rate past the first epoch counts the samples after the second epoch's first batch,
    over the time since it; with one epoch there is none."""
    import torch

    from benchmarks.sharing import _train

    batch = (torch.zeros(2, 3, 224, 224), torch.zeros(2, dtype=torch.int64))
    two = _train([batch] * 3, epochs=2, step_s=0.1)
    assert two["samples"] == 5 * 2  # (after the first batch of the run)
    assert two["later_samples"] == 2 * 2  # the second epoch's 2 batches after its first
    # over the time from that first batch on: its step and the 2 batches' (0.3 s, and some:
    # a stall of the machine up to 1.2 s is allowed for)
    assert 4 / (5 * 0.3) < two["later_samples_per_s"] < 4 / 0.3
    assert _train([batch] * 3, epochs=1, step_s=0.0)["later_samples_per_s"] is None


def test_cpu_is_attributed_down_the_process_tree() -> None:
    """A DataLoader's worker counts as the loader's however far under its trainer or producer
    it runs (one started through a forkserver is the server's child); a process under neither
    is the benchmark's own. 32 samples: one batch, so the figures are ms of CPU."""
    from benchmarks.sharing import where_cpu_went

    window = {  # pid: [parent pid, user s, system s, children s]
        "10": [1, 0.5, 0.0, 0.0],  # the benchmark
        "20": [10, 0.2, 0.1, 0.0],  # the watching trainer
        "30": [10, 0.4, 0.0, 0.25],  # the producer, a worker of it gone
        "31": [30, 0.0, 0.0, 0.0],  # a forkserver the producer started
        "32": [31, 1.0, 0.5, 0.0],  # its worker
        "21": [20, 0.125, 0.0, 0.0],  # a worker of the trainer's own
    }
    trainer = {"pid": 20, "samples": 32, "cpu_window": window}
    roles = where_cpu_went([trainer], [{"pid": 30}])
    assert roles == {
        "trainers": 300.0, "producer": 400.0, "loader_workers": 1875.0, "other": 500.0, "total": 3075.0,
    }  # fmt: skip
