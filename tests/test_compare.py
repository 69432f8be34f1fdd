"""The side-by-side benchmark's harness (``benchmarks.compare``): a small real run of two of its
systems, and its verdicts on reports that went wrong. The PyPI 0.0.5 system is left to the
benchmark itself: installing it needs the network and running it takes minutes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.compare import Watcher, _judge, summarise, table, verdict

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--trainers", "1,zero"], "--trainers must be positive integers"),
        (["--systems", "independent,coordl"], "unknown coordl"),
        (["--producer-workers", "-1"], "--producer-workers must be 0 or more"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str], said: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        compare.main(argv)
    assert exited.value.code == 2 and said in capsys.readouterr().err


TINY_TORCHVISION = """
import torch

class models:
    @staticmethod
    def resnet18(num_classes):
        return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, num_classes))
"""


def test_small_run_of_two_systems_with_the_model_alone_reference_is_exact_and_written(tmp_path: Path) -> None:
    """Both systems at 2 trainers, exact, written and tabled. With ``--model``, a
    model-alone run at every N (no loader, one synthetic batch) gives each summary row its
    ``model_ceiling``; the one shared loader (producer, loader alone) gets ``--cpus`` workers
    by default, independent trainers ``--workers``. torchvision is not installable here, so a
    stand-in provides a small model under its name. (One run of the harness: each costs
    every process's torch import.)"""
    (tmp_path / "stand-in" / "torchvision").mkdir(parents=True)
    (tmp_path / "stand-in" / "torchvision" / "__init__.py").write_text(TINY_TORCHVISION)
    paths = [str(tmp_path / "stand-in"), os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cpus = min(2, len(os.sched_getaffinity(0)))  # both cores where there are two: 35 s, not 60
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--systems", "independent,tensorsocket", "--trainers", "2",
         "--images", "48", "--epochs", "2", "--model", "resnet18", "--cpus", str(cpus), "--workers", "2",
         "--timeout", "90", "--out", str(tmp_path), "--tag", "test"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("test-*.json")
    result = json.loads(path.read_text())
    assert [(r["system"], r["trainers"]) for r in result["runs"]] == [
        ("loader-alone", 1), ("model-alone", 2), ("independent", 2), ("tensorsocket", 2),
    ]  # fmt: skip
    for run in result["runs"]:
        assert run["exact"], run["problems"]
        assert run["delivered_samples_per_trainer"] == [96] * run["trainers"]  # (32 + 16) x 2
        assert run["per_trainer_samples_per_s"] > 0 and run["cpu_s"] > 0 and run["peak_pss_mib"] > 0
    alone, model, independent, shared = (result["runs"][i] for i in (0, 1, 2, 3))
    assert [p["role"] for p in model["processes"]] == ["synthetic-trainer"] * 2
    assert [p["workers"] for p in alone["processes"]] == [cpus]
    assert [p["workers"] for p in independent["processes"]] == [2, 2]
    assert [p["role"] for p in shared["processes"]] == ["ts-producer", "ts-trainer", "ts-trainer"]
    assert [p.get("workers") for p in shared["processes"]] == [cpus, None, None]
    assert result["config"]["producer_workers"] == cpus and result["config"]["workers"] == 2
    assert [row["trainers"] for row in result["summary"]] == [2]
    [row] = result["summary"]
    assert "vs_independent" in row and "gap_to_loader_pct" in row
    assert (
        row["model_ceiling"] == model["per_trainer_samples_per_s"] > 0 and row["model_ceiling_ok"] == "exact"
    )
    assert "| 2 |" in done.stdout and "| the model alone, no loader (the bound) |" in done.stdout
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / path.with_suffix(".png").name).exists() == has_matplotlib
    assert result["machine"]["cpus_used"] == cpus and result["config"]["counts"] == [2]


CFG = {"images": 64, "epochs": 1, "timeout": 30.0, "memory_cap_kib": None}


def _trainer(rank: int, prints: list[str], complete: bool = True, rate: float = 100.0) -> dict:
    return {
        "role": "ts-trainer", "rank": rank, "returncode": 0 if complete else -9, "log": "x.log",
        "complete": complete, "batches_per_epoch": [len(prints)], "samples_per_epoch": [32 * len(prints)],
        "fingerprints": [prints], "samples_per_s": rate,
    }  # fmt: skip


def _judged(reports: list[dict], stalled: bool = False, system: str = "tensorsocket") -> dict:
    return _judge(system, len(reports), CFG, reports, stalled, False, 20.0, 1.0, Watcher())


def test_verdicts() -> None:
    good = _judged([_trainer(0, ["a", "b"]), _trainer(1, ["a", "b"])])
    assert good["exact"] and verdict(good) == "exact" and good["per_trainer_samples_per_s"] == 100.0

    different = _judged([_trainer(0, ["a", "b"]), _trainer(1, ["a", "c"])])
    assert not different["exact"] and "did not get the same batches" in " ".join(different["problems"])
    assert _judged([_trainer(0, ["a", "c"]), _trainer(1, ["a", "b"])], system="independent")["exact"]

    twice = _judged([_trainer(0, ["a", "a"])])
    assert not twice["exact"] and "twice" in " ".join(twice["problems"])

    short = _judged([_trainer(0, ["a"])])
    assert verdict(short) == "not exact, 32/64 samples"

    # A trainer that never finished is rated by what it got over the whole time it was given.
    hung = _judged([_trainer(0, ["a", "b"]), _trainer(1, ["a"], complete=False, rate=500.0)], stalled=True)
    assert verdict(hung) == "stalled, 32/64 samples"
    assert hung["min_trainer_samples_per_s"] == pytest.approx(32 / 20.0)

    crashed = _trainer(1, ["a", "b"])
    crashed["returncode"] = 1
    assert "exited with 1" in " ".join(_judged([_trainer(0, ["a", "b"]), crashed])["problems"])


def test_summary_ratios_and_table() -> None:
    def run(system: str, n: int, rate: float, exact: bool = True) -> dict:
        return {"system": system, "trainers": n, "per_trainer_samples_per_s": rate, "exact": exact,
                "stalled": False, "problems": [] if exact else ["x"], "delivered_samples_per_trainer": [10],
                "expected_samples_per_trainer": 20}  # fmt: skip

    runs = [run("loader-alone", 1, 800.0), run("independent", 4, 200.0), run("tensorsocket", 4, 760.0),
            run("tensorsocket-0.0.5", 4, 38.0, exact=False)]  # fmt: skip
    [row] = summarise(runs)
    assert row["vs_independent"] == 3.8 and row["vs_0.0.5"] == 20.0 and row["gap_to_loader_pct"] == 5.0
    text = table({"summary": [row]})
    assert "| 4 | 200 | 760 | 38 (not exact, 10/20 samples) | 3.80x | 20.00x | 5.0% |" in text

    [row] = summarise([*runs, run("model-alone", 4, 300.0), run("model-alone", 4, 320.0),
                       run("model-alone", 4, 280.0)])  # fmt: skip
    assert row["model_ceiling"] == 300.0 and row["model_ceiling_ok"] == "exact"
    text = table({"summary": [row]})
    assert "| 4 | 200 | 760 | 38 (not exact, 10/20 samples) | 300 | 3.80x | 20.00x | 5.0% |" in text


def test_a_trainer_can_train_a_model_on_each_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model``: real forward/backward/SGD on each batch. torchvision's CPU build is not
    installable on this machine, so a stand-in provides a small model under its name."""
    import types

    import torch

    from benchmarks.compare_roles import Report, train

    def tiny(num_classes: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, num_classes)
        )

    built: list[tuple[torch.nn.Module, list[torch.Tensor]]] = []

    def resnet18(num_classes: int) -> torch.nn.Module:
        model = tiny(num_classes)
        built.append((model, [p.detach().clone() for p in model.parameters()]))
        return model

    monkeypatch.setitem(
        sys.modules, "torchvision", types.SimpleNamespace(models=types.SimpleNamespace(resnet18=resnet18))
    )
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.rand(4, 3, 224, 224, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)
    ]
    report = Report(str(tmp_path / "r.json"))
    train(batches, 2, 0.0, report, model="resnet18")
    [(model, initial)] = built
    assert report.data["complete"] and report.data["batches_per_epoch"] == [3, 3]
    assert all(p.grad is not None for p in model.parameters())  # backward ran on the batches
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True))  # SGD stepped
    assert json.loads((tmp_path / "r.json").read_text())["samples_per_epoch"] == [12, 12]

    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(SystemExit, match="--model resnet18 needs torchvision"):
        train(batches, 1, 0.0, Report(str(tmp_path / "s.json")), model="resnet18")


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="tests the reason given where there is no CUDA GPU"
)
def test_gpu_system_is_reported_not_run_without_cuda_and_repeat_keeps_every_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TENSORSOCKET_FAKE_CUDA"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--systems", "tensorsocket-gpu", "--trainers", "1",
         "--images", "32", "--epochs", "1", "--step-ms", "1", "--repeat", "2", "--timeout", "60",
         "--out", str(tmp_path), "--tag", "test"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("test-*.json")
    result = json.loads(path.read_text())
    assert [(r["system"], r.get("run")) for r in result["runs"]] == [
        ("loader-alone", 1), ("tensorsocket-gpu", 1), ("loader-alone", 2), ("tensorsocket-gpu", 2)
    ]  # fmt: skip
    gpu = result["runs"][1]
    assert gpu["per_trainer_samples_per_s"] is None and "not run: no CUDA GPU" in gpu["problems"][0]
    assert "TENSORSOCKET_FAKE_CUDA=1" in gpu["problems"][0]
    [row] = result["summary"]
    assert row["tensorsocket-gpu"] is None and row["tensorsocket-gpu_ok"] == "not run"
    assert result["config"]["repeat"] == 2 and result["config"]["gpu_path"].startswith("no CUDA GPU")
    assert "tensorsocket-gpu: not run: no CUDA GPU" in done.stdout
    assert "median of 2 runs" in done.stdout and "| not run: no CUDA GPU" in done.stdout


def test_summary_of_repeats_quotes_the_median_and_the_gpu_columns() -> None:
    def run(system: str, rate: float, exact: bool = True, rep: int = 1) -> dict:
        return {"system": system, "trainers": 4, "per_trainer_samples_per_s": rate, "exact": exact,
                "stalled": False, "problems": [] if exact else ["x"], "delivered_samples_per_trainer": [10],
                "expected_samples_per_trainer": 20, "run": rep, "of": 3}  # fmt: skip

    runs = [run("independent", r) for r in (190.0, 200.0, 260.0)]
    runs += [run("tensorsocket", r) for r in (700.0, 760.0, 750.0)]
    runs += [
        run("tensorsocket-gpu", 800.0),
        run("tensorsocket-gpu", 900.0, exact=False),
        run("tensorsocket-gpu", 780.0),
    ]
    [row] = summarise(runs)
    assert row["independent"] == 200.0 and row["tensorsocket"] == 750.0 and row["tensorsocket-gpu"] == 800.0
    assert row["tensorsocket_runs"] == [700.0, 760.0, 750.0]
    assert row["tensorsocket-gpu_ok"] == "not exact, 10/20 samples; 1 of 3 runs"
    assert (
        row["vs_independent"] == 3.75 and row["gpu_vs_independent"] == 4.0 and row["gpu_vs_host_path"] == 1.07
    )
    text = table({"summary": [row], "config": {"repeat": 3}})
    assert "median of 3 runs" in text and "| tensorsocket, GPU path |" in text
    assert (
        "| 4 | 200 | 750 | 800 (not exact, 10/20 samples; 1 of 3 runs) | not run | 3.75x |  |  | 4.00x | 1.07x |"
        in text
    )


def _run_once_apart(env: dict[str, str], cfg: dict, rundir: Path, out: Any) -> None:
    """``compare.run_once`` in a process of its own: it reaps every child of its process (the
    orphans of the run's processes), which in pytest's would be the forkserver's and the
    resource tracker's too."""
    os.environ.update(env)  # (what the run's processes inherit)
    out.put(compare.run_once(compare.GPU_SYSTEM, 2, cfg, None, rundir))


def test_a_producer_hosted_in_a_trainers_process_serves_it_and_the_others_exactly(tmp_path: Path) -> None:
    """``hosted``: the producer serves from a thread of trainer 0's process (issue 17's way to a
    CUDA context fewer), on the GPU path's CPU stand-in. Every trainer gets every batch once and
    the same batches; the hosting process is a trainer, and no producer process is started.
    Each trains a model (the torchvision stand-in), the hosting one's made before its producer
    starts."""
    from producer.imagefolder import make_dataset
    from tests.support import SPAWN

    (tmp_path / "stand-in" / "torchvision").mkdir(parents=True)
    (tmp_path / "stand-in" / "torchvision" / "__init__.py").write_text(TINY_TORCHVISION)
    paths = [str(tmp_path / "stand-in"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), compare.FAKE_CUDA: "1"}
    cfg = CFG | {
        "data": str(make_dataset(tmp_path / "jpeg", count=48)), "images": 48, "epochs": 2, "workers": 1,
        "producer_workers": 1, "step_ms": 1.0, "timeout": 90.0, "model": "resnet18", "hosted": True,
    }  # fmt: skip
    out = SPAWN.Queue()
    apart = SPAWN.Process(target=_run_once_apart, args=(env, cfg, tmp_path / "run", out))
    apart.start()
    try:
        run = out.get(timeout=240)
    finally:
        apart.join(timeout=30)
    assert run["exact"], run["problems"]
    assert run["delivered_samples_per_trainer"] == [96, 96]
    hosting, other = run["processes"]
    assert (hosting["role"], hosting["rank"], other["role"], other["rank"]) == (
        "ts-hosting-trainer", 0, "ts-trainer", 1
    )  # fmt: skip
    assert hosting["hosts_producer"] and hosting["device"] == compare.GPU_DEVICE
    assert hosting["producer"]["published"] == 4  # 2 epochs of 32 + 16
    assert hosting["pid"] != other["pid"]
