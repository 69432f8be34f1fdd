"""``tensorsocket sweep``: one producer, one trainer process per grid point.

    tensorsocket sweep --pipeline producer/imagefolder.py:make_loader --pipeline-arg root=data/jpeg-1024 \\
        --trainer "python consumer/train.py --shared" --grid lr=0.1,0.01 --grid seed=0,1

Every combination of the ``--grid`` values is a trial: the trainer command with ``--key value``
appended for each grid key (the key verbatim: ``--grid batch_size=...`` appends
``--batch_size``), run with ``TENSORSOCKET_ENDPOINT`` set to the sweep's producer (and
``TENSORSOCKET_TRIAL`` to the trial's name). A leading ``python`` / ``python3`` in the trainer
command is replaced by this interpreter, so trainers run in the sweep's environment.

Design:

* The producer runs in a child process (``python -m tensorsocket.sweep _serve ...``), so a
  pipeline that crashes or hangs never takes the launcher with it. It waits until every
  trial it serves has joined or exited, then serves ``--epochs`` epochs from the first batch.
  Trials that exit before joining (a typo in a grid value, an import error) are reported to
  it on its stdin, so it never waits for them; one that dies mid-stream is evicted by the
  producer (it watches consumer pids), and the others go on.
* ``--parallel N`` smaller than the number of trials runs the trials in *waves* of N, each
  wave with its own producer run of ``--epochs`` epochs. That keeps every trial's data exact
  and simple to reason about: each sees the whole stream, every epoch from its first batch.
  (One long-running producer with late joiners would make a trial that starts later join at
  an epoch boundary, and see fewer epochs, or more, than its neighbours.) The price: a wave
  ends with its slowest trial.
* Each trial's stdout and stderr go to ``<logs>/<trial>.log``; the producer's to
  ``<logs>/producer.log``. Progress: on a terminal, one line per trial (waiting / running /
  done / failed, elapsed, the last line of its log) redrawn every second; otherwise one plain
  line whenever a trial changes state.
* A trainer reports its outcome with one line ``RESULT {json}`` (``consumer/train.py`` prints
  ``{"loss", "samples_per_s", "samples", "epochs"}``); the last such line of its log goes
  into the summary: a table on stdout, ``<logs>/summary.json`` and ``<logs>/summary.csv``.
* Ctrl-C (or SIGTERM): the trainers are terminated (their process groups: SIGTERM, then
  SIGKILL after 5 s), the producer is told to end the stream and free its shared memory, the
  summary is written with the interrupted trials marked ``stopped``, and the exit code is 130
  (143 for SIGTERM).

Modules: this one (arguments, trials, processes, the run); ``cli_sweep_report`` (the live
progress and the summary); ``cli_sweep_producer`` (the producer child).

Exit codes: 0 every trial succeeded; 1 at least one failed; 2 a usage error (a bad
``--grid``, ``--pipeline`` or ``--trainer``), or the producer could not start (the pipeline
raised, say: the end of ``producer.log`` is printed); 130 interrupted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from . import endpoint as endpoints
from .cli_common import positive_int
from .cli_sweep_report import Display, summary_table, tail, write_summary
from .pipeline import PipelineError, keyvalue
from .pipeline import load as load_pipeline

__all__ = ["add_arguments", "main", "parse_result", "run"]

RESULT_PREFIX = "RESULT "
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_TICK = 0.1  # seconds between checks of the trial processes
_TERM_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a trainer
_PRODUCER_GRACE = 3.0  # after the last trial of a wave: time for the producer to finish alone
_PRODUCER_STOP = 15.0  # after "stop": time for the producer to close before SIGKILL


class SweepError(Exception):
    """A usage or setup error: printed as one message, exit code 2."""


# ---------------------------------------------------------------------------- arguments


def _grid(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise argparse.ArgumentTypeError(
            f"expected key=v1,v2,... with an option name as key (letters, digits, _ or -), got {text!r}"
        )
    items = [v.strip() for v in values.split(",")]
    if not values.strip() or any(not v for v in items):
        raise argparse.ArgumentTypeError(f"{text!r}: every value in key=v1,v2,... must be non-empty")
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r}: a value is repeated")
    return key, items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sweep's options to ``parser`` (the ``tensorsocket sweep`` subparser)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if not parser.epilog:
        parser.epilog = (
            "example:\n  tensorsocket sweep --pipeline producer/imagefolder.py:make_loader \\\n"
            "      --pipeline-arg root=data/jpeg-1024 --trainer 'python consumer/train.py --shared' \\\n"
            "      --grid lr=0.1,0.01 --grid seed=0,1 --epochs 2\n\n"
            "exit codes: 0 every trial succeeded, 1 a trial failed, 2 usage error, 130 interrupted"
        )
    parser.add_argument(
        "--pipeline",
        required=True,
        metavar="P",
        help="module:function or path/to/file.py:function returning the loader (called with --pipeline-arg)",
    )
    parser.add_argument(
        "--pipeline-arg",
        dest="pipeline_args",
        action="append",
        type=keyvalue,
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the pipeline function (repeatable; numbers become int/float)",
    )
    parser.add_argument(
        "--trainer",
        required=True,
        metavar="CMD",
        help="the training command, e.g. 'python consumer/train.py --shared'; each trial appends "
        "--KEY VALUE for its grid point and gets TENSORSOCKET_ENDPOINT in its environment",
    )
    parser.add_argument(
        "--grid",
        action="append",
        type=_grid,
        default=[],
        metavar="KEY=V1,V2,...",
        help="values of one trainer option (repeatable; the trials are every combination)",
    )
    parser.add_argument(
        "--parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="trials at once (default: all); more trials run in waves of N, each wave with its own "
        "producer run of --epochs epochs",
    )
    parser.add_argument(
        "--epochs", type=positive_int, default=1, help="epochs the producer serves per wave (default 1)"
    )
    parser.add_argument(
        "--slots",
        type=positive_int,
        default=8,
        help="batches the producer holds in shared memory (default 8)",
    )
    parser.add_argument(
        "--logs",
        default=None,
        metavar="DIR",
        help="where logs and summaries go (default ./sweep-logs/<time>)",
    )
    parser.add_argument("--name", default=None, help="producer name (default: a unique one)")


# ---------------------------------------------------------------------------- trials


@dataclass
class Trial:
    name: str
    params: dict[str, str]
    command: list[str]
    log: Path
    status: str = "waiting"  # waiting, running, done, failed, stopped, not run
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    result: dict[str, Any] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def params_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params.items()) or "-"

    def metric(self, key: str) -> Any:
        return None if self.result is None else self.result.get(key)


def parse_result(text: str) -> dict[str, Any] | None:
    """The JSON object of the last ``RESULT {...}`` line in ``text``, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(RESULT_PREFIX):
            try:
                value = json.loads(line[len(RESULT_PREFIX) :])
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _trainer_command(text: str) -> list[str]:
    try:
        command = shlex.split(text)
    except ValueError as exc:
        raise SweepError(f"--trainer {text!r}: {exc}") from None
    if not command:
        raise SweepError("--trainer is empty")
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    elif shutil.which(command[0]) is None and not Path(command[0]).is_file():
        raise SweepError(f"--trainer {text!r}: {command[0]!r} is not a program on PATH or a file")
    return command


