"""A small real training run on the JPEG image folder, with its own DataLoader or, with
``--shared``, with batches from a tensorsocket producer.

A convolutional classifier (plain ``torch.nn``: a strided 7x7 stem, two strided 3x3 convs,
global average pooling, a linear head; ~40 ms a step for 32 images of 224x224 on 2 CPU cores)
trained with SGD. The dataset's class sets the hue and the kind of shape of each image, so
the loss falls within a couple of epochs.

Switching a training script to tensorsocket is two lines, marked ``[tensorsocket 1/2]`` and
``[tensorsocket 2/2]`` below: the import, and the line that makes the loader. Everything
else (the epoch loop, the step) stays as it is.

    python3 consumer/train.py --data data/jpeg-1024 --epochs 2          # its own DataLoader
    tensorsocket serve producer/imagefolder.py:make_loader ... &        # or under `sweep`
    TENSORSOCKET_ENDPOINT=... python3 consumer/train.py --shared        # the shared one

At the end it prints one machine-readable line, which ``tensorsocket sweep`` reads:
``RESULT {"loss": ..., "samples_per_s": ..., "samples": ..., "epochs": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.imagefolder import make_loader  # noqa: E402
from tensorsocket import Consumer  # noqa: E402  [tensorsocket 1/2] the import

RESULT_PREFIX = "RESULT "


def make_model(classes: int = 10) -> nn.Module:
    """A few conv layers, downsampling early so a CPU step stays well under 100 ms."""

    def block(cin: int, cout: int, kernel: int, stride: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]

    return nn.Sequential(
        *block(3, 16, 7, 4),  # 224 -> 56
        *block(16, 32, 3, 2),  # 56 -> 28
        *block(32, 64, 3, 2),  # 28 -> 14
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """One optimiser step on a batch; the batch's loss summed over its samples (the examples
    next to this one train the same way)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.item() * len(labels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small CNN on a folder of JPEGs, with its own DataLoader or (--shared) "
        "with batches from a tensorsocket producer."
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="take batches from the tensorsocket producer at $TENSORSOCKET_ENDPOINT instead of a DataLoader",
    )
    parser.add_argument(
        "--data",
        default="./data/jpeg-1024",
        help="image folder for the plain DataLoader (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs to train (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument(
        "--batch-size",
        "--batch_size",
        type=int,
        default=32,
        help="batch size (default: %(default)s); with --shared the producer's batches are re-cut to it",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="DataLoader worker processes, plain mode (default: %(default)s)",
    )
    parser.add_argument(
        "--max-batches",
        "--max_batches",
        type=int,
        default=None,
        help="stop each epoch after this many batches (for quick tests)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation")
    parser.add_argument("--classes", type=int, default=10, help="number of classes (default: %(default)s)")
    parser.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="print a progress line every N batches (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    for option in ("epochs", "batch_size", "log_every", "classes"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    if args.workers < 0:
        parser.error("--workers must be >= 0")
    if args.max_batches is not None and args.max_batches < 1:
        parser.error("--max-batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(args.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    if args.shared:
        loader = Consumer(batch_size=args.batch_size)  # [tensorsocket 2/2] was: make_loader(...) below
    else:
        loader = make_loader(args.data, batch_size=args.batch_size, num_workers=args.workers)
    source = "shared producer" if args.shared else f"DataLoader on {args.data}"
    print(f"training on the {source} ({device}) for {args.epochs} epoch(s), lr={args.lr}", flush=True)

    model.train()
    samples = counted = epochs_done = 0
    clock: float | None = None  # starts at the first batch: start-up is not throughput
    final_loss: float | None = None
    try:
        for epoch in range(args.epochs):
            loss_sum, seen, batches = 0.0, 0, 0
            for images, labels in loader:
                if clock is None:
                    clock = time.perf_counter()
                else:
                    counted += len(labels)
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                loss_sum += train_step(model, optimizer, loss_fn, images, labels)
                seen += len(labels)
                batches += 1
                if batches % args.log_every == 0:
                    rate = counted / max(time.perf_counter() - clock, 1e-9)
                    print(
                        f"epoch {epoch} batch {batches}: loss {loss_sum / seen:.4f}, {rate:.1f} samples/s",
                        flush=True,
                    )
                del images, labels  # a shared batch's slot is freed once nothing holds it
                if args.max_batches is not None and batches >= args.max_batches:
                    break
            if seen == 0:  # the producer served fewer epochs than asked for
                print(f"epoch {epoch}: no batches; stopping", flush=True)
                break
            samples += seen
            epochs_done += 1
            final_loss = loss_sum / seen
            print(f"epoch {epoch}: mean loss {final_loss:.4f} over {seen} samples", flush=True)
    finally:
        close = getattr(loader, "close", None)  # a Consumer leaves its producer; a DataLoader has none
        if close is not None:
            close()

    elapsed = time.perf_counter() - clock if clock is not None else 0.0
    rate = counted / elapsed if counted and elapsed > 0 else 0.0
    result = {
        "loss": None if final_loss is None else round(final_loss, 6),
        "samples_per_s": round(rate, 2),
        "samples": samples,
        "epochs": epochs_done,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if epochs_done else 1


if __name__ == "__main__":
    sys.exit(main())
