"""The demo: three training processes each run with their own DataLoader over a JPEG
pipeline, then the same three run on one tensorsocket producer of that pipeline, and we print
what each got.

Runs on a CPU-only machine in about a minute; the JPEG dataset is generated locally with
Pillow on first run (in the checkout's data/, nothing is downloaded).

    bash scripts/setup.sh && python3 scripts/demo.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sharing import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="tensorsocket demo")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    result = run(
        trainers=args.trainers, images=args.images, epochs=args.epochs, modes=("independent", "shared")
    )
    runs, summary = result["runs"], result["per_trainer_samples_per_s"]
    print()
    print(f"{args.trainers} trainers, each a 10 ms simulated GPU step, JPEG decode + augment, batch 32:")
    print(f"{'':26}{'per-trainer samples/s':>24}")
    for i, r in enumerate(runs["independent"]):
        print(f"  own DataLoader #{i + 1:<9}{r['samples_per_s']:>24.1f}")
    for i, r in enumerate(runs["shared"]):
        check = "every batch, once" if r["exact"] else "MISSING OR EXTRA BATCHES"
        print(f"  tensorsocket consumer #{i + 1:<2}{r['samples_per_s']:>24.1f}   ({check})")
    print(f"\nshared / independent: {summary['shared_over_independent']:.2f}x per trainer")
    if not all(r["exact"] for r in runs["shared"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
