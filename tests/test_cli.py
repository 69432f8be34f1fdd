"""The ``tensorsocket`` command end to end, in subprocesses: serve + status + a graceful
SIGTERM / SIGINT, a refused second serve, status on a name nobody serves, bad PIPELINE
strings. Processes are started together where they are independent: each one pays the
interpreter and torch start-up."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, endpoint
from tensorsocket.cli import bottleneck, build_parser, format_status, gpu_lines, main, query_status
from tensorsocket.pipeline import PipelineError, describe
from tensorsocket.pipeline import convert as _convert
from tensorsocket.pipeline import load as load_pipeline
from tensorsocket.pipeline import parse as parse_pipeline
from tests.support import shm_segments, unique_name, wait_until

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 8

PIPELINE = textwrap.dedent(
    """
    import torch

    def make(batches=8, width=4, scale=1.0):
        return [torch.full((width,), float(i) * scale) for i in range(batches)]

    def boom(**kwargs):
        raise ValueError("pipeline exploded on purpose")

    def workers(batches=4000):  # a DataLoader with worker processes, the group's other members
        data = torch.arange(batches * 4, dtype=torch.float32).reshape(batches, 4)
        return torch.utils.data.DataLoader(data, batch_size=1, num_workers=2)

    def deaf(then=0.0):  # swallows Ctrl-C while it loads, as some imports do
        import sys, time
        try:  # "loading" inside: a Ctrl-C that lands just after it is swallowed too
            print("loading", file=sys.stderr, flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("swallowed", file=sys.stderr, flush=True)
        time.sleep(then)
        return make()

    class DeafLen(list):  # its first len() (the producer's) swallows Ctrl-C, as a loader's import can
        heard = False

        def __len__(self):
            import sys, time
            if not DeafLen.heard:
                DeafLen.heard = True
                try:
                    print("loading", file=sys.stderr, flush=True)
                    time.sleep(60)
                except KeyboardInterrupt:
                    print("swallowed", file=sys.stderr, flush=True)
            return super().__len__()

    def deaf_len():
        return DeafLen(make())

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

    def bound() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}: {proc.communicate()[1]}")
        return os.path.exists(path)

    wait_until(bound, timeout, f"serve to bind {name}", interval=0.05)


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


