"""The JPEG image-folder pipeline with decode and augmentation on the GPU: one decoder for
every trainer when a tensorsocket producer serves it.

Why: when the CPU cannot decode fast enough even once, users move decoding to the GPU
(nvJPEG through ``torchvision.io.decode_jpeg(device="cuda")``), and then every trainer of a
sweep runs its own GPU decoder: the same work and the same decoder memory N times. Served by
``tensorsocket serve producer/imagefolder_gpu.py:make_loader --device cuda``, the batches are
decoded and augmented once, on the GPU, and handed to every trainer device to device.

Same dataset layout, same options and the same transforms as :mod:`producer.imagefolder`
(whose listing, crop sampling and constants this module imports): DataLoader workers only
read files (encoded bytes as uint8 tensors), the main process decodes a whole batch at once
and crops, resizes, flips and normalises each image on ``device``. The batch is
``(images float32 (B, 3, 224, 224), labels int64 (B,))``, both on ``device``.

Randomness is a pure function of ``seed``, the epoch and the sample: the order is that of a
one-replica ``DistributedSampler`` (``seed + epoch``), each sample's crop and flip come from
a ``random.Random`` seeded with (seed, epoch, dataset index). So the batches do not depend on
the number of workers, a second run gives the same ones, and a restarted producer that is
told the epoch (``set_epoch``, as tensorsocket's producer calls it) gives them again.

``decoder="torchvision"`` (the default) decodes with ``torchvision.io.decode_jpeg``: nvJPEG on a
GPU, libjpeg-turbo on the CPU. ``decoder="pillow"`` (``device="cpu"`` only) decodes with
Pillow, as the CPU pipeline does: the reference, and the way to run this pipeline's structure
where torchvision is not importable.

Run ``python -m producer.imagefolder_gpu`` to print this machine's decode + augment rate.
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import random
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:  # loaded as a file (tensorsocket serve producer/imagefolder_gpu.py:make_loader)
    sys.path.insert(0, _ROOT)

from producer.imagefolder import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolderDataset,
    _center_crop_box,
    _random_resized_crop_box,
)

__all__ = [
    "DECODERS",
    "GpuImageFolderLoader",
    "GpuPipelineUnavailable",
    "decode_batch",
    "make_loader",
    "torchvision_problem",
]

DECODERS = ("torchvision", "pillow")
_JPEG_MAGIC = b"\xff\xd8"


class GpuPipelineUnavailable(RuntimeError):
    """This pipeline cannot run here as asked: no such CUDA GPU, or no usable torchvision."""


def torchvision_problem() -> str | None:
    """Why ``torchvision.io`` cannot be used here, or None when it can. Any exception counts:
    a torchvision built for another torch (a CUDA build next to a CPU torch, say) fails to
    import with a RuntimeError, not an ImportError."""
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:
        return f"torchvision cannot be imported ({type(exc).__name__}: {exc})"
    return None


# --------------------------------------------------------------------------- reading (workers)


class EncodedImageFolder(ImageFolderDataset):
    """The CPU pipeline's listing of ``root/<class>/<image>``; a sample is the file's encoded
    bytes (uint8 tensor), its label and its index, read in a DataLoader worker."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:  # type: ignore[override]
        path, label = self.samples[index]
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        return data, label, index


