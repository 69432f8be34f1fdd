"""The ``tensorsocket`` command (also ``python -m tensorsocket``): the argument parser and ``main``.

    tensorsocket serve PIPELINE [--name N | --endpoint E] [--slots 8] [--epochs N] [--replay 1G]
                       [--min-consumers N] [--grace S] [--stragglers stall|skip] [--max-lag N] ...
    tensorsocket status [--name N | --endpoint E] [--watch [SECONDS]] [--count N] [--json]
    tensorsocket sweep ...            (see tensorsocket sweep --help)
    tensorsocket demo [--trainers 3] [--images 1024] [--epochs 2]

Each command lives in its own module (``serve``, ``status``, ``sweep/``, ``demo``) and imports
torch and the producer only when it runs, so ``--help`` and ``status`` start fast.

Exit codes (:mod:`tensorsocket.cli.common`): 0 success (a graceful stop of ``serve``
included), 1 a runtime failure (nothing serves the name, the name is already served, the
loader failed mid-stream), 2 a usage error (bad arguments, a PIPELINE that cannot be loaded
or whose function raises), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import TensorSocketError
from ..pipeline import PipelineError
from ..status import bottleneck
from . import demo, serve, status, sweep
from .common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, error
from .gpu import gpu_lines
from .query import NoProducer, query_status
from .status import format_status

__all__ = [
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_USAGE",
    "NoProducer",
    "UsageError",
    "bottleneck",
    "build_parser",
    "format_status",
    "gpu_lines",
    "main",
    "query_status",
]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="tensorsocket",
        description="Share one data loader's batches, zero-copy, with several training processes.",
    )
    parser.add_argument("--version", action="version", version=f"tensorsocket {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.add_parser(sub)
    status.add_parser(sub)
    sweep.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return int(args.run(args))
    except (UsageError, PipelineError) as exc:
        error(str(exc))
        return EXIT_USAGE
    # e.g. "already serving", a bad runtime dir, a GPU path the producer cannot open
    except (RuntimeError, PermissionError, TensorSocketError) as exc:
        error(str(exc))
        return EXIT_FAIL
    except BrokenPipeError:  # stdout closed (status | head): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
