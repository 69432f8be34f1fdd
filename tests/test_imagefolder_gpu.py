"""The GPU JPEG pipeline (``producer/imagefolder_gpu.py``): its structure on the CPU, its
decode against the CPU pipeline's Pillow decode, and one producer serving it to three
consumer processes over the GPU path.

On a machine without a GPU the pipeline runs with ``device="cpu"``: ``decoder="pillow"``
always, ``decoder="torchvision"`` where torchvision imports (a CUDA build of torchvision next
to a CPU torch does not: such tests skip, saying why). The sharing test runs over the CPU
stand-in of the CUDA primitives (``TENSORSOCKET_FAKE_CUDA=1``), so the GPU-marked tests, which
run the same helpers with nvJPEG and real CUDA IPC, are not running them for the first time.

Decoder tolerance: two JPEG decoders need not agree bit for bit (the standard leaves IDCT
precision and chroma upsampling to the decoder; nvJPEG's differ from libjpeg-turbo's), so a
decode "matches" Pillow's when the shapes are equal and the mean absolute difference is below
2 levels of 255: the bound torchvision's own tests put on nvJPEG against its CPU decoder. A
wrong decode (another image, swapped channels, a transposed image) is far above it, which the
test checks too, so it can fail. The bound holds the IDCT alone: on 4:4:4 copies of the images
in RGB, and on the 4:2:0 originals in luma, which JPEG does not subsample. In RGB, 4:2:0
files also differ by the chroma upsampling (libjpeg-turbo's triangle filter against nvJPEG's),
which this dataset's per-pixel colour noise makes large: 0.96 to 2.81 levels, H200, 2026-12-01.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from producer import imagefolder, imagefolder_gpu
from producer.imagefolder_gpu import GpuPipelineUnavailable, decode_batch, make_loader
from tests.support import SPAWN

ROOT = Path(__file__).resolve().parent.parent
COUNT = 37  # 4 full batches of 8 and one of 5
BATCH = 8
TORCHVISION = imagefolder_gpu.torchvision_problem()
DECODERS = [
    "pillow",
    pytest.param("torchvision", marks=pytest.mark.skipif(TORCHVISION is not None, reason=str(TORCHVISION))),
]
needs_torchvision = pytest.mark.skipif(TORCHVISION is not None, reason=str(TORCHVISION))
MEAN = torch.tensor(imagefolder.IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(imagefolder.IMAGENET_STD).view(1, 3, 1, 1)
DECODE_TOLERANCE = 2.0  # mean absolute difference, levels of 255 (see the module docstring)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """37 JPEGs of about 120x96 in 10 class folders, plus files the listing must skip."""
    path = imagefolder.make_dataset(tmp_path_factory.mktemp("jpegs"), count=COUNT, size=(120, 96))
    (path / "class_00" / "notes.txt").write_text("not an image")
    return path


def epochs_of(loader: Any, epochs: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(x.cpu(), y.cpu()) for x, y in loader] for _ in range(epochs)]


def batch_digest(images: torch.Tensor, labels: torch.Tensor) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(images.cpu().contiguous().numpy().tobytes())
    digest.update(labels.cpu().numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- structure (CPU)


def test_lists_the_same_files_and_classes_as_the_cpu_pipeline(root: Path) -> None:
    loader = make_loader(root, device="cpu", decoder="pillow", num_workers=0)
    cpu = imagefolder.ImageFolderDataset(root)
    assert loader.dataset.samples == cpu.samples and loader.dataset.classes == cpu.classes
    assert len(cpu.samples) == COUNT  # notes.txt is not listed


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_shapes_dtypes_and_value_ranges(root: Path, decoder: str, drop_last: bool) -> None:
    loader = make_loader(
        root, batch_size=BATCH, num_workers=2, device="cpu", decoder=decoder, drop_last=drop_last
    )
    sizes = [BATCH] * (COUNT // BATCH) + ([] if drop_last else [COUNT % BATCH])
    assert len(loader) == len(sizes)
    [batches] = epochs_of(loader, 1)
    assert [x.shape[0] for x, _ in batches] == sizes
    low, high = (0 - MEAN) / STD, (1 - MEAN) / STD  # bilinear averaging cannot leave [0, 255]
    for images, labels in batches:
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 224, 224)
        assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
        assert images.device.type == labels.device.type == "cpu"
        assert bool((images >= low - 1e-5).all()) and bool((images <= high + 1e-5).all())
        assert float(images.std()) > 0.1  # not a constant fill
        assert set(labels.tolist()) <= set(range(10))


def test_every_file_once_per_epoch_with_its_label(root: Path) -> None:
    """Eval mode is deterministic, so each shuffled image must be exactly the eval image of
    one file; that file's label must be the one beside it, and every file appears once."""
    reference = make_loader(root, batch_size=1, num_workers=0, shuffle=False, train=False, device="cpu",
                            decoder="pillow")  # fmt: skip
    samples = reference.dataset.samples
    by_bytes = {}
    for (image, label), (_, truth) in zip(reference, samples, strict=True):
        assert int(label) == truth
        by_bytes[image[0].numpy().tobytes()] = len(by_bytes)
    assert len(by_bytes) == COUNT
    shuffled = make_loader(root, batch_size=BATCH, num_workers=2, train=False, device="cpu", decoder="pillow")
    orders = []
    for epoch in epochs_of(shuffled, 2):
        order = [by_bytes[image.numpy().tobytes()] for images, _ in epoch for image in images]
        labels = [int(v) for _, labels in epoch for v in labels]
        assert sorted(order) == list(range(COUNT))
        assert labels == [samples[i][1] for i in order]
        orders.append(order)
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])  # shuffled, anew each epoch


