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

Exit codes: 0 every trial succeeded; 1 at least one failed; 2 a usage error (a bad
``--grid``, ``--pipeline`` or ``--trainer``), or the producer could not start (the pipeline
raised, say: the end of ``producer.log`` is printed); 130 interrupted.
"""

from __future__ import annotations

import argparse
import csv
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
from typing import IO, Any

from . import endpoint as endpoints
from .pipeline import PipelineError, convert, describe, keyvalue
from .pipeline import load as load_pipeline

__all__ = ["add_arguments", "main", "parse_result", "run"]

RESULT_PREFIX = "RESULT "
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_TICK = 0.1  # seconds between checks of the trial processes
_REFRESH = 1.0  # seconds between redraws of the live status on a terminal
_TERM_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a trainer
_PRODUCER_GRACE = 3.0  # after the last trial of a wave: time for the producer to finish alone
_PRODUCER_STOP = 15.0  # after "stop": time for the producer to close before SIGKILL
_STUCK_EXIT = 30.0  # the producer child kills itself if still running this long after a stop


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
        type=_positive,
        default=None,
        metavar="N",
        help="trials at once (default: all); more trials run in waves of N, each wave with its own "
        "producer run of --epochs epochs",
    )
    parser.add_argument(
        "--epochs", type=_positive, default=1, help="epochs the producer serves per wave (default 1)"
    )
    parser.add_argument(
        "--slots", type=_positive, default=8, help="batches the producer holds in shared memory (default 8)"
    )
    parser.add_argument(
        "--logs",
        default=None,
        metavar="DIR",
        help="where logs and summaries go (default ./sweep-logs/<time>)",
    )
    parser.add_argument("--name", default=None, help="producer name (default: a unique one)")


# ---------------------------------------------------------------------------- pipelines


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


# ---------------------------------------------------------------------------- display


_STATE_WORD = {"waiting": "waiting", "running": "running", "done": "done", "failed": "FAILED"}


class Display:
    """Live progress: a redrawn block of lines on a terminal, plain event lines otherwise."""

    def __init__(self, trials: list[Trial], stream: IO[str] | None = None) -> None:
        self.trials = trials
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty()
        self.drawn = 0
        self.last_draw = 0.0
        self.started = time.monotonic()
        self.note = ""

    def event(self, message: str) -> None:
        """A line worth keeping (on a terminal, printed above the live block)."""
        self._clear()
        self.stream.write(message + "\n")
        self.stream.flush()
        self.refresh(force=True)

    def changed(self, trial: Trial) -> None:
        if self.tty:
            self.refresh(force=True)
            return
        if trial.status == "running":
            text = f"{trial.name} running: {trial.params_text()}"
        else:
            code = f"exit {trial.exit_code}" if trial.exit_code is not None else "not started"
            text = f"{trial.name} {trial.status} after {trial.elapsed:.1f} s ({code}): {trial.params_text()}"
            if trial.status == "failed":
                text += f"; log: {trial.log}"
        self.stream.write(f"[{time.monotonic() - self.started:7.1f} s] {text}\n")
        self.stream.flush()

    def refresh(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < _REFRESH:
            return
        self.last_draw = now
        columns, lines = shutil.get_terminal_size((100, 24))
        counts = {
            s: sum(t.status == s for t in self.trials) for s in ("running", "done", "failed", "waiting")
        }
        header = (
            f"sweep {now - self.started:6.0f} s: {counts['running']} running, {counts['done']} done, "
            f"{counts['failed']} failed, {counts['waiting']} waiting{self.note}"
        )
        order = {"running": 0, "failed": 1, "done": 2}
        rows = sorted(self.trials, key=lambda t: order.get(t.status, 3))
        room = max(1, lines - 3)
        shown, hidden = rows[:room], len(rows) - room
        width = max(len(t.name) for t in self.trials)
        text = [header]
        for t in sorted(shown, key=self.trials.index):
            state = _STATE_WORD.get(t.status, t.status)
            elapsed = f"{t.elapsed:6.0f} s" if t.started is not None else "      -"
            line = f"  {t.name:<{width}}  {state:<8} {elapsed}  {t.params_text()}"
            if t.status == "running":
                line += f"  | {_last_line(t.log)}"
            text.append(line[: columns - 1])
        if hidden > 0:
            text.append(f"  ... {hidden} more")
        self._clear()
        self.stream.write("\n".join(text) + "\n")
        self.stream.flush()
        self.drawn = len(text)

    def _clear(self) -> None:
        if self.tty and self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")  # up to the block's first line, clear below
            self.drawn = 0


def _last_line(path: Path, limit: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


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
                f"the producer did not start (exit code {code}); the end of {self.log}:\n{_tail(self.log)}"
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


# ---------------------------------------------------------------------------- summary


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return format(value, spec)


def summary_table(trials: list[Trial]) -> str:
    header = ["trial", "params", "status", "exit", "samples/s", "loss", "time"]
    rows = [
        [
            t.name,
            t.params_text(),
            t.status,
            "-" if t.exit_code is None else str(t.exit_code),
            _fmt(t.metric("samples_per_s"), ".1f"),
            _fmt(t.metric("loss"), ".4f"),
            f"{t.elapsed:.1f}s" if t.started is not None else "-",
        ]
        for t in trials
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    left = {0, 1, 2}
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


def write_summary(trials: list[Trial], logs: Path, meta: dict[str, Any]) -> None:
    records = [
        {
            "trial": t.name,
            "params": {k: convert(v) for k, v in t.params.items()},
            "command": t.command,
            "status": t.status,
            "exit_code": t.exit_code,
            "elapsed_s": round(t.elapsed, 3) if t.started is not None else None,
            "samples_per_s": t.metric("samples_per_s"),
            "loss": t.metric("loss"),
            "result": t.result,
            "log": str(t.log),
        }
        for t in trials
    ]
    (logs / "summary.json").write_text(json.dumps({**meta, "trials": records}, indent=2) + "\n")
    keys = list(trials[0].params) if trials else []
    with open(logs / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", *keys, "status", "exit_code", "elapsed_s", "samples_per_s", "loss", "log"])
        for t, r in zip(trials, records, strict=True):
            writer.writerow(
                [t.name, *(t.params[k] for k in keys)]
                + [
                    "" if r[k] is None else r[k]
                    for k in ("status", "exit_code", "elapsed_s", "samples_per_s", "loss")
                ]
                + [r["log"]]
            )


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


# ---------------------------------------------------------------------------- the producer child


def _serve(argv: list[str]) -> int:
    """``python -m tensorsocket.sweep _serve``: the sweep's producer process.

    Binds, writes its endpoint to ``--ready-file``, waits until every one of ``--consumers``
    trials joined or was reported on stdin as ``exited``, serves ``--epochs`` epochs and
    exits. ``stop`` on stdin, or stdin closing (the sweep is gone), ends the stream early.
    """
    import logging

    from .producer import Producer

    parser = argparse.ArgumentParser(prog="python -m tensorsocket.sweep _serve")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--pipeline-arg", dest="pipeline_args", action="append", type=keyvalue, default=[])
    parser.add_argument("--name", required=True)
    parser.add_argument("--slots", type=_positive, default=8)
    parser.add_argument("--epochs", type=_positive, default=1)
    parser.add_argument("--consumers", type=_positive, required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("tensorsocket.sweep")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        function = load_pipeline(args.pipeline)
    except (SweepError, PipelineError) as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    try:
        loader = function(**dict(args.pipeline_args))
    except Exception as exc:
        log.error("the pipeline %s raised %s", args.pipeline, describe(exc), exc_info=True)
        return EXIT_USAGE
    try:
        producer = Producer(loader, name=args.name, slots=args.slots, min_consumers=1)
    except (TypeError, ValueError) as exc:
        log.error("the pipeline %s returned %s: %s", args.pipeline, type(loader).__name__, exc)
        return EXIT_USAGE
    except RuntimeError as exc:  # the name is served already
        log.error("%s", exc)
        return EXIT_USAGE
    return _WaveServer(producer, args.consumers, log).run(args.epochs, Path(args.ready_file))


class _WaveServer:
    """The producer child once bound: its main thread waits for the wave's trials and
    serves; a second thread reads the sweep's messages on stdin."""

    def __init__(self, producer: Any, consumers: int, log: Any) -> None:
        self.producer = producer
        self.consumers = consumers
        self.log = log
        self.lock = threading.Lock()  # guards exited, and serving vs stop
        self.exited = 0  # trials the sweep reported as exited
        self.serving = False  # serve() was entered: the stdin thread must close() to end it
        self.stop = threading.Event()  # "stop" or EOF on stdin
        self.closed = threading.Event()  # the stdin thread is done closing
        self.finished = threading.Event()  # the main thread is done

    def run(self, epochs: int, ready_file: Path) -> int:
        threading.Thread(target=self._watch_parent, name="tensorsocket-sweep-stdin", daemon=True).start()
        self.log.info(
            "producer pid %d on %s: waiting for %d trial(s)",
            os.getpid(),
            self.producer.endpoint,
            self.consumers,
        )
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(self.producer.endpoint)
        os.replace(tmp, ready_file)
        try:
            return self._serve(epochs)
        finally:
            self.finished.set()

    def _serve(self, epochs: int) -> int:
        from .host import pid_alive

        producer = self.producer
        try:
            while True:
                # Joined trials (whose process still lives) plus those that exited: once
                # that is every trial of the wave, nobody else is coming.
                joined = sum(pid_alive(c["pid"]) for c in producer.status()["consumers"])
                with self.lock:
                    if self.stop.is_set() or self.exited >= self.consumers:
                        why = "told to stop" if self.stop.is_set() else "every trial exited before joining"
                        self.log.info("%s; nothing served", why)
                        producer.close()
                        return EXIT_OK
                    if joined + self.exited >= self.consumers:
                        self.serving = True
                        break
                time.sleep(0.05)
            self.log.info("%d trial(s) joined; serving %d epoch(s)", joined, epochs)
            producer.serve(epochs=epochs)
        except KeyboardInterrupt:
            producer.close()
            return EXIT_INTERRUPTED
        except Exception as exc:
            if not self.stop.is_set():
                self.log.exception("serving failed")
                producer.close(reason=f"{type(exc).__name__}: {exc}")
                return EXIT_FAIL
        if self.stop.is_set():  # serve() ended because the stdin thread closed the producer
            self.closed.wait(60.0)  # let that close() finish: it frees the shared memory
            self.log.info("stopped")
        else:
            self.log.info("done")
        return EXIT_OK

    def _watch_parent(self) -> None:
        # Raw reads of fd 0, not sys.stdin: a thread blocked in sys.stdin.readline() holds
        # the buffer's lock, and a DataLoader worker forked meanwhile deadlocks closing its
        # inherited copy of sys.stdin (multiprocessing does that at start).
        pending = b""
        while True:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                break  # EOF: the sweep is gone
            *lines, pending = (pending + chunk).split(b"\n")
            if any(line.strip() == b"stop" for line in lines):
                break
            with self.lock:
                self.exited += sum(line.strip() == b"exited" for line in lines)
        with self.lock:
            self.stop.set()
            close = self.serving
        if close:  # serve() runs in the main thread: close() from here ends it cleanly
            self.producer.close()
        self.closed.set()
        if not self.finished.wait(_STUCK_EXIT):
            # The main thread is stuck (in the loader, say), and if the sweep is gone nobody
            # else will end this process: take it down, with its DataLoader workers.
            self.log.error("still running %g s after the stop; killing this process", _STUCK_EXIT)
            if os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)
            os._exit(EXIT_FAIL)


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorsocket.sweep``: the same as ``tensorsocket sweep``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_serve"]:
        return _serve(argv[1:])
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