def test_status_watch_stops_on_sigint_even_when_started_with_sigint_ignored() -> None:
    """A shell without job control starts background commands with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: --watch must still stop on SIGINT."""
    watch = subprocess.Popen(
        command("status", "--name", unique_name("nobody"), "--watch", "0.1"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert "no producer is serving" in read_until(watch, "--- ", 2)
        watch.send_signal(signal.SIGINT)
        rc, _, err = finish(watch, timeout=20)
        assert rc == 0 and "Traceback" not in err, err
    finally:
        kill(watch)


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
        wait_until(
            lambda: query_status(endpoint.resolve(name), 5)["consumers"][0]["samples_per_s"],
            15,
            "the consumer's rate to show",
            interval=0.1,
        )

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
        (
            (rc_text, text, err_text),
            (rc_json, raw, err_json),
            (rc_second, _, err_second),
            (rc_lean, lean, err_lean),
        ) = map(finish, others[:4])

        assert rc_text == 0, err_text
        assert f"pid {serve.pid}" in text and endpoint.resolve(name) in text
        assert "bottleneck: " in text and "3 slots" in text and "(budget 1.0 MiB)" in text
        assert "stragglers: stall" in text and "batches/s (since start)" in text
        header = next(line for line in text.splitlines() if line.startswith("consumer "))
        # "gpu mem" too where nvidia-ml-py sees this process on a GPU (an earlier GPU test's context)
        assert header.replace("  gpu mem", "").split() == [
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
        assert status["replay_budget_bytes"] == 1 << 20 and status["replay_batches"] == BATCHES
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
        fast = Consumer(name=name, timeout=10, label="fast")
        consumer = Consumer(name=name, timeout=10, label="slowpoke")
        stop = threading.Event()

        def read_fast() -> None:  # the leader: keeps up with the loader
            while not stop.is_set() and not fast.finished:
                for _ in fast:
                    if stop.is_set():
                        break

        reader = threading.Thread(target=read_fast, daemon=True)
        reader.start()
        deadline = time.monotonic() + 20
        while consumer.skipped == 0:
            assert time.monotonic() < deadline, "nothing was skipped"
            for _ in consumer:
                time.sleep(0.05)
                if consumer.skipped:
                    break
        status = query_status(endpoint.resolve(name), 5)
        assert status["stragglers"] == "skip" and status["max_lag"] == 1
        assert status["replay_batches"] == 0 and status["places"] == 12  # room for a straggler's batches
        me = next(c for c in status["consumers"] if c["label"] == "slowpoke")
        assert me["skipped"] > 0
        text = format_status(status, gpu=([], {}))
        assert "stragglers: skip (a consumer more than 1 batches behind the leader skips ahead)" in text
        assert "4 slots + 8 for stragglers" in text
        row = next(line for line in text.splitlines() if line.startswith("slowpoke"))
        assert row.split()[9] == str(me["skipped"])
        stop.set()
        serve.send_signal(signal.SIGTERM)
        drain(consumer)
        consumer.close()
        reader.join(10)
        fast.close()
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


@pytest.mark.parametrize(("where", "signals"), [("pipeline", 1), ("pipeline", 2), ("producer", 1)])
def test_a_ctrl_c_that_the_pipeline_swallowed_still_stops_serve(
    pipeline: Path, tmp_path: Path, where: str, signals: int
) -> None:
    """A KeyboardInterrupt can be lost in the code it lands in: an extension module's
    initialisation swallows it (numpy.random's did, in a successor's rerun: it went on to
    serve). serve still stops: once the pipeline is made (swallowed by the pipeline function:
    exit 130, nothing served), once the Producer is made (swallowed by the loader's len(): a
    stop as it serves, exit 0), or at once on a second signal while the pipeline goes on
    loading. Before, the first was lost and the second only logged "already stopping": serve
    went on forever."""
    function = "deaf" if where == "pipeline" else "deaf_len"
    then = ("--arg", "then=60" if signals == 2 else "then=0.5") if where == "pipeline" else ()
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        serve = subprocess.Popen(
            command("serve", f"{pipeline}:{function}", "--name", unique_name("cli"), *then),
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        wait_until(lambda: "loading" in log.read_text(), 60, "the pipeline to start loading")
        serve.send_signal(signal.SIGINT)
        if signals == 2:
            wait_until(
                lambda: "swallowed" in log.read_text(), 30,
                lambda: f"the first SIGINT to be swallowed; the log:\n{log.read_text()}",
            )  # fmt: skip
            serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == (130 if where == "pipeline" else 0), log.read_text()
        text = log.read_text()
        assert "SIGINT: ending the stream" in text and "Traceback" not in text, text
        ended = "interrupted before serving" if where == "pipeline" else "producer serving"
        assert ended in text and ("stopped" in text) == (where == "producer"), text
        assert ("SIGINT again: the first one's stop was lost" in text) == (signals == 2), text
        assert shm_segments(serve.pid) == []
    finally:
        kill(serve)


def test_a_stop_is_under_way_while_its_interrupt_or_what_it_raised_is_handled() -> None:
    """serve's handler only logs a signal while the stop runs: an except block handling the
    KeyboardInterrupt, or one handling what was raised there (the close's TimeoutError as it
    lingers: a second Ctrl-C then would cut the clean end short). Elsewhere, raised again."""
    from tensorsocket.cli.common import handling

    assert not handling(KeyboardInterrupt)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert handling(KeyboardInterrupt)
        try:
            raise TimeoutError
        except TimeoutError:
            assert handling(KeyboardInterrupt)
    try:
        raise TimeoutError
    except TimeoutError:
        assert not handling(KeyboardInterrupt)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_the_process_group_ends_the_stream_cleanly(pipeline: Path, stop: int) -> None:
    """`systemctl stop`, `timeout`, Ctrl-C and a closed terminal (SIGHUP: it killed serve, which
    left its consumers ProducerLost and its files behind) signal the whole process group, so
    the loader's workers get it too. Their deaths must not turn the clean end into an error
    (torch's SIGCHLD handler raised for them: exit 1), and a forked worker does not log the
    stop as the producer does."""
    name = unique_name("cli")
    serve = subprocess.Popen(
        command("serve", f"{pipeline}:workers", "--name", name, "--progress", "0"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    consumer = None
    try:
        wait_until_serving(serve, name)
        consumer = Consumer(name=name, timeout=20)
        taken = []
        for batch in consumer:
            taken.append(int(batch[0, 0]) // 4)
            if len(taken) == 20:
                os.killpg(serve.pid, stop)
        drain(consumer)
        assert consumer.finished and taken == list(range(len(taken))) and len(taken) >= 20
        consumer.close()
        rc, _, err = finish(serve)
        assert rc == 0, err
        name_of = signal.Signals(stop).name
        assert err.count(f"{name_of}: ending the stream") == 1, err
        assert " ERROR " not in err and "serving stopped on an error" not in err, err
        # Ctrl-C can land while serve fetches a batch's file descriptor from a loader worker:
        # that worker's multiprocessing.resource_sharer thread then prints a traceback of its
        # own (Python's, in the worker; seen in 1 of ~16 runs). serve itself prints none.
        starts = re.findall(r'Traceback \(most recent call last\):\n\s+File "([^"]+)"', err)
        assert err.count("Traceback") == len(starts), err
        assert all(path.endswith("multiprocessing/resource_sharer.py") for path in starts), err
        assert shm_segments(serve.pid) == []
    finally:
        if consumer is not None:
            consumer.close()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.communicate(timeout=10)


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
        # (boom: the device is refused before the pipeline is loaded)
        "bad device": (["serve", f"{pipeline}:boom", "--device", "tpu"], 2, ["--device: device must be"]),
    }
    if not torch.cuda.is_available() and os.environ.get("TENSORSOCKET_FAKE_CUDA") != "1":
        cases["no GPU"] = (  # (after the pipeline: one that needs a GPU says so itself)
            ["serve", f"{pipeline}:make", "--device", "cuda"],
            2,
            ["--device cuda: the cuda transport needs a CUDA GPU", "device='cpu'"],
        )
    # serve cases get a name each: they run at once, and a name in use would be refused
    names = {label: unique_name("cli") for label, (args, _, _) in cases.items() if args[0] == "serve"}
    procs = {
        label: start(*args, *(["--name", names[label]] if label in names else []))
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
    assert left_in_runtime_dir(names.values()) == []  # (a refused serve gives its name back)


def test_serve_on_an_ipc_path_whose_folder_is_missing_says_so_in_one_line(
    pipeline: Path, tmp_path: Path
) -> None:
    """A bad --endpoint is a usage error (exit 2, one line naming the path), not a traceback
    from opening the lock file."""
    missing = tmp_path / "no-such-folder" / "x.sock"
    rc, _, err = finish(start("serve", f"{pipeline}:make", "--endpoint", f"ipc://{missing}"))
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert f"cannot create its lock file {missing}.lock" in err, err
    assert not missing.parent.exists()


def left_in_runtime_dir(names: Any) -> list[str]:
    """The runtime directory's files of these producer names (socket, lock, state)."""
    return sorted(p.name for name in names for p in endpoint.runtime_dir().glob(f"{name}.sock*"))


def test_serve_refuses_a_gpu_this_process_cannot_see_in_one_line(pipeline: Path) -> None:
    env = {**os.environ, "TENSORSOCKET_FAKE_CUDA": "1"}  # (the stand-in sees 2 GPUs)
    name = unique_name("cli")
    args = ["serve", f"{pipeline}:make", "--name", name, "--device", "cuda:7"]
    done = subprocess.run(command(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, done.stderr
    assert "--device cuda:7: this process sees 2 GPU(s)" in done.stderr and "Traceback" not in done.stderr
    assert left_in_runtime_dir([name]) == []


def test_serve_resume_from_a_damaged_state_file_blames_the_file_not_the_pipeline(pipeline: Path) -> None:
    name = unique_name("cli")
    state = endpoint.runtime_dir() / f"{name}.sock.state"
    state.write_bytes(b"\x00garbage")
    try:
        args = ["serve", f"{pipeline}:make", "--name", name, "--resume"]
        done = subprocess.run(command(*args), cwd=ROOT, capture_output=True, text=True, timeout=90)
    finally:
        state.unlink(missing_ok=True)
    assert done.returncode == 2, done.stderr
    assert f"the state file {state} is not a readable producer state" in done.stderr, done.stderr
    assert "remove it to begin a fresh stream" in done.stderr and "returned" not in done.stderr
    assert "Traceback" not in done.stderr


def test_a_dataloader_workers_error_is_described_in_one_line() -> None:
    """torch raises a worker's error again with the worker's whole traceback in its message:
    serve's 'serving stopped on an error' line was that traceback, ending '(at .../torch/_utils.py:N)'."""
    from torch._utils import ExceptionWrapper

    def worker() -> None:
        raise RuntimeError("bad sample 30")

    try:
        worker()
    except RuntimeError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    try:
        wrapped.reraise()
    except RuntimeError as exc:
        text = describe(exc)
    assert "\n" not in text, text
    line = worker.__code__.co_firstlineno + 1
    assert text == (
        "RuntimeError: Caught RuntimeError in DataLoader worker process 1. RuntimeError: bad sample 30 "
        f"(at {__file__}:{line})"
    )
    try:
        worker()
    except RuntimeError as exc:  # an error of the main process: as before
        assert describe(exc) == f"RuntimeError: bad sample 30 (at {__file__}:{line})"


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replay", "12X"], "argument --replay: expected a size in bytes like 0, 1048576, 512M or 2G"),
        (["--replay", "-1"], "argument --replay: expected a size in bytes"),
        (["--grace", "-1"], "argument --grace: expected a number of seconds >= 0, got '-1'"),
        (["--grace", "nan"], "argument --grace: expected a number of seconds >= 0"),
        (["--grace", "soon"], "argument --grace: expected a number of seconds, got 'soon'"),
        (["--stragglers", "drop"], "argument --stragglers: invalid choice: 'drop'"),
        (["--max-lag", "0"], "argument --max-lag: expected a positive integer, got '0'"),
        (["--max-lag", "2", "--stragglers", "stall"], "--max-lag applies to --stragglers skip only"),
        (["--max-lag", "8"], "--max-lag must be below --slots (8), got 8"),
        (["--stragglers", "skip", "--slots", "1"], "--stragglers skip needs --slots 2 or more"),
        (["--slots", "0"], "argument --slots: expected a positive integer, got '0'"),
        (["--epochs", "-1"], "argument --epochs: expected an integer >= 0, got '-1'"),
        (["--min-consumers", "0"], "argument --min-consumers: expected a positive integer"),
    ],
)
def test_bad_serve_options_exit_2_before_anything_starts(
    pipeline: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    name = unique_name("cli")
    assert main(["serve", f"{pipeline}:make", "--name", name, *args]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(endpoint.resolve(name)[len("ipc://") :])


def test_serve_options_reach_the_producer() -> None:
    from tensorsocket.cli.common import size
    from tensorsocket.cli.serve import producer_options

    parser = build_parser()
    options = producer_options(parser.parse_args(["serve", "m:f", "--replay", "512M", "--grace", "2.5"]))
    assert options == {
        "device": "cpu", "slots": 8, "replay": 512 << 20, "min_consumers": 1, "grace": 2.5,
        "stragglers": "stall", "max_lag": None, "linger": 10.0, "resume": False,
    }  # fmt: skip
    assert producer_options(parser.parse_args(["serve", "m:f", "--resume"]))["resume"] is True
    assert producer_options(parser.parse_args(["serve", "m:f"]))["replay"] is None  # the library default
    implied = producer_options(parser.parse_args(["serve", "m:f", "--max-lag", "3"]))
    assert implied["stragglers"] == "skip" and implied["max_lag"] == 3
    skip = producer_options(parser.parse_args(["serve", "m:f", "--stragglers", "skip"]))
    assert skip["stragglers"] == "skip" and skip["max_lag"] is None  # the producer picks slots // 2
    sizes = {"0": 0, "4096": 4096, "64K": 64 << 10, "512M": 512 << 20, "512MiB": 512 << 20, "2g": 2 << 30}
    sizes.update({"2GB": 2 << 30, "1.5G": 3 << 29, "10 MB": 10 << 20, "7b": 7})
    assert {text: size(text) for text in sizes} == sizes


def test_status_watch_count_without_a_producer(capsys: pytest.CaptureFixture[str]) -> None:
    nobody = unique_name("cli")
    started = time.monotonic()
    assert main(["status", "--name", nobody, "--watch", "0.05", "--count", "3"]) == 1
    assert time.monotonic() - started < 5
    out = capsys.readouterr().out
    assert out.count(f"no producer is serving {nobody}") == 3 and out.count("--- ") == 3
    # --json: every line of stdout is JSON, also while no producer answers (one restarting)
    assert main(["status", "--name", nobody, "--json", "--watch", "0.05", "--count", "2"]) == 1
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == [None, None]
    assert captured.err.count(f"no producer is serving {nobody}") == 2
    assert main(["status", "--name", nobody, "--watch", "0"]) == 2
    assert "--watch must be > 0 seconds" in capsys.readouterr().err
    assert main(["status", "--name", nobody, "--count", "0"]) == 2
    assert "argument --count: expected a positive integer" in capsys.readouterr().err


def test_status_of_a_tcp_endpoint_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``tcp://127.0.0.1:*`` is for a producer to bind; status cannot ask it: exit 2 with one
    line, not a ValueError traceback."""
    for watch in ([], ["--watch", "0.05", "--count", "1"]):
        assert main(["status", "--endpoint", "tcp://127.0.0.1:*", *watch]) == 2
        err = capsys.readouterr().err
        assert "status needs the port the producer picked" in err and "Traceback" not in err


def _consumer(label: str, **fields: Any) -> dict[str, Any]:
    base = {
        "label": label, "pid": 7, "device": "cpu", "batch_size": None, "late_join": "replay",
        "joined_s_ago": 75.0, "cursor": 17, "lag": 0, "catching_up": False, "held": 1,
        "received": 16, "skipped": 0, "batches": 16, "samples": 512, "waiting_s": 1.0,
        "samples_per_s": 250.0, "batches_per_s": 7.8, "waiting_share": 0.5,
    }  # fmt: skip
    return {**base, **fields}


def _status(**fields: Any) -> dict[str, Any]:
    base = {
        "endpoint": "ipc:///x.sock", "pid": 42, "uptime_s": 10.0, "slots": 4, "places": 12,
        "replay_batches": 8, "replay_budget_bytes": 1 << 30, "starts_with": None, "preparing": None, "kept_batches": 8,
        "resident_batches": 12,
        "slot_bytes": 12 << 20, "stragglers": "stall", "max_lag": None, "epoch": 1, "next_seq": 20,
        "ended": False, "batches_per_epoch": 16, "samples_per_epoch": 512, "published": 18,
        "loader_wait": 6.0, "slot_wait": 1.0, "publish_time": 1.5, "restaged": 3, "bad_messages": 0, "dropped_replies": 0,
        "consumers": [
            _consumer("a", cursor=17, lag=1, held=2, batch_size=32, device="cuda:0"),
            _consumer("late", pid=8, cursor=None, held=0, received=0, samples_per_s=None, waiting_share=None),
        ],
    }  # fmt: skip
    return {**base, **fields}


def test_format_status() -> None:
    status = _status()
    text = format_status(status, gpu=([], {}))
    lines = text.splitlines()
    assert lines[0] == "producer ipc:///x.sock  pid 42  up 10s  epoch 1"
    assert lines[1] == "  published 18 batches (16 an epoch), 1.8 batches/s (since start)"
    assert lines[2] == (
        "  time (since start): 60% in next(loader), 10% waiting for a free slot, 5% writing, 25% other"
    )
    assert lines[3] == "  bottleneck: the loader"
    assert lines[4].startswith("  stragglers: stall")
    assert lines[5] == (
        "  shared memory 12.0 MiB in use (~1.0 MiB a batch): 4 slots + 8 for stragglers; replay: 8 of up to "
        "8 batches kept where the loader made them (budget 1.0 GiB), 3 written again for joiners; 12 "
        "batches resident"
    )
    rows = lines[-3:]
    assert rows[0].split() == [
        "consumer", "pid", "device", "batch", "joined", "cursor", "lag", "held", "received",
        "skipped", "samples/s", "waiting", "note",
    ]  # fmt: skip
    assert rows[1].split() == ["a", "7", "cuda:0", "32", "1m15s", "17", "1", "2", "16", "0", "250.0", "50%"]
    assert rows[2].split()[:12] == ["late", "8", "cpu", "-", "1m15s", "-", "-", "0", "0", "0", "-", "-"]
    assert rows[2].endswith("waits for the next epoch")

    # Since a previous snapshot of the same producer: rates and shares over the time between.
    later = _status(uptime_s=12.0, published=28, loader_wait=6.2, slot_wait=2.6, publish_time=3.2)
    text = format_status(later, status, gpu=([], {}))
    assert "10 batches published" not in text and "5.0 batches/s (last 2.0 s)" in text
    assert "10% in next(loader), 80% waiting for a free slot" in text
    assert "bottleneck: the slowest consumer (a)" in text  # the furthest behind: lag 1 + 2 held
    # Another producer on the name (a restart): the previous snapshot is ignored.
    assert "(since start)" in format_status(_status(pid=43, uptime_s=1.0), status, gpu=([], {}))

    empty = format_status(_status(consumers=[], published=0), gpu=([], {}))
    assert empty.endswith("no consumers connected") and "nothing published" in empty
    assert "4 slots + 4 for stragglers" in format_status(_status(stragglers="skip", max_lag=2, places=8))


def test_bottleneck_in_plain_words() -> None:
    assert bottleneck(_status()) == "the loader"
    slot_bound = _status(loader_wait=0.5, slot_wait=8.0, publish_time=8.5)
    assert bottleneck(slot_bound) == "the slowest consumer (a)"
    # Equally far behind: the one that waits least for data is the one the others wait for.
    tied = [_consumer("busy", held=3, waiting_share=0.01), _consumer("idle", held=3, waiting_share=0.9)]
    assert bottleneck(dict(slot_bound, consumers=tied)) == "the slowest consumer (busy)"
    assert bottleneck(_status(loader_wait=0.1, slot_wait=0.1, publish_time=5.0)).startswith(
        "the producer itself"
    )
    assert bottleneck(_status(ended=True)) == "none: the stream has ended"
    assert bottleneck(_status(published=0)).startswith("none yet: nothing published")
    assert bottleneck(_status(consumers=[])).startswith("none: no consumer is connected")
    # No batch since the last look: a wait still running. A full window means a free slot.
    stuck = _status(uptime_s=13.0)
    assert bottleneck(stuck, _status()) == "the loader: no batch published for 3.0 s"
    full = [_consumer("a", lag=0, held=4), _consumer("b", held=1)]
    assert bottleneck(dict(stuck, consumers=full), _status()) == (
        "the slowest consumer (a): no batch published for 3.0 s, the window is full"
    )


def test_gpu_lines_and_column(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no GPU line, no error
    assert gpu_lines() == []
    assert "gpu" not in format_status(_status())

    memory = types.SimpleNamespace(used=1 << 30, total=80 << 30)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"H100",
        nvmlDeviceGetMemoryInfo=lambda h: memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=7, usedGpuMemory=3 << 29)],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert gpu_lines() == ["gpu 0 H100: memory 1.0 GiB / 80.0 GiB, utilisation 37%"]
    text = format_status(_status())
    assert "  gpu 0 H100: memory 1.0 GiB / 80.0 GiB, utilisation 37%" in text
    header, first, second = text.splitlines()[-3:]
    assert "gpu mem" in header and "1.5 GiB" in first and "1.5 GiB" not in second

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert gpu_lines() == []


def test_format_status_with_the_producers_gpu_memory() -> None:
    """A producer on a GPU sends ``gpu_mib`` (its own and each consumer's, from NVML there):
    a line for the producer and the ``gpu mem`` column, "-" for a consumer without a figure.
    None (host shared memory, no nvidia-ml-py) or absent (an earlier producer): neither."""
    consumers = [
        _consumer("a", device="cuda:0", gpu_mib=512.0),
        _consumer("b", pid=8, device="cuda:0", gpu_mib=None),
    ]
    status = _status(transport="cuda", device="cuda:0", gpu_mib=1536.0, consumers=consumers)
    text = format_status(status, gpu=([], {}))
    lines = text.splitlines()
    assert "  GPU memory of the producer on cuda:0: 1.5 GiB" in lines
    header, first, second = lines[-3:]
    assert header.index("waiting") < header.index("gpu mem") < header.index("note")
    assert first.split()[12:14] == ["512.0", "MiB"]
    assert second.split()[12] == "-"
    # The producer's figure wins over this host's reading by pid; the host's fills a gap.
    text = format_status(status, gpu=([], {7: 3 << 30, 8: 1 << 30}))
    first, second = text.splitlines()[-2:]
    assert "512.0 MiB" in first and "3.0 GiB" not in first and "1.0 GiB" in second

    for none in (_status(gpu_mib=None, consumers=[_consumer("a", gpu_mib=None)]), _status()):
        text = format_status(none, gpu=([], {}))
        assert "GPU memory" not in text and "gpu mem" not in text