def keep_list(samples: list[Any]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """DataLoader ``collate_fn``: the encoded files stay a list (their lengths differ), as
    ``decode_jpeg`` takes them; labels and indices as lists of ints."""
    datas, labels, indices = zip(*samples, strict=True)
    return list(datas), list(labels), list(indices)


# --------------------------------------------------------------------------- decoding (main process)


def _pillow_decode(data: torch.Tensor) -> torch.Tensor:
    with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
        rgb = np.asarray(img.convert("RGB"))
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


def decode_batch(
    datas: Sequence[torch.Tensor], device: torch.device | str, decoder: str
) -> list[torch.Tensor]:
    """Decode encoded files into RGB uint8 CHW tensors on ``device``: with torchvision, every
    JPEG of the batch in one ``decode_jpeg`` call (nvJPEG's batched decode on a GPU), other
    formats one by one on the CPU; with Pillow, one by one as the CPU pipeline does."""
    device = torch.device(device)
    if decoder == "pillow":
        return [_pillow_decode(d) for d in datas]
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    rgb = ImageReadMode.RGB
    is_jpeg = [bytes(d[:2].tolist()) == _JPEG_MAGIC for d in datas]
    jpegs = [d for d, jpeg in zip(datas, is_jpeg, strict=True) if jpeg]
    decoded = iter(decode_jpeg(jpegs, mode=rgb, device=device) if jpegs else [])
    pairs = zip(datas, is_jpeg, strict=True)
    return [next(decoded) if jpeg else decode_image(d, mode=rgb).to(device) for d, jpeg in pairs]


# --------------------------------------------------------------------------- the loader


class GpuImageFolderLoader:
    """Iterable of ``(images, labels)`` batches on ``device``; re-iterable once per epoch.

    ``set_epoch(epoch)`` picks the epoch the next iteration produces; without it, iterations
    count 0, 1, 2, ... as a DataLoader's epochs go on.

    ``threads`` > 1: that many batches are made at once, each in a thread of its own and (on a
    GPU) on a CUDA stream of its own, and handed out in order, the caller's stream made to
    wait for each. Why: one thread launches a few small kernels an image and waits for its
    batch's decode; while it does, the GPU idles, and beside training processes each wait is
    a turn of theirs. The decodes themselves do not overlap (torchvision decodes under one
    process-wide lock, and waits for each); the crops, resizes and their launching do. The
    batches are the same whatever ``threads`` (each image's crop and flip are drawn from its
    own seed)."""

    def __init__(
        self, loader: DataLoader, sampler: DistributedSampler, device: torch.device, decoder: str,
        train: bool, seed: int, out_size: int = 224, threads: int = 1,
    ) -> None:  # fmt: skip
        self.loader, self.sampler, self.device, self.decoder = loader, sampler, device, decoder
        self.dataset: ImageFolderDataset = loader.dataset  # type: ignore[assignment]
        self.train, self.seed, self.out_size, self.threads = train, seed, out_size, threads
        self._epoch = 0
        # The pool threads' CUDA streams, made once for the loader's life (torch's caching
        # allocator reuses a freed block on the stream that freed it only) and lent per batch
        self._streams: queue.SimpleQueue[torch.cuda.Stream] = queue.SimpleQueue()
        std = torch.tensor(IMAGENET_STD, dtype=torch.float32)
        # x_norm = (x / 255 - mean) / std = x * scale + shift, per channel
        self._scale = (1.0 / (255.0 * std)).view(1, 3, 1, 1).to(device)
        self._shift = (-torch.tensor(IMAGENET_MEAN, dtype=torch.float32) / std).view(1, 3, 1, 1).to(device)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        self.sampler.set_epoch(epoch)
        if self.threads == 1:
            for datas, labels, indices in self.loader:
                yield self.transform(datas, labels, indices, epoch)
            return
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="gpu-pipeline") as pool:
            try:
                for item in self.loader:  # one batch queued beyond those in flight
                    pending.append(pool.submit(self._transform_apart, *item, epoch))
                    if len(pending) > self.threads:
                        yield self._handed(*pending.popleft().result())
                while pending:
                    yield self._handed(*pending.popleft().result())
            finally:  # (closed early: what has not started never does; the rest is waited for)
                for future in pending:
                    future.cancel()

    def _transform_apart(
        self, datas: Sequence[torch.Tensor], labels: Sequence[int], indices: Sequence[int], epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """:meth:`transform` in a pool thread, on a stream of its own; the event its work ends with."""
        if self.device.type != "cuda":
            return (*self.transform(datas, labels, indices, epoch), None)
        stream = self._lend_stream()
        try:
            # The stream's last batch done first: torchvision's decode allocates its output on
            # the current stream but writes it on a stream of its own, without waiting for
            # this one, so it could write blocks that queued kernels still read (pytorch/vision
            # #9606). One at a time, the caller's wait for each batch does this.
            stream.synchronize()
            with torch.cuda.stream(stream):
                images, targets = self.transform(datas, labels, indices, epoch)
                done = torch.cuda.Event()
                done.record(stream)
        finally:
            self._streams.put(stream)
        return images, targets, done

    def _lend_stream(self) -> torch.cuda.Stream:
        """A stream no other pool thread uses now, made when none is free: at most ``threads``
        are ever made, as each of the pool's ``threads`` threads gives its stream back."""
        try:
            return self._streams.get_nowait()
        except queue.Empty:
            return torch.cuda.Stream(self.device)

    def _handed(
        self, images: torch.Tensor, targets: torch.Tensor, done: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch made on another stream, ready for the caller's: its stream waits for the
        batch's work, and the caching allocator reuses the memory only after the caller's uses."""
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            images.record_stream(current)
            targets.record_stream(current)
        return images, targets

    def transform(
        self, datas: Sequence[torch.Tensor], labels: Sequence[int], indices: Sequence[int], epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a batch and apply the CPU pipeline's transform to each image on the device."""
        images = decode_batch(datas, self.device, self.decoder)
        size = (self.out_size, self.out_size)
        out = torch.empty((len(images), 3, *size), dtype=torch.float32, device=self.device)
        for k, (image, index) in enumerate(zip(images, indices, strict=True)):
            height, width = image.shape[1:]
            rng = random.Random(f"{self.seed}/{epoch}/{index}")
            if self.train:
                left, top, right, bottom = _random_resized_crop_box(rng, width, height)
            else:
                left, top, right, bottom = _center_crop_box(width, height, 224 / 256)
            crop = image[None, :, top:bottom, left:right].float()
            # antialias: a reducing resize averages over the source, as Pillow's BILINEAR does
            resized = F.interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=True)
            if self.train and rng.random() < 0.5:
                resized = resized.flip(-1)
            out[k] = resized[0]
        out.mul_(self._scale).add_(self._shift)
        targets = torch.tensor(labels, dtype=torch.int64)
        if self.device.type == "cuda":
            # From pageable memory, CUDA first synchronises the stream (its "API synchronization
            # behavior"): a wait for the whole batch's decode and augment, which another process's
            # training stretches (benchmarks.decode_contention). Pinned, the copy is queued; torch's
            # pinned-memory cache keeps the block until the copy has run.
            targets = targets.pin_memory()
        return out, targets.to(self.device, non_blocking=True)


def _check_device(device: str, decoder: str) -> torch.device:
    """The device, or ValueError / GpuPipelineUnavailable saying in one line why this cannot run."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if decoder == "pillow" and dev.type != "cpu":
        raise ValueError("decoder='pillow' decodes on the CPU: use device='cpu', or decoder='torchvision'")
    problems = []
    if dev.type == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        problems.append(f"no CUDA GPU is visible (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible})")
    elif dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        problems.append(f"device {device!r} but this process sees {torch.cuda.device_count()} GPU(s)")
    why_not = torchvision_problem() if decoder == "torchvision" else None
    if why_not:
        problems.append(
            f"{why_not}: install the torchvision built for this torch (torch 2.X: torchvision 0.(X+15))"
        )
    if problems:
        raise GpuPipelineUnavailable(
            f"the GPU JPEG pipeline cannot run with device={device!r}, decoder={decoder!r}: "
            + "; ".join(problems)
            + "; producer/imagefolder.py:make_loader decodes on the CPU"
        )
    return dev


def make_loader(
    root: str | os.PathLike[str],
    batch_size: int = 32,
    num_workers: int = 2,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    train: bool = True,
    pin_memory: bool = False,
    device: str = "cuda",
    decoder: str = "torchvision",
    threads: int = 1,
) -> GpuImageFolderLoader:
    """Return a loader yielding ``(images float32 (B, 3, 224, 224), labels int64 (B,))`` on
    ``device``: :func:`producer.imagefolder.make_loader`'s options, batches and transforms,
    decoded and augmented on the GPU, ``threads`` batches at once (see
    :class:`GpuImageFolderLoader`). Raises ValueError for a bad option, GpuPipelineUnavailable
    (one line) when ``device`` is a GPU this process cannot use or torchvision does not import."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    dev = _check_device(device, decoder)
    dataset = EncodedImageFolder(root, train=train, seed=seed)
    # One replica: a reproducible permutation of the whole dataset by seed + epoch.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=keep_list,
        drop_last=drop_last,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
    return GpuImageFolderLoader(loader, sampler, dev, decoder, train, seed, threads=threads)


# --------------------------------------------------------------------------- measurement


class _Synchronized:
    """A loader whose batches count only once the GPU finished them (the work is queued
    asynchronously; the rate must include it). The caller's stream, which waited for the
    batch: a device-wide synchronize would wait for the batches other threads are making."""

    def __init__(self, loader: GpuImageFolderLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            if self.loader.device.type == "cuda":
                torch.cuda.current_stream(self.loader.device).synchronize()
            yield batch


def _main() -> None:
    from producer.imagefolder import measure

    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", default="cuda")
        parser.add_argument("--decoder", choices=DECODERS, default="torchvision")
        parser.add_argument("--threads", type=int, nargs="+", default=[1], help="batches made at once")

    # Said before the dataset is made (seconds of JPEG encoding) when this cannot run here.
    early = argparse.ArgumentParser(add_help=False)
    options(early)
    asked, rest = early.parse_known_args()
    try:
        if not {"-h", "--help"} & set(rest):  # (its options are listed anywhere)
            _check_device(asked.device, asked.decoder)
    except (GpuPipelineUnavailable, ValueError) as exc:
        raise SystemExit(str(exc)) from None

    def variants(args: argparse.Namespace) -> list[tuple[str, tuple[int, int]]]:
        print(f"device={args.device}, decoder={args.decoder}; num_workers read files")
        return [(f"num_workers={w}, threads={t}", (w, t)) for w in args.workers for t in args.threads]

    def make(args: argparse.Namespace, root: Path, variant: tuple[int, int]) -> _Synchronized:
        workers, threads = variant
        return _Synchronized(
            make_loader(
                root, args.batch_size, workers, device=args.device, decoder=args.decoder, threads=threads
            )
        )

    measure(make, "Measure the GPU JPEG decode + augment pipeline.", [2], options, variants)


if __name__ == "__main__":
    _main()
