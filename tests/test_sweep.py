"""``tensorsocket sweep`` end to end in real subprocesses, and ``consumer/train.py`` in both of
its modes."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tensorsocket import Producer
from tensorsocket.cli import sweep
from tensorsocket.host import pid_alive
from tests.support import shm_segments, unique_name, wait_until

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "consumer" / "train.py"
BATCHES, BATCH_SIZE = 3, 4

PIPELINE = """
import torch
from torch.utils.data import DataLoader, TensorDataset

def make(batches=2, batch_size=4, workers=0):
    g = torch.Generator().manual_seed(0)
    if workers:  # worker processes forked by the producer process
        images = torch.rand(batches * batch_size, 3, 8, 8, generator=g)
        labels = torch.arange(batches * batch_size)
        return DataLoader(TensorDataset(images, labels), batch_size=batch_size, num_workers=workers)
    return [(torch.rand(batch_size, 3, 8, 8, generator=g), torch.arange(batch_size)) for _ in range(batches)]

def broken():
    raise OSError("the dataset is not there")
"""

# Iterates the shared loader; exits 3 mid-stream (abruptly, holding a batch) for lr=0.2 and
# width=2, 5 before it even joins for a=1, hangs holding its first batch for hang=1, and for
# deaf=1 takes a SIGTERM for a note (the file ./termed) and goes on.
TRAINER = """
import argparse, json, os, signal, sys, time
from tensorsocket import Consumer

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--width", type=int, default=1)
p.add_argument("--a", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--step", type=float, default=0.01)
p.add_argument("--hang", type=int, default=0)
p.add_argument("--deaf", type=int, default=0)
args = p.parse_args()
if args.deaf:  # notes a SIGTERM, and goes on
    signal.signal(signal.SIGTERM, lambda *_: open("termed", "w").close())
print("pid", os.getpid(), flush=True)
if args.a == 1:
    sys.exit(5)
loader = Consumer()
samples, start = 0, time.perf_counter()
for epoch in range(args.epochs):
    for images, labels in loader:
        samples += len(labels)
        if args.lr == 0.2 and args.width == 2:
            os._exit(3)
        if args.hang:
            print("hanging", flush=True)
            time.sleep(3600)
        time.sleep(args.step)
loader.close()
rate = samples / (time.perf_counter() - start)
print("RESULT " + json.dumps({"loss": args.lr * args.width, "samples_per_s": rate, "samples": samples}))
"""


# Opens two consumers (a training and a validation one, say) before its first batch, each
# taken in a thread of its own, after waiting --delay seconds; prints each one's samples.
PAIR_TRAINER = """
import argparse, json, threading, time
from tensorsocket import Consumer

p = argparse.ArgumentParser()
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
time.sleep(args.delay)
consumers = [Consumer(label=label) for label in ("train", "val")]
samples = [0, 0]

def take(i):
    for epoch in range(args.epochs):
        for images, labels in consumers[i]:
            samples[i] += len(labels)
            time.sleep(0.05)

threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for c in consumers:
    c.close()
print("RESULT " + json.dumps({"loss": 0.0, "samples_per_s": 1.0, "samples": samples}))
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "pair.py").write_text(PAIR_TRAINER)
    return tmp_path


