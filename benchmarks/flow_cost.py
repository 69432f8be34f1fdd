"""The flow's cost per batch: reserve + publish + one release per consumer, with 1, 4 and 8
consumers, and as the replay buffer grows (16, 512 and 4104 places, the most a producer
makes). The flow runs under the producer's lock, so this is time its I/O thread and
publisher cannot overlap. Single-threaded pure Python, so the fastest of a few repeats is a
steady figure even on a noisy machine.

    python -m benchmarks.flow_cost [--label after] [--repeat 5]
    # -> benchmarks/results/flow_cost-<label>-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

from benchmarks.sharing import machine, write
from tensorsocket.flow import Flow

#: (consumers, places): protocol_cost's producer (slots=8, replay=0), then a growing replay buffer
CASES = ((1, 8), (4, 8), (8, 16), (8, 512), (8, 4104))


def per_batch_us(places: int, consumers: int, batches: int = 3000) -> float:
    flow = Flow(window=8, places=places)
    for c in range(consumers):
        flow.join(c, 8)
    t0 = time.perf_counter()
    for i in range(batches):
        place = flow.reserve()
        assert place is not None
        flow.publish(place, i)
        for c in range(consumers):
            flow.release(c, list(flow.consumers[c].held))
    return (time.perf_counter() - t0) / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="current", help="names the result file (e.g. the commit measured)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case; the fastest counts")
    args = parser.parse_args()
    figures = {}
    for consumers, places in CASES:
        best = min(per_batch_us(places, consumers) for _ in range(args.repeat))
        figures[f"{consumers} consumers, {places} places"] = round(best, 1)
        print(f"{consumers} consumers, {places:5d} places: {best:6.1f} us per batch")
    result = {
        "benchmark": "flow_cost",
        "label": args.label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {"window": 8, "batches": 3000, "repeat": args.repeat},
        "us_per_batch": figures,
    }
    print(f"wrote {write(result, f'flow_cost-{args.label}')}")


if __name__ == "__main__":
    main()
