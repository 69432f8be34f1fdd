"""The processes of one sweep wave: its producer child and trainers, started, watched and stopped."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ... import endpoint as endpoints
from ...status import ConsumerStatus
from ..common import signals_held
from ..query import NoProducer, query_status
from .report import Display, tail
from .trial_clock import WaveClock
from .trials import SweepError, Trial, parse_result

_TICK = 0.1  # seconds between checks of the trial processes
_TERM_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a trainer
_PRODUCER_GRACE = 3.0  # after the last trial of a wave: time for the producer to finish alone
_PRODUCER_STOP = 15.0  # after "stop": time for the producer to close before SIGKILL
_POLL = 1.0  # seconds between status polls for --trial-timeout (consumers report each second)


class _ProducerProcess:
    """The producer child: started, waited for until bound, told which trials exited."""

    def __init__(self, args: argparse.Namespace, name: str, trials: int, logs: Path, wave: int) -> None:
        self.ready_file = logs / f".producer-{wave}.ready"
        self.ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "tensorsocket.cli.sweep", "_serve", "--pipeline", args.pipeline]
        for key, value in args.pipeline_args:
            command += ["--pipeline-arg", f"{key}={value}"]
        command += [
            "--name", name,
            "--slots", str(args.slots),
            "--epochs", str(args.epochs),
            "--trials", str(trials),
            "--per-trial", str(args.consumers_per_trial),
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
        """Let it finish within ``grace`` s, else tell it to stop; SIGKILL as a last resort.
        Not bound yet (importing, or in the pipeline function), it reads no stdin and served
        nothing: SIGTERM it, rather than wait ``_PRODUCER_STOP`` s for a "stop" it never reads."""
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        bound = self.endpoint is not None or self.ready_file.exists()
        if bound:
            self.tell("stop")
        else:
            try:  # (its handler raises KeyboardInterrupt: it exits at once, wherever it is)
                self.process.send_signal(signal.SIGTERM)
            except OSError:
                pass
        try:
            return self.process.wait(_PRODUCER_STOP if bound else _TERM_GRACE)
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
    with open(trial.log, "wb") as log, signals_held():  # (a stop then stops it: it is recorded)
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


class _Limit:
    """``--trial-timeout``: which running trials have run past it on their own account
    (:mod:`.trial_clock`), from the wave's producer's status, polled every ``_POLL`` s."""

    def __init__(self, seconds: float, wave: list[Trial], endpoint: str) -> None:
        self.seconds, self.endpoint = seconds, endpoint
        self.clock = WaveClock(t.name for t in wave)
        self.next_poll = 0.0

    def overran(self, wave: list[Trial]) -> set[str]:
        now = time.monotonic()
        running = [t for t in wave if t.status == "running" and t.started is not None]
        if now >= self.next_poll:
            try:
                status = query_status(self.endpoint, timeout=_POLL)
            except (NoProducer, RuntimeError):
                pass  # no answer this time (busy, or gone): the clocks go on as they are
            else:
                waits = [(_trial_of(c, running), c["waiting_s"]) for c in status["consumers"]]
                self.clock.poll(waits, {t.name for t in running}, time.monotonic())
            self.next_poll = time.monotonic() + _POLL
        return {t.name for t in running if self.clock.charged(t.name, t.started, now) > self.seconds}  # type: ignore[arg-type]


def _trial_of(consumer: ConsumerStatus, running: list[Trial]) -> str | None:
    """The trial a consumer belongs to: its process is in the trial's process group (the
    trainer, or a process it started: torchrun's ranks), else it carries the trial's name
    as its label (the default, from TENSORSOCKET_TRIAL)."""
    try:
        group = os.getpgid(consumer["pid"])
    except OSError:  # gone, or in another pid namespace
        group = None
    for t in running:
        if t.process is not None and t.process.pid == group:
            return t.name
    return consumer["label"]


def terminate(trials: list[Trial], status: str = "stopped") -> None:
    """SIGTERM the process group of every running trial, SIGKILL what is left after a grace;
    those that were running end with ``status``."""
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
            _finish(t, t.process.returncode, status)


def run_wave(
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
    producer = None
    try:
        with signals_held():  # (a stop then stops it: it is recorded)
            producer = _ProducerProcess(args, name, len(wave), logs, number)
        while not producer.ready():
            time.sleep(0.05)
            display.refresh()
        assert producer.endpoint is not None
        for trial in wave:
            _start_trial(trial, producer.endpoint)
            display.changed(trial)
            if trial.status != "running":  # could not even start: the producer must not wait for it
                producer.tell("exited")
        limit = _Limit(args.trial_timeout, wave, producer.endpoint) if args.trial_timeout else None
        while any(t.status == "running" for t in wave):
            time.sleep(_TICK)
            overran = set() if limit is None else limit.overran(wave)
            for trial in wave:
                if trial.status == "running" and trial.process is not None:
                    code = trial.process.poll()
                    if code is not None:
                        _finish(trial, code)
                    elif trial.name in overran:  # hung, say: it holds up its wave
                        terminate([trial], "timed out")
                    else:
                        continue
                    producer.tell("exited")
                    display.changed(trial)
            display.refresh()
        code = producer.stop(_PRODUCER_GRACE)
        if code not in (0, None):
            display.event(f"the producer exited with code {code}; see {producer.log}")
    except BaseException:
        terminate(wave)
        if producer is not None:
            producer.stop(0.0)
        raise