def run_sweep(workdir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a sweep; past ``timeout`` interrupt it (so it stops its trainers and producer)
    and fail."""
    command = [sys.executable, "-m", "tensorsocket.cli.sweep", *args]
    proc = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        pytest.fail(f"the sweep took over {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def producer_pids(logs: Path) -> list[int]:
    return [int(p) for p in re.findall(r"producer pid (\d+)", (logs / "producer.log").read_text())]


def test_sweep_2x2_grid_in_two_waves_with_one_failing_trial(workdir: Path) -> None:
    logs = workdir / "logs"
    proc = run_sweep(
        workdir,
        "--pipeline", "pipe.py:make",
        "--pipeline-arg", f"batches={BATCHES}",
        "--pipeline-arg", "workers=1",
        "--trainer", "python trainer.py --epochs 2",
        "--grid", "lr=0.1,0.2",
        "--grid", "width=1,2",
        "--parallel", "2",
        "--epochs", "2",
        "--logs", str(logs),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "wave 2/2: trial-03, trial-04" in proc.stdout
    summary = json.loads((logs / "summary.json").read_text())
    trials = summary["trials"]
    assert [t["trial"] for t in trials] == ["trial-01", "trial-02", "trial-03", "trial-04"]
    assert [t["params"] for t in trials] == [
        {"lr": 0.1, "width": 1},
        {"lr": 0.1, "width": 2},
        {"lr": 0.2, "width": 1},
        {"lr": 0.2, "width": 2},
    ]
    assert [t["exit_code"] for t in trials] == [0, 0, 0, 3]
    assert [t["status"] for t in trials] == ["done", "done", "done", "failed"]
    for t in trials[:3]:
        # Each good trial got the whole stream of its wave's producer, trial-03 although
        # its neighbour died mid-epoch.
        assert t["result"]["samples"] == 2 * BATCHES * BATCH_SIZE
        assert t["samples_per_s"] > 0
        assert t["loss"] == pytest.approx(t["params"]["lr"] * t["params"]["width"])
        assert t["command"][-4:] == ["--lr", str(t["params"]["lr"]), "--width", str(t["params"]["width"])]
    assert trials[3]["samples_per_s"] is None and trials[3]["loss"] is None
    for t in trials:
        assert Path(t["log"]).is_file() and "pid" in Path(t["log"]).read_text()
    rows = list(csv.DictReader((logs / "summary.csv").open()))
    assert [(r["trial"], r["lr"], r["width"], r["exit_code"]) for r in rows] == [
        ("trial-01", "0.1", "1", "0"),
        ("trial-02", "0.1", "2", "0"),
        ("trial-03", "0.2", "1", "0"),
        ("trial-04", "0.2", "2", "3"),
    ]
    assert re.search(r"trial-04\s+lr=0.2 width=2\s+failed\s+3\s+-\s+-", proc.stdout), proc.stdout
    assert "trial-04 failed" in proc.stdout  # not a terminal: one plain line per state change
    pids = producer_pids(logs)
    assert len(pids) == 2  # one producer run per wave
    for pid in pids:
        assert not pid_alive(pid) and shm_segments(pid) == []


def test_a_trial_past_its_timeout_is_stopped_and_the_trials_it_held_up_go_on(workdir: Path) -> None:
    """A trial that hangs holding a batch would hold its wave up for ever: --trial-timeout
    stops it (its process group), it counts as failed, 'timed out'. The other trial of its
    wave, which started with it and waited behind it (2 slots, 6 batches), is not charged
    that wait: it goes on and gets every batch (before: stopped too, 'timed out'). The limit
    leaves room for the trainers' own start (torch's import) on a loaded machine: at 8 s the
    good one's start and steps alone once passed it, with the suite's other process beside it."""
    logs = workdir / "logs"
    proc = run_sweep(
        workdir,
        "--pipeline", "pipe.py:make",
        "--pipeline-arg", f"batches={BATCHES}",
        "--trainer", "python trainer.py --epochs 2",
        "--grid", "hang=1,0",
        "--slots", "2",
        "--epochs", "2",
        "--trial-timeout", "20",
        "--logs", str(logs),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    hung, good = json.loads((logs / "summary.json").read_text())["trials"]
    assert (hung["status"], hung["exit_code"]) == ("timed out", -signal.SIGTERM)
    assert 20 < hung["elapsed_s"] < 20 + 10
    assert good["elapsed_s"] > 20  # it waited behind the hung one until that was stopped
    assert "hanging" in Path(hung["log"]).read_text()  # (it had joined and taken a batch)
    assert not pid_alive(_trainer_pid(Path(hung["log"])))
    assert good["status"] == "done" and good["result"]["samples"] == 2 * BATCHES * BATCH_SIZE
    assert "trial-01 timed out after" in proc.stdout
    assert re.search(r"trial-01\s+hang=1\s+timed out\s+-15", proc.stdout), proc.stdout
    for pid in producer_pids(logs):
        assert not pid_alive(pid) and shm_segments(pid) == []


def test_a_wave_waits_for_every_consumer_of_trials_that_open_two(workdir: Path) -> None:
    """With --consumers-per-trial 2 the wave's producer starts once both trials' two consumers
    joined: the first trial's two alone (counted as one consumer a trial, they started the
    stream) would leave the trial that joins 1.5 s later without its first epochs."""
    logs = workdir / "logs"
    proc = run_sweep(
        workdir,
        "--pipeline", "pipe.py:make",
        "--pipeline-arg", f"batches={BATCHES}",
        "--trainer", "python pair.py --epochs 2",
        "--grid", "delay=0,1.5",
        "--consumers-per-trial", "2",
        "--epochs", "2",
        "--logs", str(logs),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + _read(logs / "producer.log")
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["result"]["samples"] for t in trials] == [[2 * BATCHES * BATCH_SIZE] * 2] * 2
    assert "4 consumer(s) joined" in _read(logs / "producer.log")
    # what a wave that waits for consumers says meanwhile (a trial that opens fewer than
    # --consumers-per-trial would leave it waiting: this is where that shows)
    assert "2 of 4 consumer(s) joined or their trial exited" in _read(logs / "producer.log")


def test_ctrl_c_stops_trainers_and_producer(workdir: Path) -> None:
    """Also: the producer does not wait for a trial that exits before it joins (a=1)."""
    logs = workdir / "logs"
    proc = _start_serving_sweep(workdir, logs, "a=0,1")
    out = _stop(proc, lambda: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130, out
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["stopped", "failed"]
    assert trials[1]["exit_code"] == 5
    assert "1 consumer(s) joined" in _read(logs / "producer.log")
    _assert_all_gone(logs, trials)
    assert "closed" in _read(logs / "producer.log")


SLOW_PIPELINE = """
import pathlib, time

