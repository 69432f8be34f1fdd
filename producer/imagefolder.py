"""A folder-of-JPEGs input pipeline: the CPU-bound kind of loader tensorsocket exists to share.

Why: the case tensorsocket is for is an ImageNet-style pipeline (JPEG decode, random resized
crop, flip, normalise) whose CPU cost, paid once per trainer, is what starves collocated
jobs. This module makes a small, reproducible stand-in for that: :func:`make_dataset` writes
synthetic but JPEG-realistic images (gradients, shapes and noise, so they compress and decode
like photos rather than like flat colour or pure noise) into class folders, and
:func:`make_loader` reads them with the usual torchvision-style training transform written
with Pillow, NumPy and ``random`` only, because torchvision is not a dependency.

The class of an image also sets the hue of its background and its kind of shape, so the
dataset is (weakly) learnable and example training scripts show a falling loss.

Run ``python -m producer.imagefolder`` to print this machine's decode + augment rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset, get_worker_info

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFolderDataset",
    "make_dataset",
    "make_loader",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MARKER = ".tensorsocket-dataset.json"
_MARKER_VERSION = 1
_EXTENSIONS = (".jpg", ".jpeg", ".png")


# --------------------------------------------------------------------------- generation


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    i = int(h * 6.0) % 6
    f = h * 6.0 - int(h * 6.0)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, dtype=np.float32) * 255.0


def _render(rng: np.random.Generator, label: int, classes: int, size: tuple[int, int]) -> Image.Image:
    """One synthetic photo-like image: gradient + shapes + sensor-like noise."""
    base_w, base_h = size
    w = max(16, int(base_w * rng.uniform(0.75, 1.25)))
    h = max(16, int(base_h * rng.uniform(0.75, 1.25)))

    hue = (label / classes + rng.uniform(-0.04, 0.04)) % 1.0
    c0 = _hsv_to_rgb(hue, rng.uniform(0.4, 0.9), rng.uniform(0.5, 1.0))
    c1 = _hsv_to_rgb(
        (hue + rng.uniform(0.1, 0.3)) % 1.0,
        rng.uniform(0.2, 0.8),
        rng.uniform(0.2, 0.9),
    )
    angle = rng.uniform(0, 2 * math.pi)
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    ramp = xs / w * math.cos(angle) + ys / h * math.sin(angle)
    ramp = (ramp - ramp.min()) / max(float(ramp.max() - ramp.min()), 1e-6)
    pixels = c0 + ramp[..., None] * (c1 - c0)
    img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")

    draw = ImageDraw.Draw(img)
    kind = label % 3
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.uniform(-0.2, 1.0) * w, rng.uniform(-0.2, 1.0) * h
        x1, y1 = x0 + rng.uniform(0.1, 0.6) * w, y0 + rng.uniform(0.1, 0.6) * h
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            points = [(rng.uniform(x0, x1), rng.uniform(y0, y1)) for _ in range(int(rng.integers(3, 7)))]
            draw.polygon(points, fill=fill)

    arr = np.asarray(img, dtype=np.int16)
    noise = rng.normal(0.0, rng.uniform(3.0, 12.0), arr.shape)
    return Image.fromarray((arr + noise).clip(0, 255).astype(np.uint8), "RGB")


def make_dataset(
    root: str | os.PathLike[str],
    count: int = 512,
    size: tuple[int, int] = (320, 256),
    seed: int = 0,
    classes: int = 10,
    quality: int = 90,
) -> Path:
    """Write ``count`` JPEGs into ``root/class_XX/`` and return ``root`` as a Path.

    ``size`` is (width, height); each image varies by ±25 % around it. Idempotent: when
    ``root`` holds a marker from an identical call it returns at once. A marker from a
    different call raises ``ValueError`` rather than mixing two datasets in one folder.
    The marker is written last, so an interrupted run is simply redone.
    """
    if count < 1 or classes < 1:
        raise ValueError(f"count and classes must be >= 1, got count={count}, classes={classes}")
    if len(size) != 2 or min(size) < 16:
        raise ValueError(f"size must be (width, height) of at least 16 pixels, got {size}")
    root = Path(root)
    spec = {
        "version": _MARKER_VERSION,
        "count": count,
        "size": list(size),
        "seed": seed,
        "classes": classes,
        "quality": quality,
    }
    marker = root / MARKER
    if marker.exists():
        found = json.loads(marker.read_text())
        if found == spec:
            return root
        raise ValueError(
            f"{root} already holds a different generated dataset ({found}); "
            f"use another root or delete it to generate {spec}"
        )

    for label in range(classes):
        (root / f"class_{label:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        # One generator per image: any image can be regenerated alone.
        rng = np.random.default_rng([seed, i])
        label = i % classes
        img = _render(rng, label, classes, size)
        img.save(root / f"class_{label:02d}" / f"img_{i:06d}.jpg", quality=quality)

    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, marker)
    return root


# --------------------------------------------------------------------------- reading


def _random_resized_crop_box(
    rng: random.Random,
    width: int,
    height: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Return a crop box (left, top, right, bottom), sampled as torchvision's RandomResizedCrop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    # Fallback: the largest central crop whose aspect lies within ``ratio``.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _center_crop_box(width: int, height: int, crop_fraction: float) -> tuple[int, int, int, int]:
    """Central square covering ``crop_fraction`` of the shorter side (resize 256 → crop 224)."""
    side = round(min(width, height) * crop_fraction)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


class ImageFolderDataset(Dataset[tuple[torch.Tensor, int]]):
    """``root/<class>/<image>`` files as ``(float32 CHW tensor, class index)`` samples.

    Class indices follow the sorted folder names, as in torchvision's ImageFolder.
    ``train=True``: decode → RGB → random resized crop to ``out_size`` (scale 0.08–1, ratio
    3/4–4/3) → random horizontal flip → normalise with ImageNet mean/std. ``train=False``:
    the central crop of 224/256 of the shorter side, resized to ``out_size``.

    Randomness comes from ``self.rng`` (a ``random.Random``), seeded with ``seed`` in the
    main process and reseeded per DataLoader worker from ``torch.initial_seed()`` by
    :func:`seed_worker`, so a run is reproducible given the loader's generator.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        train: bool = True,
        out_size: int = 224,
        seed: int = 0,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"{self.root} is not a directory; create it with make_dataset()")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples: list[tuple[str, int]] = [
            (str(path), label)
            for label, name in enumerate(self.classes)
            for path in sorted((self.root / name).iterdir())
            if path.suffix.lower() in _EXTENSIONS
        ]
        if not self.samples:
            raise ValueError(f"no images with extensions {_EXTENSIONS} under {self.root}/<class>/")
        self.train = train
        self.out_size = out_size
        self.rng = random.Random(seed)
        # x_norm = (x / 255 - mean) / std = x * scale + shift, per channel.
        std_arr = np.asarray(std, dtype=np.float32)
        self._scale = (1.0 / (255.0 * std_arr)).astype(np.float32)
        self._shift = (-np.asarray(mean, dtype=np.float32) / std_arr).astype(np.float32)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
        width, height = img.size
        if self.train:
            box = _random_resized_crop_box(self.rng, width, height)
        else:
            box = _center_crop_box(width, height, 224 / 256)
        # resize(box=...) crops and resamples in one pass.
        img = img.resize((self.out_size, self.out_size), Image.Resampling.BILINEAR, box=box)
        if self.train and self.rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return self._to_tensor(img), label

    def _to_tensor(self, img: Image.Image) -> torch.Tensor:
        hwc = np.asarray(img, dtype=np.uint8)
        chw = np.empty((3, hwc.shape[0], hwc.shape[1]), dtype=np.float32)
        for c in range(3):
            np.multiply(hwc[:, :, c], self._scale[c], out=chw[c], casting="unsafe")
            chw[c] += self._shift[c]
        return torch.from_numpy(chw)


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: give each worker's dataset its own reproducible stream."""
    info = get_worker_info()
    if info is not None and isinstance(info.dataset, ImageFolderDataset):
        info.dataset.rng.seed(torch.initial_seed())


