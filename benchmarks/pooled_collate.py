"""What collating into reused shared memory (tensorsocket.pooled_collate) does to a loader alone.

The JPEG pipeline of :mod:`benchmarks.sharing` (``producer.imagefolder.make_loader``, 2
workers, batches of 32 at 224x224) feeding one loop that reads each batch once into a reused
buffer (as a copy to a GPU would, or the producer's copy into its place) and sleeps a 10 ms
step. Two ways, in turn every round (the order swapped each round):

* ``default``: the DataLoader as it is (torch's ``default_collate``: a new shared-memory
  segment for each batch);
* ``pooled``: the same DataLoader with the collate a producer installs and the loop handing
  each batch's buffers back once it has dropped it, as the producer does (``installed``,
  ``Reclaimer``).

CPU from ``/proc`` between the first batch and the last, ms a batch: the loader's worker
processes and the main process. Each way's batches are checksummed (a sample of each batch's
words: ``tests/test_pooled_collate.py`` compares every bit); both ways' must match.

    python3 -m benchmarks.pooled_collate [--rounds 4]   # writes benchmarks/results/pooled_collate-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.sharing import ROOT, SPAWN, _window_cpu, machine, tree_cpu, write
from producer.imagefolder import make_dataset, make_loader
from tensorsocket.pooled_collate import Reclaimer, for_loader, installed

WAYS = ("default", "pooled")


def _loop(root: str, way: str, epochs: int, step_s: float, out: Any) -> None:
    torch.set_num_threads(1)
    loader = make_loader(root, batch_size=32, num_workers=2)
    reclaimer, collate = Reclaimer(), for_loader(loader)  # (as a producer makes it, with replay=0)
    staging, batches, sums = None, 0, []
    start, before, me = None, {}, os.getpid()
    for _ in range(epochs):
        if way == "pooled":
            with installed(loader, collate):
                it = iter(loader)
        else:
            it = iter(loader)
        for images, labels in it:
            if way == "pooled":
                reclaimer.track((images, labels))
            if staging is None:
                staging = torch.empty_like(images)
            staging[: images.shape[0]].copy_(images)
            # (every 61st word: a full sum costs more than the loop; the tests compare every bit)
            sums.append(
                int(images.view(torch.int32).view(-1)[::61].sum(dtype=torch.int64)) ^ int(labels.sum())
            )
            if start is None:  # the clock starts at the first batch: start-up is not rate
                start, before = time.perf_counter(), tree_cpu(me)
            else:
                batches += 1
            del images, labels
            reclaimer.reclaim()
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    spent = {
        int(pid): user + system for pid, (_, user, system, _) in _window_cpu(before, tree_cpu(me)).items()
    }
    workers = sum(cpu for pid, cpu in spent.items() if pid != me)
    out.put({
        "way": way, "batches": batches, "batches_per_s": round(batches / seconds, 2),
        "workers_ms": round(1000 * workers / batches, 2), "main_ms": round(1000 * spent[me] / batches, 2),
        "checksum": hash(tuple(sums)), "buffers_tracked": len(reclaimer),
    })  # fmt: skip


def _report(out: Any, proc: Any, way: str, timeout: float = 600.0) -> dict[str, Any]:
    """The run's report; a run that died first fails at once, naming itself (no 10-minute wait)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the {way!r} run exited with {proc.exitcode} before reporting") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {way!r} run did not report within {timeout:.0f} s") from None


def rounds(
    count: int, epochs: int, step_ms: float, images: int = 1024, data: Path | None = None
) -> dict[str, Any]:
    root = str(make_dataset(data or ROOT / "data" / f"jpeg-{images}", count=images))
    rows = []
    for i in range(count):
        row = {}
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            out = SPAWN.Queue()
            p = SPAWN.Process(target=_loop, args=(root, way, epochs, step_ms / 1000, out))
            p.start()
            row[way] = _report(out, p, way)
            p.join(60)
        print(json.dumps(row), flush=True)
        rows.append(row)
    keys = ("batches_per_s", "workers_ms", "main_ms")
    medians = {way: {k: round(statistics.median(r[way][k] for r in rows), 2) for k in keys} for way in WAYS}
    paired = {k: [round(r["pooled"][k] / r["default"][k], 3) for r in rows] for k in keys}
    return {
        "benchmark": "pooled_collate",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "epochs": epochs,
            "step_ms": step_ms,
            "workers": 2,
            "batch_size": 32,
            "images": images,
            "rounds": count,
        },  # fmt: skip
        "medians": medians,
        "paired_pooled_over_default": paired,
        "identical": all(r["pooled"]["checksum"] == r["default"]["checksum"] for r in rows),
        "rounds": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--tag", default=None, help="file name tag instead of the host name")
    args = parser.parse_args()
    result = rounds(args.rounds, args.epochs, args.step_ms)
    for way in WAYS:
        m = result["medians"][way]
        print(f"{way:8s} {m['batches_per_s']:6.2f} batches/s  workers {m['workers_ms']:6.1f} ms a batch  "
              f"main {m['main_ms']:5.1f} ms a batch")  # fmt: skip
    print("pooled / default, by round:", result["paired_pooled_over_default"])
    print("identical batches:", result["identical"])
    print("wrote", write(result, "pooled_collate", args.tag))


if __name__ == "__main__":
    main()
