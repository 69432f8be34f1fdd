"""Consumer overhead per batch: time inside ``next()`` after a simulated training step, with
the producer ahead, for 1 MiB and 64 MiB batches, next to the floor measured the same way.

The floor is one bare ``torch.frombuffer`` view of an already-mapped buffer after the same
sleep (what any zero-copy consumer must at least do); it is also given in a hot loop. Zero
copy means the figure does not grow with the batch size.

    python -m benchmarks.overhead        # writes benchmarks/results/overhead-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks.sharing import SPAWN, write
from producer.synthetic import make_loader


def _serve(name: str, batch_bytes: int, batches: int) -> None:
    from tensorsocket import Producer

    Producer(make_loader(batch_bytes, 32, batches), name=name, slots=8).serve(epochs=1)


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": round(statistics.median(s) * 1e6, 1),
        "p90_us": round(s[int(0.9 * (len(s) - 1))] * 1e6, 1),
        "p99_us": round(s[int(0.99 * (len(s) - 1))] * 1e6, 1),
        "n": len(s),
    }


def measure_consumer(batch_bytes: int, batches: int, step_s: float, warmup: int = 8) -> dict[str, Any]:
    from tensorsocket import Consumer

    name = f"overhead-{uuid.uuid4().hex[:8]}"
    producer = SPAWN.Process(target=_serve, args=(name, batch_bytes, batches))
    producer.start()
    loader = make_loader(batch_bytes, 32, batches)
    times = []
    try:
        with Consumer(name=name, timeout=60) as consumer:
            it = iter(consumer)
            first = next(it)  # start-up is not overhead
            loader.verify_batch(first, 0)
            del first
            for index in range(1, batches):
                time.sleep(step_s)
                t0 = time.perf_counter()
                batch = next(it)
                if index > warmup:  # the first pass over the slots maps them: not steady state
                    times.append(time.perf_counter() - t0)
                if index % 8 == 0:  # outside the timed region
                    loader.verify_batch(batch, index)
                del batch
    finally:
        producer.join(timeout=60)
    return _percentiles(times)


def measure_floor(batch_bytes: int, batches: int, step_s: float) -> dict[str, Any]:
    buf = mmap.mmap(-1, batch_bytes)
    times, hot = [], []
    for _ in range(batches):
        time.sleep(step_s)
        t0 = time.perf_counter()
        view = torch.frombuffer(buf, dtype=torch.uint8)
        times.append(time.perf_counter() - t0)
        del view
    for _ in range(1000):
        t0 = time.perf_counter()
        view = torch.frombuffer(buf, dtype=torch.uint8)
        hot.append(time.perf_counter() - t0)
        del view
    return {"after_step": _percentiles(times), "hot_loop": _percentiles(hot)}


def run(sizes_mib: tuple[int, ...] = (1, 64), batches: int = 60, step_ms: float = 200.0) -> dict[str, Any]:
    step_s = step_ms / 1000
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "benchmark": "consumer_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "config": {
            "batches": batches,
            "step_ms": step_ms,
            "sizes_mib": list(sizes_mib),
            "slots": 8,
            "warmup_batches_excluded": 8,
        },
        "sizes": {},
    }
    for mib in sizes_mib:
        size = mib << 20
        consumer = measure_consumer(size, batches, step_s)
        floor = measure_floor(size, batches, step_s)
        result["sizes"][f"{mib}MiB"] = {
            "next": consumer,
            "floor": floor,
            "p50_over_floor": round(consumer["p50_us"] / floor["after_step"]["p50_us"], 2),
        }
        print(
            f"{mib:>4} MiB: next() p50 {consumer['p50_us']:7.1f} us  p99 {consumer['p99_us']:8.1f} us | "
            f"floor p50 {floor['after_step']['p50_us']:6.1f} us (hot {floor['hot_loop']['p50_us']:.1f} us) | "
            f"ratio {result['sizes'][f'{mib}MiB']['p50_over_floor']:.2f}x"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=200.0, help="long enough that the producer is ahead")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(batches=args.batches, step_ms=args.step_ms)
    if not args.no_write:
        print("wrote", write(result, "overhead"))


if __name__ == "__main__":
    main()
