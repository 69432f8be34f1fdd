"""What a sweep runs: its options, the trials they describe (one per grid point), each trial's RESULT."""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...pipeline import keyvalue
from ..common import UsageError, positive_int, seconds

RESULT_PREFIX = "RESULT "
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")


class SweepError(UsageError):
    """A usage or setup error: printed as one message, exit code 2."""


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
            "exit codes: 0 every trial succeeded, 1 a trial failed, 2 usage error, 130 interrupted\n"
            "(Ctrl-C), 143 SIGTERM, 129 SIGHUP"
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
        "--consumers-per-trial",
        type=positive_int,
        default=1,
        metavar="N",
        help="consumers each trial opens before its first batch, e.g. the N ranks of "
        "'torchrun --nproc_per_node=N' (default 1): a wave starts once all of them joined",
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
    parser.add_argument(
        "--trial-timeout",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="stop a trial that has run this long on its own account: the time since it started, "
        "less what it waited for batches while another trial of its wave was busy (SIGTERM to "
        "its process group, SIGKILL 5 s later); it counts as failed, 'timed out', and its wave "
        "goes on without it (default: no limit; 0 is none either)",
    )


@dataclass
class Trial:
    name: str
    params: dict[str, str]
    command: list[str]
    log: Path
    status: str = "waiting"  # waiting, running, done, failed, timed out, stopped, not run
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
