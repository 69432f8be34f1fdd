"""Serve the synthetic pipeline under a name: the producer half of the README quick start.

python3 producer/serve_synthetic.py --name quickstart --consumers 2 --epochs 2
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.synthetic import make_loader  # noqa: E402
from tensorsocket import Producer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="quickstart")
    parser.add_argument("--consumers", type=int, default=2, help="wait for this many before starting")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--work-ms", type=float, default=10.0, help="simulated loading cost per batch")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    loader = make_loader(batch_bytes=1 << 20, batch_size=32, batches=args.batches, work_ms=args.work_ms)
    Producer(loader, name=args.name, min_consumers=args.consumers).serve(epochs=args.epochs)


if __name__ == "__main__":
    main()
