"""``tensorsocket sweep``'s run: the trials in waves, Ctrl-C and SIGTERM, and the summary at the end."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from ... import endpoint as endpoints
from ...pipeline import PipelineError
from ...pipeline import load as load_pipeline
from ..common import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, detach_output, handling
from .processes import run_wave, terminate
from .report import Display, summary_table, write_summary
from .trials import SweepError, Trial, make_trials


class _Interrupted(BaseException):
    """A stop signal (SIGTERM, SIGHUP; SIGINT too), raised where it landed. Not an Exception,
    as KeyboardInterrupt is not: an ``except Exception`` it landed in (msgpack's decode of a
    status reply, under ``--trial-timeout``) took it for that code's own error and dropped it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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

    finishing = [False]  # the waves are over and the summary is written (set with no call)

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writing to it would fail the clean-up
            detach_output()
        if finishing[0] or handling(_Interrupted, KeyboardInterrupt):
            return  # the trials and the producer are stopped, or the summary written: not cut short
        # Else this is the first, or the first's exception was swallowed where it landed (a
        # __del__, say): raised again, as ignoring it would leave the sweep unstoppable.
        raise _Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    code = EXIT_OK
    error: str | None = None
    try:
        try:
            for number, wave in enumerate(waves, start=1):
                run_wave(args, name, wave, number, len(waves), logs, display)
        except (_Interrupted, KeyboardInterrupt) as exc:
            signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
            display.event(f"{signal.Signals(signum).name}: stopping the trainers and the producer")
            terminate(trials)
            code = 128 + signum if signum != signal.SIGINT else EXIT_INTERRUPTED
        except (SweepError, PipelineError) as exc:
            error = str(exc)
            code = EXIT_USAGE
        finishing[0] = True
        return _report(trials, logs, meta, display, code, error)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(
    trials: list[Trial], logs: Path, meta: dict[str, Any], display: Display, code: int, error: str | None
) -> int:
    """Write the summary and print the table; the exit code."""
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