def make():
    pathlib.Path("making").touch()
    time.sleep(120)  # a pipeline that takes long to make (a large dataset's index, say)
    return [1, 2, 3]
"""


def test_ctrl_c_while_the_producer_makes_its_pipeline_stops_at_once(workdir: Path) -> None:
    """The producer reads the sweep's "stop" only once it is bound: before that (its pipeline
    function still running), Ctrl-C waited 15 s for it and then SIGKILLed it. It served nothing,
    so it is SIGTERMed at once, and says so in its log."""
    (workdir / "slow.py").write_text(SLOW_PIPELINE)
    logs = workdir / "logs"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tensorsocket.cli.sweep",
            "--pipeline", "slow.py:make",
            "--trainer", "python trainer.py",
            "--grid", "a=0",
            "--logs", str(logs),
        ],
        cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until((workdir / "making").exists, 60, "the producer to call its pipeline function")
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=40)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert took < 8.0, f"{took:.1f} s"
    assert "stopped while making the pipeline" in _read(logs / "producer.log")
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["not run"]


def _start_serving_sweep(
    workdir: Path,
    logs: Path,
    grid: str = "a=0",
    sweep: tuple[str, ...] = ("-m", "tensorsocket.cli.sweep"),
    trainer: str = "",
    output: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """A sweep of long trials (a=0: one that runs; a=1 exits before it joins), once its
    producer serves (``sweep``: what the interpreter runs, and options to add; ``trainer``:
    the trainer's options to add; ``output``: where the sweep writes)."""
    proc = subprocess.Popen(
        [
            sys.executable, *sweep,
            "--pipeline", "pipe.py:make",
            "--trainer", f"python trainer.py --epochs 100000 --step 0.2 {trainer}",
            "--grid", grid,
            "--epochs", "100000",
            "--logs", str(logs),
        ],
        cwd=workdir,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip

    def serving_started() -> bool:
        assert proc.poll() is None, _read(logs / "producer.log")
        return "serving 100000 epoch(s)" in _read(logs / "producer.log")

    try:
        wait_until(
            serving_started, 40, lambda: f"the sweep's producer to serve: {_read(logs / 'producer.log')}"
        )
    except BaseException:
        proc.kill()
        raise
    time.sleep(0.5)
    return proc


# The sweep, its status query for --trial-timeout swallowing what lands in it the first time
# (as msgpack's decode under an ``except Exception``, or a __del__, would); no answer after.
DEAF_SWEEP = """
import pathlib, sys, time
from tensorsocket.cli import sweep
from tensorsocket.cli.sweep import processes

calls = []

def deaf_status(endpoint, timeout):
    if not calls:
        calls.append(1)
        pathlib.Path("querying").touch()
        try:
            time.sleep(60)
        except {caught}:
            pathlib.Path("swallowed").touch()
    raise RuntimeError("no answer")

processes.query_status = deaf_status
sys.exit(sweep.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("caught", ["Exception", "BaseException"])
def test_a_stop_swallowed_where_it_landed_still_stops_the_sweep(workdir: Path, caught: str) -> None:
    """Before, the first signal set every stop signal to SIG_IGN and raised an Exception: an
    ``except Exception`` it landed in dropped it, and nothing short of SIGKILL stopped the
    sweep. Now it is not an Exception, and a second signal after one lost all the same (in
    code that swallows anything) stops the sweep too."""
    (workdir / "deaf_sweep.py").write_text(DEAF_SWEEP.format(caught=caught))
    logs = workdir / "logs"
    proc = _start_serving_sweep(workdir, logs, sweep=("deaf_sweep.py", "--trial-timeout", "1000"))

    def interrupt() -> None:
        wait_until((workdir / "querying").exists, 20, "the sweep's status query")
        proc.send_signal(signal.SIGINT)
        if caught == "BaseException":
            wait_until((workdir / "swallowed").exists, 20, "the query to swallow the first SIGINT")
            proc.send_signal(signal.SIGINT)

    out = _stop(proc, interrupt)
    assert proc.returncode == 130, out
    assert (workdir / "swallowed").exists() == (caught == "BaseException")
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["stopped"]
    _assert_all_gone(logs, trials)


def test_a_terminal_closed_while_the_sweep_stops_lets_it_write_its_summary(workdir: Path) -> None:
    """Ctrl-C, then the sweep's terminal closes while it stops the trials (one that does not
    stop on SIGTERM holds that up for 5 s). The SIGHUP is no second stop, but the output goes
    to /dev/null at once: before, it was ignored, and the next write to the closed terminal
    (EIO) ended the clean-up with a traceback and no summary."""
    terminal, sweep_side = pty.openpty()
    reading = threading.Event()
    reading.set()

    def read() -> None:  # (a terminal nobody reads fills up, and the sweep's writes block)
        while reading.is_set():
            if select.select([terminal], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    os.read(terminal, 4096)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    logs = workdir / "logs"
    try:
        proc = _start_serving_sweep(workdir, logs, trainer="--deaf 1", output=sweep_side)
    finally:
        os.close(sweep_side)
    try:
        _trainer_pid(logs / "trial-01.log")  # (it runs)
        proc.send_signal(signal.SIGINT)
        wait_until((workdir / "termed").exists, 10, "the sweep to SIGTERM its trial")
    finally:
        reading.clear()
        reader.join()
        os.close(terminal)
    out = _stop(proc, lambda: proc.send_signal(signal.SIGHUP))
    assert proc.returncode == 130, out
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["stopped"]
    _assert_all_gone(logs, trials)


# The sweep, its summary slow to write (a slow disk, say)
SLOW_SUMMARY_SWEEP = """
import pathlib, sys, time
from tensorsocket.cli import sweep
from tensorsocket.cli.sweep import launcher

write = launcher.write_summary

def slow(*args):
    pathlib.Path("summarizing").touch()
    time.sleep(3)
    write(*args)

launcher.write_summary = slow
sys.exit(sweep.main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_as_the_summary_is_written_is_ignored(workdir: Path) -> None:
    """Before: the signal handlers were given back before the summary was written, so a second
    Ctrl-C then ended the sweep with a traceback and no summary."""
    (workdir / "slow_summary.py").write_text(SLOW_SUMMARY_SWEEP)
    logs = workdir / "logs"
    proc = _start_serving_sweep(workdir, logs, sweep=("slow_summary.py",))

    def interrupt_twice() -> None:
        proc.send_signal(signal.SIGINT)
        wait_until((workdir / "summarizing").exists, 30, "the sweep to write its summary")
        proc.send_signal(signal.SIGINT)

    out = _stop(proc, interrupt_twice)
    assert proc.returncode == 130, out
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["stopped"]
    _assert_all_gone(logs, trials)


def _stop(proc: subprocess.Popen[str], send: Any) -> str:
    """``send()`` a serving sweep its stop; its output once it exited (killed if not in 40 s)."""
    try:
        send()
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def _assert_all_gone(logs: Path, trials: list[dict[str, Any]]) -> None:
    """Every trial's trainer and the wave's producer exited, and no shared memory is left."""
    (producer,) = producer_pids(logs)
    for pid in [*(_trainer_pid(Path(t["log"])) for t in trials), producer]:
        assert not pid_alive(pid), pid
    assert shm_segments(producer) == []


def _trainer_pid(log: Path) -> int:
    wait_until(lambda: re.search(r"^pid (\d+)", _read(log), re.M) is not None, 10, "the trainer's pid")
    return int(re.search(r"^pid (\d+)", _read(log), re.M).group(1))


def test_sighup_stops_trainers_and_producer_like_sigterm(workdir: Path) -> None:
    """A closed terminal (SIGHUP) stops the sweep in order, as SIGTERM does: the trainers, in
    sessions of their own, get no SIGHUP and would otherwise outlive it. Output that goes to
    a pipe or a file, not the terminal, keeps the summary table (it went to /dev/null too)."""
    logs = workdir / "logs"
    proc = _start_serving_sweep(workdir, logs)
    out = _stop(proc, lambda: proc.send_signal(signal.SIGHUP))
    assert proc.returncode == 128 + signal.SIGHUP, out
    assert "SIGHUP: stopping the trainers" in out and "summary.json and summary.csv in" in out, out
    trials = json.loads((logs / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["stopped"]
    _assert_all_gone(logs, trials)


def test_a_killed_sweeps_trainers_fail_instead_of_taking_the_cut_stream_for_a_finished_run(
    workdir: Path,
) -> None:
    """SIGKILL leaves the sweep no clean-up: its producer sees its stdin close and ends the
    stream with that reason, so the orphaned trainer raises ProducerLost (no RESULT line, a
    failed exit) rather than end its epochs early as if the stream had ended."""
    logs = workdir / "logs"
    proc = _start_serving_sweep(workdir, logs)
    log = logs / "trial-01.log"
    trainer = _trainer_pid(log)
    proc.kill()
    proc.communicate(timeout=10)
    (producer,) = producer_pids(logs)
    wait_until(
        lambda: not pid_alive(trainer) and not pid_alive(producer), 30, "the trainer and the producer to exit"
    )
    text = _read(log)
    assert "ProducerLost" in text and "sweep that started this producer is gone" in text, text
    assert "RESULT" not in text
    assert shm_segments(producer) == []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "lr"], "argument --grid: expected key=v1,v2,..."),
        (["--grid", "lr=0.1,,0.2"], "every value in key=v1,v2,... must be non-empty"),
        (["--grid", "lr=1", "--grid", "lr=2"], "--grid lr is given more than once"),
        (["--pipeline-arg", "x"], "argument --pipeline-arg: expected key=value"),
        (["--pipeline", "pipe.py"], "must be module:function or path/to/file.py:function"),
        (["--pipeline", "missing.py:make"], "pipeline file 'missing.py' does not exist"),
        (["--pipeline", "pipe.py:nothing"], "pipe.py has no function 'nothing'"),
        (["--pipeline", "no_such_module_here:make"], "no module named 'no_such_module_here'"),
        (["--trainer", "no-such-program-here --x"], "is not a program on PATH or a file"),
        (["--trial-timeout", "-1"], "argument --trial-timeout: expected a number of seconds >= 0"),
        (["--trial-timeout", "soon"], "argument --trial-timeout: expected a number of seconds, got 'soon'"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args, message
) -> None:
    monkeypatch.chdir(workdir)
    defaults = {"--pipeline": "pipe.py:make", "--trainer": "python trainer.py"}
    for option, value in defaults.items():
        if option not in args:
            args = [option, value, *args]
    assert sweep.main([*args, "--logs", str(workdir / "logs")]) == 2
    assert message in capsys.readouterr().err
    assert not (workdir / "logs").exists()  # nothing started, nothing written


def test_a_pipeline_that_raises_exits_2_with_its_error(workdir: Path) -> None:
    proc = run_sweep(
        workdir, "--pipeline", "pipe.py:broken", "--trainer", "python trainer.py", "--logs", "logs"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the producer did not start" in proc.stderr
    assert "OSError: the dataset is not there" in proc.stderr
    trials = json.loads((workdir / "logs" / "summary.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["not run"]


def test_help_gives_every_exit_code_the_readme_does() -> None:
    from tensorsocket.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["sweep"].format_help()
    for code in (
        "0 every trial succeeded",
        "1 a trial failed",
        "2 usage error",
        "130",
        "143 SIGTERM",
        "129 SIGHUP",
    ):
        assert code in text, code


def test_parse_result_takes_the_last_valid_line() -> None:
    text = 'RESULT {"loss": 2}\nnoise\nRESULT not json\n  RESULT {"loss": 1.5, "samples_per_s": 3}\nbye\n'
    assert sweep.parse_result(text) == {"loss": 1.5, "samples_per_s": 3}
    assert sweep.parse_result("no result here\n") is None


def test_summary_json_is_strict_json_with_a_nan_loss_and_a_nan_grid_value(tmp_path: Path) -> None:
    """A diverged trainer's RESULT has a NaN loss (train.py prints json.dumps of it), and a
    grid value may read as one ("nan", "inf"): summary.json held NaN and Infinity, which are
    not JSON (jq and JavaScript refuse the file)."""
    from tensorsocket.cli.sweep.report import write_summary
    from tensorsocket.cli.sweep.trials import Trial

    trial = Trial("trial-01", {"lr": "10", "tag": "nan"}, ["python", "t.py"], tmp_path / "trial-01.log")
    trial.log.write_text('RESULT {"loss": NaN, "samples_per_s": Infinity, "curve": [1.0, -Infinity]}\n')
    trial.status, trial.exit_code, trial.started, trial.ended = "done", 0, 1.0, 2.0
    trial.result = sweep.parse_result(trial.log.read_text())
    write_summary([trial], tmp_path, {"name": "x"})

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} in summary.json")

    (record,) = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)["trials"]
    assert record["params"] == {"lr": 10, "tag": "nan"}
    assert record["loss"] == "nan" and record["samples_per_s"] == "inf"
    assert record["result"]["curve"] == [1.0, "-inf"]
    assert "nan" in (tmp_path / "summary.csv").read_text()


# ---------------------------------------------------------------------------- consumer/train.py


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from producer.imagefolder import make_dataset

    return make_dataset(tmp_path_factory.mktemp("images"), count=16, size=(64, 48))


def test_train_the_switch_is_two_marked_lines() -> None:
    source = TRAIN.read_text()
    assert source.count("[tensorsocket 1/2]") == 2 and source.count("[tensorsocket 2/2]") == 2  # + docstring
    assert "loader = Consumer(batch_size=args.batch_size)  # [tensorsocket 2/2]" in source


def test_train_with_its_own_dataloader(tiny_images: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--data", str(tiny_images), "--epochs", "1", "--max-batches", "2",
         "--batch-size", "4", "--workers", "0", "--log-every", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = _result(proc.stdout)
    assert result["samples"] == 8 and result["epochs"] == 1
    assert result["loss"] > 0 and result["samples_per_s"] > 0


def test_train_shared_from_a_producer(tiny_images: Path) -> None:
    from producer.imagefolder import make_loader

    producer = Producer(make_loader(tiny_images, batch_size=4, num_workers=0), name=unique_name(), slots=3)
    server = threading.Thread(target=producer.serve, kwargs={"epochs": 2}, daemon=True)
    server.start()
    try:
        proc = subprocess.run(
            [sys.executable, str(TRAIN), "--shared", "--epochs", "2"],
            env={**os.environ, "TENSORSOCKET_ENDPOINT": producer.endpoint},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        server.join(timeout=30)
        producer.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not server.is_alive()
    result = _result(proc.stdout)
    assert result["samples"] == 2 * 16 and result["epochs"] == 2
    assert result["loss"] > 0 and result["samples_per_s"] > 0


def _stop_a_wave_server(ready: str, out: Any) -> None:
    """In a spawned child whose stdin is a pipe: the sweep's producer server over a real
    Producer, told ``stop`` on its stdin once it is ready; what run() left behind."""
    import logging

    import torch

    from tensorsocket.cli.sweep.producer import _WaveServer

    read, write = os.pipe()
    os.dup2(read, 0)
    producer = Producer([torch.zeros(2)] * 4, name=unique_name("wave"), slots=2)
    server = _WaveServer(producer, 1, 1, logging.getLogger("test"))
    del producer

    def stop() -> None:
        wait_until(lambda: os.path.exists(ready), 30, "the ready file")
        os.write(write, b"stop\n")

    threading.Thread(target=stop, daemon=True).start()
    code = server.run(1, Path(ready))
    out.put((code, server.producer is None, server.watcher.is_alive()))


def test_the_stdin_thread_neither_outlives_a_stop_nor_holds_the_producer(tmp_path: Path) -> None:
    """A daemon thread that frees the last reference to a tensor while the interpreter
    finalizes aborts the process (torch takes the GIL again from C++; Python 3.11 ends the
    thread with pthread_exit; std::terminate). The stdin thread held the producer through its
    server: 3 of 30 children stopped right after their ready file exited with SIGABRT
    ("terminate called without an active exception"). Now run() drops the producer and waits
    for a stdin thread that woke, so the producer is freed in the main thread."""
    from tests.support import SPAWN

    out = SPAWN.Queue()
    child = SPAWN.Process(target=_stop_a_wave_server, args=(str(tmp_path / "ready"), out))
    child.start()
    code, dropped, alive = out.get(timeout=60)
    child.join(timeout=30)
    assert (code, dropped, alive) == (0, True, False)
    assert child.exitcode == 0


def test_a_stop_signal_as_a_trainer_starts_leaves_it_recorded_to_be_stopped(tmp_path: Path) -> None:
    """Before: a SIGINT whose handler ran inside ``subprocess.Popen`` (here as its child had just
    been started) raised there, so the sweep never recorded the trainer: its stop did not stop
    it, and it ran on unseen. Now the stop signals' handlers wait until the trainer is recorded,
    then run: the KeyboardInterrupt comes all the same, and the sweep's stop stops the trainer."""
    from tensorsocket.cli.sweep import processes
    from tensorsocket.cli.sweep.trials import Trial

    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    trial = Trial("trial-1", {}, command, tmp_path / "trial-1.log")
    started: list[int] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is subprocess.Popen._execute_child.__code__ and event == "return" and not started:
            started.append(frame.f_locals["self"].pid)
            os.kill(os.getpid(), signal.SIGINT)  # (a real one: its handler runs at once)
        return trace

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            processes._start_trial(trial, "ipc:///nowhere")
    finally:
        sys.settrace(None)
        if started and (trial.process is None or trial.process.pid != started[0]):
            os.killpg(started[0], signal.SIGKILL)  # (the unrecorded trainer, before the fix)
    assert started and trial.process is not None and trial.process.pid == started[0]
    assert trial.status == "running" and trial.process.poll() is None
    processes.terminate([trial])
    assert trial.status == "stopped" and trial.process.returncode == -signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
