"""Consumer overhead per batch: time inside ``next()`` after a simulated training step, with
the producer ahead, for 1 MiB and 64 MiB batches, next to the floor measured the same way.

The floor is one bare ``torch.frombuffer`` view of an already-mapped buffer after the same
sleep (what any zero-copy consumer must at least do), timed in the consumer's own loop on
alternate steps; it is also given in a hot loop. Zero copy means the figure does not grow
with the batch size.

The producer's loader makes its few distinct batches once and yields them in turn (batch i
is synthetic batch ``i % DISTINCT``), so the producer's per-batch work is its copy into a
place: making a 64 MiB synthetic batch costs ~50 ms here, which kept the producer behind a
20 ms step and measured the loader instead of ``next()``. The consumer checks each batch's
stamped index, and every 8th batch bit for bit, outside the timed region.

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
from producer.synthetic import expected_batch, read_header

DISTINCT = 2  # distinct batches the loader makes once and yields in turn


class Cycling:
    """``batches`` batches: the first ``DISTINCT`` synthetic ones, made once, yielded in turn."""

    def __init__(self, batch_bytes: int, batches: int) -> None:
        self.made = [expected_batch(i, batch_bytes) for i in range(DISTINCT)]
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        return (self.made[i % DISTINCT] for i in range(self.batches))


def _serve(name: str, batch_bytes: int, batches: int) -> None:
    from tensorsocket import Producer

    torch.set_num_threads(1)
    Producer(Cycling(batch_bytes, batches), name=name, slots=8, replay=0).serve(epochs=1)


def _check(batch: Any, index: int, made: list[Any], full: bool) -> None:
    """Raise unless ``batch`` is batch ``index`` of :class:`Cycling`: its stamped index, and
    with ``full`` every byte."""
    want = index % DISTINCT
    stamped = {i for i, _ in read_header(batch[0])}
    if stamped != {want}:
        raise ValueError(f"batch {index}: rows stamped {sorted(stamped)}, expected {want}")
    if full and not all(torch.equal(got, expected) for got, expected in zip(batch, made[want], strict=True)):
        raise ValueError(f"batch {index} differs from synthetic batch {want}")


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": round(statistics.median(s) * 1e6, 1),
        "p90_us": round(s[int(0.9 * (len(s) - 1))] * 1e6, 1),
        "p99_us": round(s[int(0.99 * (len(s) - 1))] * 1e6, 1),
        "n": len(s),
    }


def measure_consumer(batch_bytes: int, batches: int, step_s: float, warmup: int = 8) -> dict[str, Any]:
    """Time ``next()`` after a step, and the floor in the same loop on alternate steps: one
    bare view of an already-mapped buffer of the batch's size, timed right after the step,
    then ``next()`` untimed. So both are timed after the same sleep, beside the same producer,
    at the same pace. (Measured apart, after the run, the floor's median ranged from 15 to 70
    us between runs and the ratio from 0.5x to 1.8x; paired, 1.1x-1.2x.)"""
    from tensorsocket import Consumer

    name = f"overhead-{uuid.uuid4().hex[:8]}"
    producer = SPAWN.Process(target=_serve, args=(name, batch_bytes, batches))
    producer.start()
    made = [expected_batch(i, batch_bytes) for i in range(DISTINCT)]
    buf = mmap.mmap(-1, batch_bytes)  # (the floor's view reads none of it: mapped is enough)
    times, floor = [], []
    try:
        with Consumer(name=name, timeout=60) as consumer:
            it = iter(consumer)
            first = next(it)  # start-up is not overhead
            _check(first, 0, made, full=True)
            del first
            for index in range(1, batches):
                time.sleep(step_s)
                timing_floor = index % 2 == 1  # odd steps time the floor, even ones next()
                if timing_floor:
                    t0 = time.perf_counter()
                    view = torch.frombuffer(buf, dtype=torch.uint8)
                    spent = time.perf_counter() - t0
                    del view
                t0 = time.perf_counter()
                batch = next(it)
                if not timing_floor:
                    spent = time.perf_counter() - t0
                if index > warmup:  # the first pass over the slots maps them: not steady state
                    (floor if timing_floor else times).append(spent)
                _check(batch, index, made, full=index % 8 == 0)  # (outside the timed region)
                del batch
    finally:
        producer.join(timeout=60)
    hot = []
    for _ in range(1000):
        t0 = time.perf_counter()
        view = torch.frombuffer(buf, dtype=torch.uint8)
        hot.append(time.perf_counter() - t0)
        del view
    return {
        "next": _percentiles(times),
        "floor": {"after_step": _percentiles(floor), "hot_loop": _percentiles(hot)},
    }


def run(sizes_mib: tuple[int, ...] = (1, 64), batches: int = 100, step_ms: float = 20.0) -> dict[str, Any]:
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
        measured = measure_consumer(size, batches, step_s)
        consumer, floor = measured["next"], measured["floor"]
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
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="the simulated training step")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(batches=args.batches, step_ms=args.step_ms)
    if not args.no_write:
        print("wrote", write(result, "overhead"))


if __name__ == "__main__":
    main()