def make_loader(
    root: str | os.PathLike[str],
    batch_size: int = 32,
    num_workers: int = 2,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    train: bool = True,
    pin_memory: bool = False,
) -> DataLoader[tuple[torch.Tensor, int]]:
    """Return a DataLoader yielding ``(images float32 (B, 3, 224, 224), labels int64 (B,))``.

    Shuffling and worker seeds come from a ``torch.Generator`` seeded with ``seed``;
    workers are persistent so each epoch does not pay their start-up again.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    dataset = ImageFolderDataset(root, train=train, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=seed_worker if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


# --------------------------------------------------------------------------- measurement


def _rate(loader: DataLoader[tuple[torch.Tensor, int]], seconds: float) -> tuple[float, float, int]:
    """Return (time to first batch, samples/s after it, samples) over about ``seconds``."""
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    samples = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            images, _ = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        samples += images.shape[0]
    return first, samples / (time.perf_counter() - start), samples


def measure(
    make: Callable[[argparse.Namespace, Path, Any], Any],
    description: str,
    workers: Sequence[int] = (0, 2),
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    variants: Callable[[argparse.Namespace], list[tuple[str, Any]]] | None = None,
) -> None:
    """A pipeline module's ``python -m`` entry: make a dataset, then print the rate of the
    loader ``make(args, root, variant)`` returns, for each of ``variants(args)`` (label,
    variant) in turn; by default each ``--workers`` value, the variant a num_workers."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", help="dataset folder (default: a temporary one)")
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="total measuring time")
    parser.add_argument("--workers", type=int, nargs="+", default=list(workers))
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ts-imagefolder-") as tmp:
        root = Path(args.root) if args.root else Path(tmp)
        start = time.perf_counter()
        make_dataset(root, count=args.count)
        print(f"dataset: {args.count} images in {root} ready in {time.perf_counter() - start:.2f} s")
        # As in DataLoader workers; keeps the num_workers=0 figure a per-core one.
        torch.set_num_threads(1)
        runs = variants(args) if variants is not None else [(f"num_workers={w}", w) for w in args.workers]
        for label, variant in runs:
            loader = make(args, root, variant)
            first, rate, samples = _rate(loader, args.seconds / len(runs))
            print(f"{label}: {rate:7.1f} samples/s ({samples} samples; first batch after {first:.2f} s)")
            del loader


def _main() -> None:
    measure(
        lambda args, root, workers: make_loader(root, batch_size=args.batch_size, num_workers=workers),
        "Measure the JPEG decode + augment pipeline.",
    )


if __name__ == "__main__":
    _main()
