"""The ``tensorsocket`` command end to end, in subprocesses: serve + status + a graceful
SIGTERM / SIGINT, a refused second serve, status on a name nobody serves, bad PIPELINE
strings. Processes are started together where they are independent: each one pays the
interpreter and torch start-up."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tensorsocket import Consumer, endpoint
from tensorsocket.cli import format_status, gpu_lines, main, query_status
from tensorsocket.pipeline import PipelineError
from tensorsocket.pipeline import convert as _convert
from tensorsocket.pipeline import load as load_pipeline
from tensorsocket.pipeline import parse as parse_pipeline
from tests.support import shm_segments, unique_name

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 8

PIPELINE = textwrap.dedent(
    """
    import torch

    def make(batches=8, width=4, scale=1.0):
        return [torch.full((width,), float(i) * scale) for i in range(batches)]

    def boom(**kwargs):
        raise ValueError("pipeline exploded on purpose")

    NOT_A_FUNCTION = 3
    """
)


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tensorsocket", *args]


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str], timeout: float = 90.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def kill(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    path = tmp_path / "pipeline.py"
    path.write_text(PIPELINE)
    return path


def wait_until_serving(proc: subprocess.Popen[str], name: str, timeout: float = 30.0) -> None:
    """Wait until ``proc`` has bound the name (its ipc socket exists), or fail with its stderr."""
    path = endpoint.resolve(name)[len("ipc://") :]
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            pytest.fail(f"serve did not bind {name} within {timeout} s")
        time.sleep(0.05)


def drain(consumer: Consumer, timeout: float = 20.0) -> None:
    """Iterate until the producer ends the stream."""
    deadline = time.monotonic() + timeout
    while not consumer.finished:
        assert time.monotonic() < deadline, "the stream did not end"
        for _ in consumer:
            pass


# Runs the CLI with a stand-in for the tensorsocket package object (its __init__ imports
# the library, torch included), and says on stderr whether torch got imported: the commands
# that need no torch must not import it, so they start fast once the package is lazy.
NO_TORCH_RUNNER = textwrap.dedent(
    """
    import sys, types
    pkg = types.ModuleType("tensorsocket")
    pkg.__path__ = [sys.argv.pop(1)]
    pkg.__version__ = "0+test"
    sys.modules["tensorsocket"] = pkg
    from tensorsocket import cli
    rc = cli.main(sys.argv[1:])
    print("TORCH IMPORTED" if "torch" in sys.modules else "no torch", file=sys.stderr)
    sys.exit(rc)
    """
)


def start_without_init(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", NO_TORCH_RUNNER, str(ROOT / "tensorsocket"), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_until(proc: subprocess.Popen[str], text: str, count: int, timeout: float = 30.0) -> str:
    """Read ``proc``'s stdout until ``text`` appeared ``count`` times (or fail)."""
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    seen = ""
    deadline = time.monotonic() + timeout
    while seen.count(text) < count:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            pytest.fail(f"{text!r} not seen {count} times (exit {proc.poll()}): {seen!r}")
        if select.select([fd], [], [], min(left, 0.2))[0]:
            seen += os.read(fd, 65536).decode()
    return seen


def consume_slowly(consumer: Consumer, stop: threading.Event, step: float = 0.02) -> None:
    while not stop.is_set() and not consumer.finished:
        for _ in consumer:
            time.sleep(step)
            if stop.is_set():
                break


