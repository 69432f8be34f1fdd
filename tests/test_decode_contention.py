"""``benchmarks.decode_contention`` end to end on the CPU (``--smoke``): the pipeline process
and the trainer processes are real, pinned to their cores; its figures mean nothing here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import decode_contention


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for the pipeline, one for the trainer"
)
def test_the_smoke_run_measures_the_three_conditions(tmp_path: Path) -> None:
    decode_contention.main(["--smoke", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("decode_contention-smoke-*.json")
    result = json.loads(path.read_text())
    runs = {r["condition"]: r for r in result["runs"]}
    mine, other = sorted(os.sched_getaffinity(0))[:2]
    assert list(runs) == [
        "alone",
        "trainers on other cores (GPU shared)",
        "trainers on its cores (GPU and CPU)",
    ]
    assert [r["trainer_cores"] for r in runs.values()] == [None, [other], [mine]]
    assert all(
        r["pipeline_cores"] == [mine] and r["samples_per_s"] > 0 and r["cpu_s"] > 0 for r in runs.values()
    )
    for name in list(runs)[1:]:  # the trainers trained before and through the measurement
        assert runs[name]["trainers_alive_after"] == 1 and runs[name]["trainer_samples_per_s"][0] > 0
        assert 0 < runs[name]["trainers_training_after_s"] < 90
    assert result["vs_alone"]["alone"] == 1.0 and "gpu" in result["machine"]
    assert set(result["machine"]["thread_siblings"]) == {str(mine), str(other)}


def test_a_trainer_that_cannot_start_is_reported_with_its_stderr(tmp_path: Path) -> None:
    """No fixed sleep: the benchmark waits until every trainer trains, and one that dies
    (here: an unknown model) stops the run with its traceback, leaving no process behind."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    args = decode_contention.parse(["--smoke", "--out", str(tmp_path)])
    args.model = "no_such_model"
    with pytest.raises(RuntimeError, match="no_such_model") as exc:
        decode_contention.condition(args, "beside a broken trainer", cores[:1], cores[1:2], tmp_path)
    assert "not all training" in str(exc.value)


def test_too_few_cores_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        decode_contention.main(["--cores", str(len(os.sched_getaffinity(0)))])
    assert exc.value.code == 2 and "cores here" in capsys.readouterr().err
