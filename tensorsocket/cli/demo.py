"""``tensorsocket demo``: run scripts/demo.py (one producer feeding several trainers vs their own loaders)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, error, positive_int


def add_parser(sub: Any) -> None:
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
    root = Path(__file__).resolve().parents[2]  # tensorsocket/cli/demo.py -> the checkout
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
        return EXIT_INTERRUPTED
    finally:
        sys.argv = saved
    return EXIT_OK
