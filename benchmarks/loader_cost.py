"""What sharing costs the loader's own workers, in the JPEG scenario of :mod:`benchmarks.sharing`.

On the 2-core VM the shared run's DataLoader workers spent ~10-20% more CPU a batch than the
same loader's workers feeding one trainer alone, and nothing explained it. Four ways, in
turn every round (the order rotated), each measured as ``benchmarks.sharing`` does (the
machine's CPU from ``/proc`` between the first trainer's first and last batch, ms a batch):

* ``single``: one trainer with its own DataLoader, reading each batch once (the bound);
* ``model``: no tensorsocket, only the memory traffic of sharing: one trainer with its own
  DataLoader copies each batch into one shared buffer (as the producer copies it into a
  place) and wakes N reader processes by pipe, each copying that buffer into a private one
  (as each consumer reads its batch), then sleeps its step;
* ``shared``: a tensorsocket producer and N consumers, the producer's default replay budget
  (it keeps the loader's batches, by reference, for late joiners);
* ``shared-replay0``: the same with ``replay=0`` (it keeps nothing).

    python3 -m benchmarks.loader_cost [--rounds 8] [--trainers 4]   # writes benchmarks/results/loader_cost-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.sharing import ROOT, SPAWN, _run, _window_cpu, machine, run, tree_cpu, where_cpu_went, write
from producer.imagefolder import make_dataset, make_loader

MODES = ("single", "model", "shared", "shared-replay0")


def _reader(conn: Any, buffer: torch.Tensor, out: Any) -> None:
    """Copy ``buffer`` into a private one at every byte from ``conn`` (a consumer's read of its
    batch); stop at ``b"x"``."""
    torch.set_num_threads(1)
    staging = torch.empty_like(buffer)
    while conn.recv_bytes() != b"x":
        staging.copy_(buffer)
    out.put(os.getpid())


def _model_trainer(root: str, workers: int, epochs: int, step_s: float, readers: int, out: Any) -> None:
    """The ``model`` way's trainer: its own DataLoader; each batch copied into one shared
    buffer, ``readers`` processes woken to read it, then the step."""
    torch.set_num_threads(1)
    buffer = torch.empty(32, 3, 224, 224).share_memory_()
    done = SPAWN.Queue()
    pipes = []
    for _ in range(readers):
        receive, send = SPAWN.Pipe(duplex=False)
        SPAWN.Process(target=_reader, args=(receive, buffer, done), daemon=True).start()
        pipes.append(send)
    loader = make_loader(root, batch_size=32, num_workers=workers)
    me, samples, start, before = os.getpid(), 0, None, {}
    for _ in range(epochs):
        for images, _labels in loader:
            buffer[: images.shape[0]].copy_(images)
            for pipe in pipes:
                pipe.send_bytes(b"b")
            if start is None:  # as sharing._train: the clock starts at the first batch
                start, before = time.perf_counter(), tree_cpu(me)
            else:
                samples += images.shape[0]
            del images
            time.sleep(step_s)
    elapsed = time.perf_counter() - start
    after = tree_cpu(me)
    for pipe in pipes:
        pipe.send_bytes(b"x")
    reader_pids = [done.get(timeout=60) for _ in pipes]
    out.put({"pid": me, "cpu_window": _window_cpu(before, after), "samples": samples,
             "samples_per_s": samples / elapsed, "readers": reader_pids})  # fmt: skip


def model(root: str, workers: int, epochs: int, step_s: float, readers: int) -> dict[str, float]:
    """One ``model`` run: CPU ms a batch of its trainer, its readers and the loader's workers
    (:func:`~benchmarks.sharing.where_cpu_went`, the readers counted among its trainers, then
    taken apart from the trainer)."""
    (report,) = _run([(_model_trainer, (root, workers, epochs, step_s, readers))], 600.0)
    roles = where_cpu_went([report, *({"pid": pid} for pid in report["readers"])], [])
    window = report["cpu_window"]
    reading = sum(window[str(pid)][1] + window[str(pid)][2] for pid in report["readers"])
    reading_ms = round(reading * 1000 / (report["samples"] / 32), 2)
    return {
        "trainer": round(roles["trainers"] - reading_ms, 2),
        "readers": reading_ms,
        "loader_workers": roles["loader_workers"],
        "samples_per_s": round(report["samples_per_s"], 1),
    }


def rounds(
    count: int,
    trainers: int,
    step_ms: float,
    workers: int,
    epochs: int,
    images: int = 1024,
    data: Path | None = None,
) -> dict[str, Any]:
    """``count`` rounds of the four ways, the order rotated each round; medians and each round's
    paired ratios of the workers' CPU."""
    data = data or ROOT / "data" / f"jpeg-{images}"
    root = str(make_dataset(data, count=images))
    rows = []
    for i in range(count):
        order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
        row: dict[str, Any] = {"order": list(order)}
        for mode in order:
            if mode == "model":
                row[mode] = model(root, workers, epochs, step_ms / 1000, trainers)
                continue
            way = "single" if mode == "single" else "shared"
            r = run(trainers=trainers, step_ms=step_ms, images=images, epochs=epochs, workers=workers, data=data,
                    modes=(way,), log=lambda *_: None, replay=0 if mode == "shared-replay0" else None)  # fmt: skip
            row[mode] = r["cpu_ms_per_batch"][way] | {"samples_per_s": r["per_trainer_samples_per_s"][way]}
            if way == "shared":
                row[mode]["exact"] = all(c["exact"] for c in r["runs"]["shared"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    medians = {
        mode: {
            k: round(statistics.median(r[mode][k] for r in rows), 2) for k in rows[0][mode] if k != "exact"
        }
        for mode in MODES
    }
    paired = {  # each round's workers' CPU in one way over the same round's in another
        f"workers_{name}": [round(r[mode]["loader_workers"] / r[base]["loader_workers"], 3) for r in rows]
        for name, mode, base in (
            ("shared_over_single", "shared", "single"),
            ("shared_over_replay0", "shared", "shared-replay0"),
            ("model_over_single", "model", "single"),
        )
    }
    return {
        "benchmark": "loader_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "trainers": trainers,
            "step_ms": step_ms,
            "workers": workers,
            "epochs": epochs,
            "images": images,
            "batch_size": 32,
            "rounds": count,
        },
        "medians_cpu_ms_per_batch": medians,
        "paired": paired,
        "exact": all(r[m]["exact"] for r in rows for m in ("shared", "shared-replay0")),
        "rounds": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tag", default=None, help="in the file name instead of the host's")
    args = parser.parse_args()
    result = rounds(args.rounds, args.trainers, args.step_ms, args.workers, args.epochs)
    print(json.dumps({k: result[k] for k in ("medians_cpu_ms_per_batch", "paired", "exact")}, indent=1))
    print("wrote", write(result, "loader_cost", tag=args.tag))


if __name__ == "__main__":
    main()