def make_trials(args: argparse.Namespace, logs: Path) -> list[Trial]:
    grid: list[tuple[str, list[str]]] = list(args.grid)
    keys = [key for key, _ in grid]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise SweepError(f"--grid {repeated[0]} is given more than once; list all its values in one --grid")
    base = _trainer_command(args.trainer)
    points = list(itertools.product(*(values for _, values in grid)))
    width = max(2, len(str(len(points))))
    trials = []
    for i, point in enumerate(points, start=1):
        params = dict(zip(keys, point, strict=True))
        command = base + [part for key, value in params.items() for part in (f"--{key}", value)]
        name = f"trial-{i:0{width}d}"
        trials.append(Trial(name, params, command, logs / f"{name}.log"))
    return trials


# ---------------------------------------------------------------------------- processes


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _ProducerProcess:
    """The producer child: started, waited for until bound, told which trials exited."""

    def __init__(self, args: argparse.Namespace, name: str, consumers: int, logs: Path, wave: int) -> None:
        self.ready_file = logs / f".producer-{wave}.ready"
        self.ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "tensorsocket.sweep", "_serve", "--pipeline", args.pipeline]
        for key, value in args.pipeline_args:
            command += ["--pipeline-arg", f"{key}={value}"]
        command += [
            "--name", name,
            "--slots", str(args.slots),
            "--epochs", str(args.epochs),
            "--consumers", str(consumers),
            "--ready-file", str(self.ready_file),
        ]  # fmt: skip
        self.log = logs / "producer.log"
        with open(self.log, "ab") as log:
            log.write(f"--- wave {wave}: {shlex.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # Ctrl-C reaches the sweep only; it stops the producer in order
            )
        self.endpoint: str | None = None

    def ready(self) -> bool:
        """True once bound (then ``endpoint`` is set); raises SweepError if it exited first."""
        if self.endpoint is not None:
            return True
        if self.ready_file.exists():
            self.endpoint = self.ready_file.read_text().strip()
            self.ready_file.unlink(missing_ok=True)
            return True
        code = self.process.poll()
        if code is not None:
            raise SweepError(
                f"the producer did not start (exit code {code}); the end of {self.log}:\n{tail(self.log)}"
            )
        return False

    def tell(self, line: str) -> None:
        if self.process.stdin is None:
            return
        try:
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except OSError:  # it already exited
            pass

    def stop(self, grace: float) -> int | None:
        """Let it finish within ``grace`` s, else tell it to stop; SIGKILL as a last resort."""
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        self.tell("stop")
        try:
            return self.process.wait(_PRODUCER_STOP)
        except subprocess.TimeoutExpired:
            try:  # its process group: DataLoader workers included
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                self.process.kill()
            return self.process.wait()
        finally:
            if self.process.stdin is not None:
                try:
                    self.process.stdin.close()
                except OSError:
                    pass


