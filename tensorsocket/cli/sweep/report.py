"""What ``tensorsocket sweep`` shows: the live progress, and the summary (table, summary.json, summary.csv).

The progress is a redrawn block on a terminal, plain event lines otherwise.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import IO, Any

from ...pipeline import convert
from .trials import Trial

_REFRESH = 1.0  # seconds between redraws of the live status on a terminal

# ---------------------------------------------------------------------------- display


_STATE_WORD = {
    "waiting": "waiting",
    "running": "running",
    "done": "done",
    "failed": "FAILED",
    "timed out": "TIMEOUT",
}


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
            if trial.status in ("failed", "timed out"):
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
        counts["failed"] += sum(t.status == "timed out" for t in self.trials)
        header = (
            f"sweep {now - self.started:6.0f} s: {counts['running']} running, {counts['done']} done, "
            f"{counts['failed']} failed, {counts['waiting']} waiting{self.note}"
        )
        order = {"running": 0, "failed": 1, "timed out": 1, "done": 2}
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
                line += f"  | {last_line(t.log)}"
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


def last_line(path: Path, limit: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


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


def _strict(value: Any) -> Any:
    """``value`` with each non-finite float (a diverged trainer's loss, a grid value ``nan``)
    as its text: NaN and Infinity are not JSON, and strict readers (jq, JavaScript) refuse a
    file that has them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


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
    text = json.dumps(_strict({**meta, "trials": records}), indent=2, allow_nan=False)
    (logs / "summary.json").write_text(text + "\n")
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