def test_reproducible_from_seed_and_epoch_whatever_the_workers(root: Path) -> None:
    def run(seed: int, workers: int, start_epoch: int = 0, epochs: int = 2) -> list[list[str]]:
        loader = make_loader(root, batch_size=BATCH, num_workers=workers, seed=seed, device="cpu",
                             decoder="pillow")  # fmt: skip
        loader.set_epoch(start_epoch)
        return [[batch_digest(x, y) for x, y in epoch] for epoch in epochs_of(loader, epochs)]

    first = run(seed=3, workers=0)
    assert run(seed=3, workers=2) == first  # a second run, another worker count
    assert run(seed=3, workers=1, start_epoch=1, epochs=1) == first[1:]  # a restart told the epoch
    assert first[0] != first[1]  # augmentation and order change with the epoch
    other = run(seed=4, workers=0)
    assert all(a != b for a, b in zip(other[0], first[0], strict=True))


def test_batches_made_in_threads_are_the_same_in_the_same_order(root: Path) -> None:
    """``threads``: batches made at once in a pool, handed out in the loader's order; the same
    bytes as one at a time (each image's crop and flip come from its own seed), a restart told
    the epoch included. (The per-thread CUDA streams are the GPU tests'.)"""

    def run(threads: int, start_epoch: int = 0, epochs: int = 2) -> list[list[str]]:
        loader = make_loader(root, batch_size=BATCH, num_workers=2, seed=5, device="cpu", decoder="pillow",
                             threads=threads)  # fmt: skip
        loader.set_epoch(start_epoch)
        return [[batch_digest(x, y) for x, y in epoch] for epoch in epochs_of(loader, epochs)]

    one = run(threads=1)
    assert run(threads=3) == one and run(threads=2, start_epoch=1, epochs=1) == one[1:]
    assert len(one[0]) == -(-COUNT // BATCH) and len(set(one[0])) == len(one[0])


def test_a_batch_that_fails_in_a_thread_raises_in_the_caller_and_leaves_no_thread(
    root: Path, tmp_path: Path
) -> None:
    """A file that cannot be decoded, in a batch made by a pool thread: its error is raised
    where the batch is taken, after the batches before it; an iteration left early (a
    consumer that stops) waits for its threads and leaves none behind."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    victim = sorted((broken / "class_03").glob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:40])  # a JPEG header and nothing after it
    loader = make_loader(broken, batch_size=BATCH, num_workers=0, shuffle=False, device="cpu", decoder="pillow",
                         threads=3)  # fmt: skip
    position = [path for path, _ in loader.dataset.samples].index(str(victim))
    taken = 0
    with pytest.raises(OSError):
        for _ in loader:
            taken += 1
    assert taken == position // BATCH  # every batch before the broken one, in order
    before = {t.name for t in threading.enumerate()}
    assert not any(name.startswith("gpu-pipeline") for name in before)
    good = make_loader(root, batch_size=BATCH, num_workers=0, device="cpu", decoder="pillow", threads=3)
    it = iter(good)
    next(it)
    assert sum(t.name.startswith("gpu-pipeline") for t in threading.enumerate()) == 3  # (made there)
    it.close()  # (a generator left early)
    assert not any(t.name.startswith("gpu-pipeline") for t in threading.enumerate())


def test_options_are_checked_when_the_loader_is_made(root: Path, tmp_path: Path) -> None:
    cases = [
        ({"num_workers": -1}, "num_workers must be >= 0"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"decoder": "nvdec"}, "decoder must be one of torchvision, pillow"),
        ({"device": "tpu"}, "device must be 'cuda', 'cuda:N' or 'cpu'"),
        ({"device": "meta"}, "device must be 'cuda', 'cuda:N' or 'cpu'"),
        ({"device": "cuda", "decoder": "pillow"}, "decoder='pillow' decodes on the CPU"),
        ({"threads": 0}, "threads must be a positive integer, got 0"),
        ({"threads": 2.0}, "threads must be a positive integer, got 2.0"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            make_loader(root, **({"device": "cpu", "decoder": "pillow"} | options))
    with pytest.raises(ValueError, match="is not a directory"):
        make_loader(tmp_path / "missing", device="cpu", decoder="pillow")
    if TORCHVISION is not None:
        with pytest.raises(GpuPipelineUnavailable, match="torchvision cannot be imported") as info:
            make_loader(root, device="cpu")
        assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens where there is no CUDA GPU")
def test_without_a_gpu_make_loader_says_so_in_one_line(root: Path) -> None:
    with pytest.raises(GpuPipelineUnavailable, match="no CUDA GPU is visible") as info:
        make_loader(root)
    assert "\n" not in str(info.value) and "producer/imagefolder.py:make_loader" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens where there is no CUDA GPU")
def test_tensorsocket_serve_without_a_gpu_is_a_one_line_usage_error(root: Path, name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorsocket", "serve", "producer/imagefolder_gpu.py:make_loader",
         "--name", name, "--device", "cuda", "--arg", f"root={root}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr  # the CLI's usage-error code
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tensorsocket: error: pipeline producer/imagefolder_gpu.py:make_loader")
    assert "no CUDA GPU is visible" in lines[0]
    assert ("torchvision cannot be imported" in lines[0]) == (TORCHVISION is not None)


# --------------------------------------------------------------------------- decode and transform


def pillow_decode(path: str) -> torch.Tensor:
    """The CPU pipeline's decode: Image.open + convert("RGB"), as CHW uint8."""
    with Image.open(path) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


@pytest.fixture(scope="module")
def root_444(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same images saved again without chroma subsampling (4:4:4)."""
    copy = tmp_path_factory.mktemp("jpegs444")
    for path, _ in imagefolder.ImageFolderDataset(root).samples:
        target = copy / Path(path).relative_to(root)
        target.parent.mkdir(exist_ok=True)
        with Image.open(path) as img:
            img.convert("RGB").save(target, quality=90, subsampling=0)
    return copy


def luma(image: torch.Tensor) -> torch.Tensor:
    """JFIF's Y (BT.601 weights) of a CHW float RGB image: the channel JPEG never subsamples."""
    return 0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2]


def decode_differences(root: Path, device: str, decoder: str, in_luma: bool = False) -> list[float]:
    """Mean absolute difference (levels of 255) between ``decode_batch`` and Pillow, per file,
    in RGB or in luma, after checking that a wrong decode (swapped channels, another file) is
    above the tolerance."""
    paths = [p for p, _ in imagefolder.ImageFolderDataset(root).samples]
    datas = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    decoded = decode_batch(datas, device, decoder)
    assert len(decoded) == len(paths)
    differences = []
    for path, image in zip(paths, decoded, strict=True):
        assert image.dtype == torch.uint8 and image.device.type == torch.device(device).type
        reference = pillow_decode(path)
        assert image.shape == reference.shape, path
        image, reference = image.cpu().float(), reference.float()
        ours, theirs = (luma(image), luma(reference)) if in_luma else (image, reference)
        differences.append(float((ours - theirs).abs().mean()))
        assert float((image.flip(0) - reference).abs().mean()) > DECODE_TOLERANCE  # RGB vs BGR
    # another file's image, where the two overlap
    first, other = decoded[0].cpu().float(), pillow_decode(paths[1]).float()
    height, width = min(first.shape[1], other.shape[1]), min(first.shape[2], other.shape[2])
    assert float((first[:, :height, :width] - other[:, :height, :width]).abs().mean()) > 4 * DECODE_TOLERANCE
    return differences


def test_the_decode_check_itself_on_the_pillow_decoder(root: Path, root_444: Path) -> None:
    """The helper the nvJPEG test uses, run here on the reference decoder (the same decode
    as the CPU pipeline's: no difference at all), so a GPU run is not its first."""
    assert decode_differences(root, "cpu", "pillow") == [0.0] * COUNT
    assert decode_differences(root, "cpu", "pillow", in_luma=True) == [0.0] * COUNT
    assert decode_differences(root_444, "cpu", "pillow") == [0.0] * COUNT


@needs_torchvision
def test_torchvision_cpu_decode_matches_pillow(root: Path, record_property: Any) -> None:
    differences = decode_differences(root, "cpu", "torchvision")
    record_property("mean_abs_diff_max", max(differences))
    assert max(differences) < DECODE_TOLERANCE, differences


@pytest.mark.parametrize("decoder", DECODERS)
def test_eval_batches_match_the_cpu_pipeline(root: Path, decoder: str) -> None:
    """The same crop and resize as the CPU pipeline, on the same boxes. Inside the image the
    two agree to the CPU pipeline's rounding to uint8 (half a level; measured: at most 1.0);
    within a few pixels of the border they differ, as Pillow's resize reads the pixels around
    its box and a crop has none: that is why the border is left out of the pixel bound."""
    ours = make_loader(root, batch_size=BATCH, shuffle=False, train=False, device="cpu", decoder=decoder)
    cpu = imagefolder.make_loader(root, batch_size=BATCH, shuffle=False, train=False, num_workers=0)
    for (x, y), (a, b) in zip(ours, cpu, strict=True):
        assert torch.equal(y, b)
        levels = ((x - a) * STD * 255).abs()
        inside = levels[..., 4:-4, 4:-4]
        assert float(levels.mean()) < 1.0 and float(inside.max()) <= 1.001, (levels.mean(), inside.max())


# --------------------------------------------------------------------------- one producer, three consumers


def consume(name: str, epochs: int, results: Any, device: str) -> None:
    """Consumer process: every batch's (epoch, index) and digest."""
    from tensorsocket import Consumer

    report: dict[str, Any] = {"pid": os.getpid(), "seen": [], "digests": [], "error": None}
    try:
        with Consumer(name=name, device=device, timeout=60) as consumer:
            for epoch in range(epochs):
                for index, (images, labels) in enumerate(consumer):
                    report["seen"].append((epoch, index))
                    report["digests"].append(batch_digest(images, labels))
                    del images, labels
    except Exception as exc:  # reported, so the test shows it
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


def serve_to_three(
    root: Path, name: str, decode_device: str, decoder: str, epochs: int = 2, threads: int = 1
) -> None:
    """One producer serving this pipeline (``threads`` batches made at once) on cuda:0 to three
    consumer processes: each sees every batch of every epoch once, bit-identical to the others
    and to the pipeline's own batches (a second loader with the same seed, one batch at a time,
    makes them again)."""
    from tensorsocket import Producer

    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=consume, args=(name, epochs, results, "cuda:0")) for _ in range(3)]
    for p in procs:
        p.start()
    loader = make_loader(
        root, batch_size=BATCH, device=decode_device, decoder=decoder, seed=7, threads=threads
    )
    try:
        with Producer(loader, name=name, device="cuda:0", slots=3, replay=0, min_consumers=3) as producer:
            assert producer.status()["transport"] == "cuda"
            producer.serve(epochs=epochs)
        reports = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    again = make_loader(root, batch_size=BATCH, device=decode_device, decoder=decoder, seed=7)
    expected = [batch_digest(x, y) for _ in range(epochs) for x, y in again]
    batches = -(-COUNT // BATCH)
    for report in reports:
        assert report["error"] is None, report["error"]
        assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]
        assert report["digests"] == expected


