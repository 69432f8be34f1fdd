"""The ``tensorsocket`` command (also ``python -m tensorsocket``).

    tensorsocket serve PIPELINE [--name N | --endpoint E] [--slots 8] [--epochs N] [--replay 1G]
                       [--min-consumers N] [--grace S] [--stragglers stall|skip] [--max-lag N] ...
    tensorsocket status [--name N | --endpoint E] [--watch [SECONDS]] [--count N] [--json]
    tensorsocket sweep ...            (see tensorsocket sweep --help)
    tensorsocket demo [--trainers 3] [--images 1024] [--epochs 2]

Each command lives in its own module (``cli_serve``, ``cli_status``, ``sweep``; ``demo``
here) and imports torch and the producer only when it runs, so ``--help`` and ``status``
start fast.

Exit codes: 0 success (a graceful stop of ``serve`` included), 1 a runtime failure (nothing
serves the name, the name is already served, the loader failed mid-stream), 2 a usage error
(bad arguments, a PIPELINE that cannot be loaded or whose function raises).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from . import cli_serve, cli_status
from .cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, error, positive_int
from .cli_status import NoProducer, bottleneck, format_status, gpu_lines, query_status
from .pipeline import PipelineError

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

try:  # provided by tensorsocket/sweep.py: add_arguments(parser) and run(args) -> int
    from . import sweep as _sweep_cmd
except Exception as exc:  # not there (yet), one of its imports is missing, or it is broken
    _sweep_cmd = None
    _sweep_missing = f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------- demo


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="one producer feeding several trainers vs independent DataLoaders (about a minute)",
        description="Generate a small JPEG dataset (Pillow, nothing downloaded), run the trainers with "
        "their own DataLoaders and then on one shared producer, and print what each achieved. "
        "Needs a source checkout (it runs scripts/demo.py).",
    )
    p.add_argument("--trainers", type=positive_int, default=3, help="training processes (default 3)")
    p.add_argument(
        "--images", type=positive_int, default=1024, help="JPEGs in the generated dataset (default 1024)"
    )
    p.add_argument("--epochs", type=positive_int, default=2, help="epochs each trainer runs (default 2)")
    p.set_defaults(run=cmd_demo)


def _source_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    needed = [
        root / "benchmarks" / "sharing.py",
        root / "scripts" / "demo.py",
        root / "producer" / "imagefolder.py",
    ]
    return root if all(p.is_file() for p in needed) else None


def cmd_demo(args: argparse.Namespace) -> int:
    root = _source_root()
    if root is None:
        error(
            "`tensorsocket demo` needs a source checkout (it runs scripts/demo.py with benchmarks/ "
            "and producer/ beside the package); install tensorsocket with `pip install -e .` from one"
        )
        return EXIT_USAGE
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("tensorsocket_demo_script", root / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = sys.argv
    sys.argv = [
        "tensorsocket demo",
        f"--trainers={args.trainers}",
        f"--images={args.images}",
        f"--epochs={args.epochs}",
    ]
    try:
        module.main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        return 130
    finally:
        sys.argv = saved
    return EXIT_OK


# ---------------------------------------------------------------------------- sweep


def _add_sweep(sub: Any) -> None:
    if _sweep_cmd is not None:
        p = sub.add_parser(
            "sweep",
            help="one producer, one trainer per grid point",
            description="Start one producer and one trainer per grid point, with live progress and a summary.",
        )
        _sweep_cmd.add_arguments(p)
        p.set_defaults(run=_sweep_cmd.run)
    else:
        p = sub.add_parser("sweep", help="one producer, one trainer per grid point (not available)")
        p.set_defaults(run=_sweep_unavailable)


def _sweep_unavailable(args: argparse.Namespace) -> int:
    error(f"the sweep command is not available in this installation ({_sweep_missing})")
    return EXIT_USAGE


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="tensorsocket",
        description="Share one data loader's batches, zero-copy, with several training processes.",
    )
    parser.add_argument("--version", action="version", version=f"tensorsocket {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_serve.add_parser(sub)
    cli_status.add_parser(sub)
    _add_sweep(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not (args.command == "sweep" and _sweep_cmd is None):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return int(args.run(args))
    except (UsageError, PipelineError) as exc:
        error(str(exc))
        return EXIT_USAGE
    except (RuntimeError, PermissionError) as exc:  # e.g. "already serving", a bad runtime dir
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
