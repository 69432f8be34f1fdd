"""The processes of ``benchmarks.compare``: trainers and producers of its systems.

Run as a script (``python benchmarks/compare_roles.py ROLE ...``), never as ``-m``, from a
directory outside the repository. Why: the PyPI ``tensorsocket`` 0.0.5 roles run under
their own virtual environment's Python, and the repository's ``tensorsocket/`` folder must
not shadow the installed 0.0.5 package. So this file imports neither ``tensorsocket`` nor
anything of ``benchmarks`` at the top; each role imports its system itself and checks which
version it got.

Every trainer runs the same loop (:func:`train`): for each epoch, take the batches, check
their shape, fingerprint them (so the orchestrator can tell whether every trainer of a
shared system saw the same batches, each once), copy them to the GPU when there is one (a
no-op for the GPU path's batches, which are there already), and simulate a training step of
``--step-ms``. It writes its report as JSON to ``--report``
every half second and at the end, so a trainer that stalls and is killed still says what it
got. The ``synthetic-trainer`` role runs the same loop with no loader at all: one synthetic
batch, made once on the model's device and taken again at every step (the ``model-alone``
reference: what training alone allows).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCH_SIZE = 32
UPSTREAM_VERSION = "0.0.5"


def _import_pipeline(pipeline: str = "cpu") -> Any:
    """``producer.imagefolder`` (``pipeline="cpu"``: Pillow decode and augment in the loader's
    workers) or ``producer.imagefolder_gpu`` (``"gpu"``: workers read files, decode and augment
    on the GPU) from this repository, found after every installed package."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    if pipeline == "gpu":
        from producer import imagefolder_gpu

        return imagefolder_gpu
    from producer import imagefolder

    return imagefolder