@pytest.mark.parametrize("threads", [1, 3])
def test_one_producer_serves_the_pipeline_to_three_consumers_on_the_stand_in(
    root: Path, name: str, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")  # inherited by the consumers
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    serve_to_three(root, name, "cpu", "pillow", threads=threads)


# --------------------------------------------------------------------------- on a GPU (scripts/gpu.sh)


@pytest.mark.gpu
@needs_torchvision
def test_nvjpeg_decode_matches_pillow(root: Path, root_444: Path, record_property: Any) -> None:
    """Within the bound where only the IDCT differs (see the module docstring); the RGB
    difference of 4:2:0 files, where the chroma upsampling differs too, is recorded only."""
    unsubsampled = decode_differences(root_444, "cuda", "torchvision")
    in_luma = decode_differences(root, "cuda", "torchvision", in_luma=True)
    in_rgb = decode_differences(root, "cuda", "torchvision")
    record_property("mean_abs_diff_max_444_rgb", max(unsubsampled))
    record_property("mean_abs_diff_max_420_luma", max(in_luma))
    record_property("mean_abs_diff_max_420_rgb", max(in_rgb))
    print(f"nvJPEG vs Pillow, max mean abs diff: 4:4:4 RGB {max(unsubsampled):.3f}, "
          f"4:2:0 luma {max(in_luma):.3f}, 4:2:0 RGB {max(in_rgb):.3f}")  # fmt: skip
    assert max(unsubsampled) < DECODE_TOLERANCE, unsubsampled
    assert max(in_luma) < DECODE_TOLERANCE, in_luma


@pytest.mark.gpu
@needs_torchvision
@pytest.mark.parametrize("threads", [1, 3])
def test_one_producer_serves_the_nvjpeg_pipeline_to_three_gpu_consumers(
    root: Path, name: str, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """With ``threads=3``, each batch made on a stream of its own: the producer's copy must
    wait for it (the batches are compared with those made one at a time)."""
    monkeypatch.delenv("TENSORSOCKET_FAKE_CUDA", raising=False)
    serve_to_three(root, name, "cuda", "torchvision", threads=threads)
