"""``benchmarks.gpu_decode``'s summary: medians per way, the issue's ratios, and no verdict on
the CPU stand-in. (Its runs are ``benchmarks.compare``'s; ``--smoke`` runs it end to end.)"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.gpu_decode import HOSTED, PRIVATE, SHARED_CPU, SHARED_GPU, main, summarise, table


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
    run(HOSTED, 190.0, 9000.0, [2700.0, 600.0, 600.0, 600.0]),
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
    assert summary["shared_vs_private_rate"] == 2.5 and summary["shared_rate_target_met"] is True
    assert summary["shared_vs_private_gpu_mib_device_peak_over_idle"] == 0.62
    assert summary["shared_memory_target_met"] is True
    assert summary["hosted_vs_private_rate"] == 1.9 and summary["hosted_rate_target_met"] is False
    assert summary["hosted_vs_private_gpu_mib_processes_sum"] == 0.56
    assert summary["hosted_memory_target_met"] is False  # the device's peak: 9000 against 8000
    lines = table(summary).splitlines()
    assert (
        f"{SHARED_GPU} vs the private pipelines: 2.50x per trainer (target 2x: met), GPU memory target (less): met"
        in lines
    )
    assert (
        f"{HOSTED} vs the private pipelines: 1.90x per trainer (target 2x: not met), GPU memory target (less): not met"
        in lines
    )
    slower = summarise([r for r in RUNS if r["system"] != SHARED_GPU] + [run(SHARED_GPU, 150.0, 9000.0, [])])
    assert slower["shared_rate_target_met"] is False and slower["shared_memory_target_met"] is False


def test_the_stand_in_is_not_judged() -> None:
    summary = summarise(RUNS, fake=True)
    assert summary["shared_vs_private_rate"] == 2.5
    assert not [key for key in summary if key.endswith("_target_met")]
    text = table(summary)
    assert "(target 2x: not judged)" in text and "no GPU was used" in text


@pytest.mark.parametrize("ways", ["foo", "", f"{PRIVATE},shared"])
def test_an_unknown_way_is_refused_before_anything_runs(
    ways: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--ways", ways, "--no-write"])
    assert (
        f"--ways takes {PRIVATE}, {SHARED_GPU}, {HOSTED}, {SHARED_CPU}; got {ways!r}"
        in capsys.readouterr().err
    )
