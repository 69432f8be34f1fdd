"""The smallest training loop on a shared loader: the one line that differs from a
DataLoader loop is marked.

    python3 consumer/minimal.py --name quickstart --epochs 2
"""

from __future__ import annotations

import argparse
import time

from tensorsocket import Consumer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="quickstart")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    loader = Consumer(name=args.name)  # was: loader = DataLoader(dataset, batch_size=32, ...)
    for epoch in range(args.epochs):
        samples, start = 0, time.perf_counter()
        for _images, labels in loader:
            samples += len(labels)  # your training step goes here
        rate = samples / (time.perf_counter() - start)
        print(f"epoch {epoch}: {samples} samples in {len(loader)} batches, {rate:.0f} samples/s")
    loader.close()


if __name__ == "__main__":
    main()
