"""``benchmarks.gpu_decode``'s summary: medians per way, the issue's ratios, and no verdict on
the CPU stand-in. (Its runs are ``benchmarks.compare``'s; ``--smoke`` runs it end to end.)"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_decode import PRIVATE, SHARED_CPU, SHARED_GPU, summarise, table


def run(way: str, rate: float, device_mib: float | None, process_mib: list[float | None]) -> dict[str, Any]:
    return {
        "system": way, "trainers": 4, "per_trainer_samples_per_s": rate, "exact": True, "problems": [],
        "peak_gpu_mib_over_idle": device_mib, "gpu_util_mean_pct": 50.0,
        "processes": [{"pid": i, "peak_gpu_mib": mib} for i, mib in enumerate(process_mib)],
    }  # fmt: skip


RUNS = [
    run(PRIVATE, 100.0, 8000.0, [2000.0] * 4),
    run(PRIVATE, 120.0, 8400.0, [2100.0] * 4),
    run(PRIVATE, 80.0, 7600.0, [1900.0] * 4),
    run(SHARED_GPU, 250.0, 5000.0, [2500.0, 600.0, 600.0, None, 600.0]),
    run(SHARED_CPU, 150.0, 4000.0, [None] * 5),
]


def test_medians_ratios_and_targets() -> None:
    summary = summarise(RUNS)
    private, shared = summary["ways"][PRIVATE], summary["ways"][SHARED_GPU]
    assert private["per_trainer_samples_per_s"] == 100.0 and private["runs_samples_per_s"] == [
        100.0,
        120.0,
        80.0,
    ]
    assert private["gpu_mib_device_peak_over_idle"] == 8000.0 and private["gpu_mib_processes_sum"] == 8000.0
    assert shared["gpu_mib_processes_sum"] == 4300.0  # a process NVML did not list counts nothing
    assert summary["ways"][SHARED_CPU]["gpu_mib_processes_sum"] is None
    assert summary["shared_vs_private_rate"] == 2.5 and summary["rate_target_met"] is True
    assert summary["shared_vs_private_gpu_mib_device_peak_over_idle"] == 0.62
    assert summary["memory_target_met"] is True
    assert "(target 2x: met)" in table(summary)
    slower = summarise([r for r in RUNS if r["system"] != SHARED_GPU] + [run(SHARED_GPU, 150.0, 9000.0, [])])
    assert slower["rate_target_met"] is False and slower["memory_target_met"] is False


def test_the_stand_in_is_not_judged() -> None:
    summary = summarise(RUNS, fake=True)
    assert summary["shared_vs_private_rate"] == 2.5
    assert "rate_target_met" not in summary and "memory_target_met" not in summary
    text = table(summary)
    assert "(target 2x: not judged)" in text and "no GPU was used" in text