def test_serve_with_options_status_while_consuming_second_serve_and_sigterm(pipeline: Path) -> None:
    """serve with --replay / --grace / --min-consumers; status (table, JSON, --watch, and
    without torch) while a consumer runs; a second serve refused; SIGTERM ends cleanly."""
    name = unique_name("cli")
    serve = start(
        "serve", f"{pipeline}:make", "--name", name, "--slots", "3", "--arg", f"batches={BATCHES}",
        "--replay", "1M", "--min-consumers", "2", "--grace", "0.3", "--progress", "0.5",
    )  # fmt: skip
    consumer = None
    stop = threading.Event()
    reader = threading.Thread(target=lambda: None)
    others: list[subprocess.Popen[str]] = []
    try:
        wait_until_serving(serve, name)
        # Only one of the two --min-consumers joins: the producer starts after the grace.
        consumer = Consumer(name=name, timeout=10, label="cli-test", batch_size=4)
        assert [float(batch[0]) for batch in consumer] == [float(i) for i in range(BATCHES)]

        reader = threading.Thread(target=consume_slowly, args=(consumer, stop), daemon=True)
        reader.start()
        deadline = time.monotonic() + 15
        while not query_status(endpoint.resolve(name), 5)["consumers"][0]["samples_per_s"]:
            assert time.monotonic() < deadline, "the consumer's rate never showed"
            time.sleep(0.1)

        others = [
            start("status", "--name", name, "--timeout", "20"),
            start("status", "--name", name, "--json", "--timeout", "20"),
            start("serve", f"{pipeline}:make", "--name", name),
            start_without_init("status", "--name", name, "--timeout", "20"),
            start("status", "--name", name, "--watch", "0.3", "--timeout", "20"),
        ]
        watch = others[-1]
        watched = read_until(watch, "--- ", 2)
        watch.send_signal(signal.SIGINT)
        rc_watch, rest, err_watch = finish(watch)
        assert rc_watch == 0 and "Traceback" not in err_watch, err_watch
        assert "batches/s (last" in watched + rest and "cli-test" in watched
        (rc_text, text, err_text), (rc_json, raw, err_json), (rc_second, _, err_second), (rc_lean, lean, err_lean) = map(
            finish, others[:4]
        )

        assert rc_text == 0, err_text
        assert f"pid {serve.pid}" in text and endpoint.resolve(name) in text
        assert "bottleneck: " in text and "3 slots" in text and "replay budget 1.0 MiB" in text
        assert "stragglers: stall" in text and "batches/s (since start)" in text
        header = next(line for line in text.splitlines() if line.startswith("consumer "))
        assert header.split() == [
            "consumer", "pid", "device", "batch", "joined", "cursor", "lag", "held", "received",
            "skipped", "samples/s", "waiting", "note",
        ]  # fmt: skip
        row = next(line for line in text.splitlines() if line.startswith("cli-test"))
        cells = row.split()
        assert cells[1] == str(os.getpid()) and cells[2] == "cpu" and cells[3] == "4", row
        assert cells[9] == "0" and cells[10] != "-" and cells[11].endswith("%"), row

        assert rc_json == 0, err_json
        status = json.loads(raw)
        assert status["pid"] == serve.pid and status["slots"] == 3
        assert status["published"] >= BATCHES and not status["ended"]
        assert status["stragglers"] == "stall" and status["max_lag"] is None
        assert status["replay_budget_bytes"] == 1 << 20 and status["replay_places"] == BATCHES
        [me] = status["consumers"]
        assert me["label"] == "cli-test" and me["pid"] == os.getpid() and me["received"] >= BATCHES
        assert me["batch_size"] == 4 and me["late_join"] == "replay" and me["samples_per_s"] > 0

        assert rc_second == 1, err_second
        assert "already serving" in err_second and str(serve.pid) in err_second

        assert rc_lean == 0, err_lean
        assert "cli-test" in lean and err_lean.strip().endswith("no torch"), err_lean

        stop.set()
        reader.join(timeout=10)
        serve.send_signal(signal.SIGTERM)
        drain(consumer)
        assert consumer.finished
        consumer.close()
        rc, _, err = finish(serve)
        assert rc == 0, err
        assert "SIGTERM" in err and "Traceback" not in err
        assert "replay budget 1.0 MiB" in err and "bottleneck: " in err  # the start line, progress
        assert shm_segments(serve.pid) == []
    finally:
        stop.set()
        reader.join(timeout=10)
        if consumer is not None:
            consumer.close()
        for proc in [serve, *others]:
            kill(proc)


def test_serve_stragglers_skip(pipeline: Path) -> None:
    """--stragglers skip --max-lag: a slow consumer skips batches, and status shows it."""
    name = unique_name("cli")
    serve = start(
        "serve", f"{pipeline}:make", "--name", name, "--slots", "4", "--max-lag", "1",
        "--replay", "0", "--arg", "batches=50", "--progress", "0",
    )  # fmt: skip
    consumer = None
    try:
        wait_until_serving(serve, name)
        consumer = Consumer(name=name, timeout=10, label="slowpoke")
        deadline = time.monotonic() + 20
        while consumer.skipped == 0:
            assert time.monotonic() < deadline, "nothing was skipped"
            for _ in consumer:
                time.sleep(0.01)
                if consumer.skipped:
                    break
        status = query_status(endpoint.resolve(name), 5)
        assert status["stragglers"] == "skip" and status["max_lag"] == 1
        assert status["replay_places"] == 0 and status["places"] == 8  # a window more for skips
        [me] = status["consumers"]
        assert me["skipped"] > 0
        text = format_status(status, gpu=([], {}))
        assert "stragglers: skip (a consumer lagging more than 1 batches skips ahead)" in text
        assert "4 slots + 4 for skipping" in text
        row = next(line for line in text.splitlines() if line.startswith("slowpoke"))
        assert row.split()[9] == str(me["skipped"])
        serve.send_signal(signal.SIGTERM)
        drain(consumer)
        consumer.close()
        rc, _, err = finish(serve)
        assert rc == 0 and "stragglers skip beyond 1 batches" in err, err
    finally:
        if consumer is not None:
            consumer.close()
        kill(serve)


def test_sigint_while_waiting_for_consumers(pipeline: Path) -> None:
    name = unique_name("cli")
    serve = start("serve", f"{pipeline}:make", "--name", name, "--log-level", "warning")
    try:
        wait_until_serving(serve, name)
        time.sleep(0.2)  # past bind: the handlers are installed before the producer binds
        serve.send_signal(signal.SIGINT)
        rc, _, err = finish(serve)
        assert rc == 0, err
        assert "Traceback" not in err
        assert shm_segments(serve.pid) == []
    finally:
        kill(serve)