def fingerprint(images: Any, labels: Any) -> str:
    """A cheap identity for a batch: its labels and a sparse grid of its pixels."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(labels.cpu().numpy().tobytes())
    digest.update(images[:, :, ::29, ::29].contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class Report:
    """A trainer's progress, written atomically to a JSON file now and then."""

    def __init__(self, path: str, **fields: Any) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {"pid": os.getpid(), "complete": False, **fields}
        self._written = 0.0

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written < 0.5:
            return
        self._written = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def model_step(name: str) -> Any:
    """A real training step of torchvision's model ``name`` (e.g. ``resnet18``): forward,
    cross-entropy, backward, SGD, and ``loss.item()`` as a training loop's logging does."""
    import torch

    try:
        import torchvision
    except Exception as exc:  # a build for another torch fails with RuntimeError, not ImportError
        raise SystemExit(
            f"--model {name} needs torchvision, the build matching your torch (it is not a dependency): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = getattr(torchvision.models, name)(num_classes=1000).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: Any, labels: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        loss.item()

    return step


def train(
    batches: Any, epochs: int, step_s: float, report: Report, model: str | None = None, step: Any = None
) -> None:
    """Iterate ``epochs`` epochs of ``batches`` as a trainer would; record everything in ``report``.

    Each step is a sleep of ``step_s`` (the batch released first), or with ``model`` a real
    training step on the batch (``step``: that step, made by :func:`model_step` already).
    """
    import torch

    gpu = torch.cuda.is_available()
    step = step or (model_step(model) if model else None)
    started = time.perf_counter()
    first = None
    samples = 0  # after the first batch: the clock starts there, start-up is not rate
    data = report.data
    data.update(batches_per_epoch=[], samples_per_epoch=[], fingerprints=[], samples_per_s=0.0)
    report.write(force=True)
    cpu0 = time.process_time()
    for _ in range(epochs):
        data["batches_per_epoch"].append(0)
        data["samples_per_epoch"].append(0)
        data["fingerprints"].append([])
        for images, labels in batches:
            if gpu:
                images = images.to("cuda", non_blocking=True)
                labels = labels.to("cuda", non_blocking=True)
                # This thread's stream only: a producer hosted in this process decodes on a stream
                # of its own, which a device-wide synchronize would wait for too.
                torch.cuda.current_stream().synchronize()
            now = time.perf_counter()
            if first is None:
                first = now
                data["first_batch_s"] = now - started
            else:
                samples += images.shape[0]
                data["samples_per_s"] = samples / (now - first)
            if tuple(images.shape[1:]) != (3, 224, 224) or labels.shape[0] != images.shape[0]:
                raise AssertionError(f"unexpected batch shapes {tuple(images.shape)} {tuple(labels.shape)}")
            data["batches_per_epoch"][-1] += 1
            data["samples_per_epoch"][-1] += int(images.shape[0])
            data["fingerprints"][-1].append(fingerprint(images, labels))
            if step is not None:
                step(images, labels)
            del images, labels
            report.write()
            if step is None:
                time.sleep(step_s)
    data["main_process_cpu_s"] = time.process_time() - cpu0
    data["complete"] = True
    report.write(force=True)


def _loader(args: argparse.Namespace, seed: int) -> Any:
    import torch

    torch.set_num_threads(1)
    gpu = {"device": args.decode_device, "decoder": args.decoder} if args.pipeline == "gpu" else {}
    return _import_pipeline(args.pipeline).make_loader(
        args.data, batch_size=BATCH_SIZE, num_workers=args.workers, seed=seed, **gpu
    )


# --------------------------------------------------------------------------- the three systems


def role_loader_trainer(args: argparse.Namespace) -> None:
    """A trainer with its own DataLoader: the status quo."""
    loader = _loader(args, seed=args.rank)
    report = Report(
        args.report, system="independent", rank=args.rank, workers=args.workers, pipeline=args.pipeline
    )
    train(loader, args.epochs, args.step_ms / 1000, report, args.model)


class SyntheticBatches:
    """``images`` samples an epoch in batches of 32 (the last one shorter, as the loader's),
    every one a view of the same random batch, made once on the GPU (the CPU without one)."""

    def __init__(self, images: int, seed: int) -> None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(BATCH_SIZE, 3, 224, 224, generator=g).to(device)
        self.labels = torch.randint(0, 1000, (BATCH_SIZE,), generator=g).to(device)
        self.count = images

    def __iter__(self) -> Any:
        for start in range(0, self.count, BATCH_SIZE):
            size = min(BATCH_SIZE, self.count - start)
            yield self.images[:size], self.labels[:size]


def role_synthetic_trainer(args: argparse.Namespace) -> None:
    """A trainer with no loader: the model on one synthetic batch, as many steps as an epoch."""
    report = Report(args.report, system="model-alone", rank=args.rank)
    train(SyntheticBatches(args.images, seed=args.rank), args.epochs, args.step_ms / 1000, report, args.model)


def _ts_system(device: str) -> str:
    return "tensorsocket" if device == "cpu" else "tensorsocket-gpu"


def _producer_figures(status: dict[str, Any]) -> dict[str, Any]:
    """What a producer's report keeps of its ``status()``: batches published and where its time went."""
    return {k: status.get(k) for k in ("published", "loader_wait", "slot_wait", "publish_time", "slot_bytes")}


def role_ts_producer(args: argparse.Namespace) -> None:
    """This repository's producer; ``--device cuda:0`` keeps the batches in GPU memory."""
    import tensorsocket

    loader = _loader(args, seed=0)
    report = Report(
        args.report, system=_ts_system(args.device), version=tensorsocket.__version__, producer=True,
        device=args.device, workers=args.workers, pipeline=args.pipeline,
    )  # fmt: skip
    producer = tensorsocket.Producer(
        loader, name=args.name, device=args.device, slots=8, min_consumers=args.trainers, replay=0
    )
    cpu0 = time.process_time()
    with producer:
        producer.serve(epochs=args.epochs)
        status = producer.status()
    report.data["main_process_cpu_s"] = time.process_time() - cpu0
    report.data.update(_producer_figures(status))
    report.data["complete"] = True
    report.write(force=True)


def role_ts_trainer(args: argparse.Namespace) -> None:
    """This repository's consumer; ``--device cuda:0`` yields views of the producer's GPU memory."""
    import tensorsocket

    report = Report(
        args.report, system=_ts_system(args.device), version=tensorsocket.__version__, rank=args.rank,
        device=args.device,
    )  # fmt: skip
    with tensorsocket.Consumer(name=args.name, device=args.device, timeout=60) as consumer:
        report.data["len"] = len(consumer)
        train(consumer, args.epochs, args.step_ms / 1000, report, args.model)


def role_ts_hosting_trainer(args: argparse.Namespace) -> None:
    """A trainer whose process also hosts the producer, serving in a thread of its own: one
    process, so one CUDA context, fewer than a producer of its own (``ts-producer``) needs. Its
    own consumer reads the places directly (CUDA refuses to open an IPC handle where it was
    made); the other trainers are ``ts-trainer``s. The producer's figures go in its report."""
    import threading

    import tensorsocket

    loader = _loader(args, seed=0)
    report = Report(
        args.report, system=_ts_system(args.device), version=tensorsocket.__version__, rank=args.rank,
        device=args.device, hosts_producer=True, workers=args.workers, pipeline=args.pipeline,
    )  # fmt: skip
    # The model made (its imports done) before the producer's thread forks the loader's workers:
    # a fork while this thread imports can deadlock the child.
    step = model_step(args.model) if args.model else None
    failed: list[BaseException] = []
    producer = tensorsocket.Producer(
        loader, name=args.name, device=args.device, slots=8, min_consumers=args.trainers, replay=0
    )

    def serve() -> None:
        import contextlib

        import torch

        # The pipeline's GPU work on a stream of its own (current streams are per thread): on the
        # default stream it would queue behind this trainer's training steps, and they behind it.
        # (From torch's pool of streams, which torchvision's decoder draws from already.)
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                producer.serve(epochs=args.epochs)
        except BaseException as exc:  # re-raised by the main thread, after its consumer stopped
            failed.append(exc)

    with producer:
        with tensorsocket.Consumer(name=args.name, device=args.device, timeout=60) as consumer:
            report.data["len"] = len(consumer)
            server = threading.Thread(target=serve, name="producer", daemon=True)
            server.start()
            try:
                train(consumer, args.epochs, args.step_ms / 1000, report, args.model, step)
            except BaseException as exc:  # the producer's own error, when it failed first, is the cause
                server.join(timeout=5)
                if failed:
                    raise failed[0] from exc
                raise
        server.join(timeout=60)
        if failed:
            raise failed[0]
        if server.is_alive():
            raise RuntimeError("the hosted producer did not finish within 60 s of its trainer")
        status = producer.status()
    report.data["producer"] = _producer_figures(status)
    report.write(force=True)


def _upstream() -> Any:
    """PyPI tensorsocket 0.0.5, refusing to run with any other package of that name."""
    import tensorsocket

    ours = Path(tensorsocket.__file__).resolve().is_relative_to(ROOT / "tensorsocket")
    if getattr(tensorsocket, "__version__", None) != UPSTREAM_VERSION or ours:
        raise SystemExit(
            f"expected PyPI tensorsocket {UPSTREAM_VERSION} from its own environment, got "
            f"{getattr(tensorsocket, '__version__', '?')} at {tensorsocket.__file__}"
        )
    return tensorsocket


def _ports(base: int) -> dict[str, Any]:
    return {"port": base, "ack_port": base + 1, "heart_ports": (base + 2, base + 3)}


def role_up_producer(args: argparse.Namespace) -> None:
    """Upstream's producer loop, as its README shows, after all trainers have registered.

    0.0.5 has no "wait for N consumers" option, and one that registers after the first
    broadcast may be skipped as too far behind and then wait forever; so, to give it its best
    case, this waits (up to 120 s) until its heartbeat has seen every trainer.
    """
    upstream = _upstream()
    loader = _loader(args, seed=0)
    report = Report(args.report, system="tensorsocket-0.0.5", version=upstream.__version__, producer=True,
                    workers=args.workers)  # fmt: skip
    producer = upstream.TensorProducer(
        loader, **_ports(args.port), producer_batch_size=args.producer_batch_size
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        hb = getattr(producer, "hb", None)
        if hb is not None and len(hb.consumers) >= args.trainers:
            break
        time.sleep(0.05)
    report.data["registered"] = len(producer.hb.consumers) if producer.hb is not None else 0
    report.write(force=True)
    for _ in range(args.epochs):
        for _ in producer:
            pass
    producer.join()
    report.data["complete"] = True
    report.write(force=True)


def role_up_trainer(args: argparse.Namespace) -> None:
    upstream = _upstream()
    report = Report(args.report, system="tensorsocket-0.0.5", version=upstream.__version__, rank=args.rank)
    consumer = upstream.TensorConsumer(**_ports(args.port), batch_size=BATCH_SIZE)
    report.data["len"] = len(consumer)
    train(consumer, args.epochs, args.step_ms / 1000, report, args.model)


ROLES = {
    "loader-trainer": role_loader_trainer,
    "synthetic-trainer": role_synthetic_trainer,
    "ts-producer": role_ts_producer,
    "ts-trainer": role_ts_trainer,
    "ts-hosting-trainer": role_ts_hosting_trainer,
    "up-producer": role_up_producer,
    "up-trainer": role_up_trainer,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one process of benchmarks.compare")
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--report", required=True, help="JSON file this process writes its figures to")
    parser.add_argument("--data", help="folder of JPEGs (producer.imagefolder layout)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--model", help="train this torchvision model instead of sleeping --step-ms")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--images", type=int, default=1024, help="synthetic-trainer: samples per epoch")
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--name", help="tensorsocket producer name")
    parser.add_argument(
        "--device", default="cpu", help="tensorsocket's device for producer and trainers (cpu, cuda:0)"
    )
    parser.add_argument(
        "--pipeline",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu: producer.imagefolder (Pillow); gpu: producer.imagefolder_gpu (decode and augment on "
        "--decode-device)",
    )
    parser.add_argument("--decode-device", default="cuda", help="--pipeline gpu: where it decodes")
    parser.add_argument("--decoder", default="torchvision", help="--pipeline gpu: torchvision or pillow")
    parser.add_argument("--port", type=int, help="first of the four ports tensorsocket 0.0.5 uses")
    parser.add_argument(
        "--producer-batch-size", type=int, default=8, help="tensorsocket 0.0.5's (its default: 8)"
    )
    args = parser.parse_args(argv)
    ROLES[args.role](args)


if __name__ == "__main__":
    main()