def _start_trial(trial: Trial, endpoint: str) -> None:
    env = {
        **os.environ,
        endpoints.ENV: endpoint,
        "TENSORSOCKET_TRIAL": trial.name,
        "PYTHONUNBUFFERED": "1",
    }
    with open(trial.log, "wb") as log:
        log.write(f"# {trial.name}: {shlex.join(trial.command)}\n".encode())
        log.flush()
        try:
            trial.process = subprocess.Popen(
                trial.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        except OSError as exc:
            log.write(f"cannot start the trainer: {exc}\n".encode())
            trial.process = None
    trial.started = time.monotonic()
    trial.status = "running"
    if trial.process is None:
        _finish(trial, 127)


def _finish(trial: Trial, code: int, status: str | None = None) -> None:
    trial.ended = time.monotonic()
    trial.exit_code = code
    trial.status = status or ("done" if code == 0 else "failed")
    try:
        trial.result = parse_result(trial.log.read_text(errors="replace"))
    except OSError:
        trial.result = None


def _terminate(trials: list[Trial]) -> None:
    """SIGTERM the process group of every running trial, SIGKILL what is left after a grace."""
    running = [t for t in trials if t.process is not None and t.process.poll() is None]
    for t in running:
        assert t.process is not None
        try:
            os.killpg(t.process.pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + _TERM_GRACE
    for t in running:
        assert t.process is not None
        try:
            t.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(t.process.pid, signal.SIGKILL)
            except OSError:
                pass
            t.process.wait()
    for t in trials:
        if t.status == "running" and t.process is not None:
            _finish(t, t.process.returncode, "stopped")


def _run_wave(
    args: argparse.Namespace,
    name: str,
    wave: list[Trial],
    number: int,
    waves: int,
    logs: Path,
    display: Display,
) -> None:
    display.note = f" (wave {number}/{waves})" if waves > 1 else ""
    if waves > 1:
        display.event(f"wave {number}/{waves}: {', '.join(t.name for t in wave)}")
    producer = _ProducerProcess(args, name, len(wave), logs, number)
    try:
        while not producer.ready():
            time.sleep(0.05)
            display.refresh()
        assert producer.endpoint is not None
        for trial in wave:
            _start_trial(trial, producer.endpoint)
            display.changed(trial)
            if trial.status != "running":  # could not even start: the producer must not wait for it
                producer.tell("exited")
        while any(t.status == "running" for t in wave):
            time.sleep(_TICK)
            for trial in wave:
                if trial.status == "running" and trial.process is not None:
                    code = trial.process.poll()
                    if code is not None:
                        _finish(trial, code)
                        producer.tell("exited")
                        display.changed(trial)
            display.refresh()
        code = producer.stop(_PRODUCER_GRACE)
        if code not in (0, None):
            display.event(f"the producer exited with code {code}; see {producer.log}")
    except BaseException:
        _terminate(wave)
        producer.stop(0.0)
        raise


# ---------------------------------------------------------------------------- run


def _default_logs() -> Path:
    base = Path("sweep-logs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _prepare(args: argparse.Namespace) -> tuple[str, Path, list[Trial]]:
    load_pipeline(args.pipeline)  # fail early on a bad --pipeline; it is called in the producer child
    name = args.name or f"sweep-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        endpoints.resolve(name=name)
    except ValueError as exc:
        raise SweepError(f"--name: {exc}") from None
    logs = Path(args.logs) if args.logs else _default_logs()
    trials = make_trials(args, logs)  # before creating the folder: usage errors leave nothing behind
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepError(f"--logs {logs}: {exc}") from None
    return name, logs, trials


def run(args: argparse.Namespace) -> int:
    """Run the sweep described by ``args`` (from a parser set up by :func:`add_arguments`)."""
    try:
        name, logs, trials = _prepare(args)
    except (SweepError, PipelineError) as exc:
        print(f"tensorsocket sweep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parallel = min(args.parallel or len(trials), len(trials))
    waves = [trials[i : i + parallel] for i in range(0, len(trials), parallel)]
    meta = {
        "name": name,
        "pipeline": args.pipeline,
        "pipeline_args": dict(args.pipeline_args),
        "trainer": args.trainer,
        "grid": {key: values for key, values in args.grid},
        "epochs": args.epochs,
        "parallel": parallel,
        "logs": str(logs),
        "started": datetime.now().isoformat(timespec="seconds"),
    }
    display = Display(trials)
    print(
        f"sweep: {len(trials)} trial(s), {parallel} at a time"
        + (f" in {len(waves)} waves" if len(waves) > 1 else "")
        + f"; producer {name!r} serves {args.epochs} epoch(s) per wave; logs in {logs}",
        flush=True,
    )

    def on_signal(signum: int, frame: Any) -> None:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise _Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    code = EXIT_OK
    error: str | None = None
    try:
        for number, wave in enumerate(waves, start=1):
            _run_wave(args, name, wave, number, len(waves), logs, display)
    except (_Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        display.event(f"{signal.Signals(signum).name}: stopping the trainers and the producer")
        _terminate(trials)
        code = 128 + signum if signum != signal.SIGINT else EXIT_INTERRUPTED
    except (SweepError, PipelineError) as exc:
        error = str(exc)
        code = EXIT_USAGE
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in trials:
        if t.status == "waiting":
            t.status = "not run"
    display.refresh(force=True)
    if error is not None:
        sys.stdout.flush()
        print(f"tensorsocket sweep: error: {error}", file=sys.stderr, flush=True)
    meta["interrupted"] = code not in (EXIT_OK, EXIT_USAGE)
    write_summary(trials, logs, meta)
    if any(t.started is not None for t in trials):
        print("\n" + summary_table(trials), flush=True)
    print(f"\nlogs, summary.json and summary.csv in {logs}", flush=True)
    if code == EXIT_OK and any(t.status != "done" for t in trials):
        code = EXIT_FAIL
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorsocket.sweep``: the same as ``tensorsocket sweep``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_serve"]:
        from . import cli_sweep_producer

        return cli_sweep_producer.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m tensorsocket.sweep",
        description="Start one producer and one trainer per grid point, with live progress and a summary.",
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