def test_errors_and_help(pipeline: Path, tmp_path: Path) -> None:
    nobody = unique_name("cli")
    cases = {  # label: (arguments, exit code, what stderr must say)
        "no colon": (["serve", str(pipeline)], 2, ["must be module:function"]),
        "missing file": (["serve", f"{tmp_path / 'nope.py'}:make"], 2, ["nope.py", "does not exist"]),
        "missing module": (
            ["serve", "no_such_module_xyz.sub:make"],
            2,
            ["no module named 'no_such_module_xyz'"],
        ),
        "missing function": (["serve", f"{pipeline}:nope"], 2, ["has no function 'nope'", "make"]),
        "pipeline raises": (
            ["serve", f"{pipeline}:boom"],
            2,
            ["raised ValueError: pipeline exploded on purpose"],
        ),
        "nobody serves": (["status", "--name", nobody], 1, [f"no producer is serving {nobody} (ipc://"]),
        "demo help": (["demo", "--help"], 0, []),
    }
    # serve cases get a name each: they run at once, and a name in use would be refused
    procs = {
        label: start(*args, *(["--name", unique_name("cli")] if args[0] == "serve" else []))
        for label, (args, _, _) in cases.items()
    }
    outputs = {}
    try:
        for label, (_, code, messages) in cases.items():
            rc, out, err = finish(procs[label])
            outputs[label] = out
            assert rc == code, f"{label}: exit {rc}, stderr {err!r}"
            for message in messages:
                assert message in err, f"{label}: {message!r} not in {err!r}"
            assert "Traceback" not in err, f"{label}: {err}"
    finally:
        for proc in procs.values():
            kill(proc)
    assert "--trainers" in outputs["demo help"] and "--images" in outputs["demo help"]


def test_parsing_in_process(pipeline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_pipeline("producer.synthetic:make_loader") == ("producer.synthetic", "make_loader", False)
    assert parse_pipeline("./x.py:make") == ("./x.py", "make", True)
    assert parse_pipeline("x.py:Maker.build") == ("x.py", "Maker.build", True)
    assert [_convert(v) for v in ("3", "-2", "0.5", "1e-3", "abc", "")] == [3, -2, 0.5, 1e-3, "abc", ""]
    for bad in ("nocolon", ":f", "mod:", "mod:f-g", "a b:f"):
        with pytest.raises(PipelineError):
            parse_pipeline(bad)
    with pytest.raises(PipelineError, match="is a int, not a function"):
        load_pipeline(f"{pipeline}:NOT_A_FUNCTION")
    assert load_pipeline(f"{pipeline}:make")(batches=2)[1].tolist() == [1.0] * 4
    assert main(["serve", f"{pipeline}:make", "--arg", "batches"]) == 2  # argparse: before any logging setup
    assert "expected key=value" in capsys.readouterr().err
    assert main(["status", "--name", "bad name!"]) == 2
    assert "must be 1-64 characters" in capsys.readouterr().err
    assert main(["demo", "--help"]) == 0
    assert "--trainers" in capsys.readouterr().out


def test_format_status_and_gpu_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    status = {
        "endpoint": "ipc:///x.sock",
        "pid": 42,
        "slots": 4,
        "slot_bytes": 3 << 20,
        "epoch": 1,
        "next_seq": 20,
        "ended": False,
        "published": 18,
        "loader_wait": 2.5,
        "publish_time": 0.5,
        "bad_messages": 0,
        "consumers": [
            {"label": "a", "pid": 7, "joined_s_ago": 75.0, "cursor": 17, "held": 2, "received": 16},
            {"label": "late", "pid": 8, "joined_s_ago": 1.0, "cursor": None, "held": 0, "received": 0},
        ],
    }
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no GPU line, no error
    text = format_status(status)
    assert "bottleneck is the loader" in text and "3.0 MiB" in text and "gpu" not in text
    rows = text.splitlines()[-3:]
    assert rows[0].split() == ["label", "pid", "joined", "cursor", "lag", "held", "received"]
    assert rows[1].split() == ["a", "7", "1m15s", "ago", "17", "3", "2", "16"]
    assert rows[2].split() == ["late", "8", "1s", "ago", "-", "-", "0", "0"]
    later = dict(status, published=28, loader_wait=2.5, publish_time=9.0)
    later["consumers"] = [dict(status["consumers"][0], received=26)]
    text = format_status(later, status, 2.0)
    assert "(5.0 batches/s)" in text and "bottleneck is the consumers" in text
    assert text.splitlines()[-1].split()[-1] == "5.0"

    memory = types.SimpleNamespace(used=1 << 30, total=80 << 30)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"H100",
        nvmlDeviceGetMemoryInfo=lambda h: memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert gpu_lines() == ["gpu 0 H100: memory 1.0 GiB / 80.0 GiB, utilisation 37%"]
    assert "utilisation 37%" in format_status(status)

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert gpu_lines() == []
