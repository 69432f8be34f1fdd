"""The flow's cost per batch as the producer drives it: reserve, publish, and each consumer's
releases four at a time (as a consumer sends them), with 1, 4 and 8 consumers in a window of 8
places (protocol_cost's producer: slots=8), without and with replay (``keep=256``: the
producer keeps tiny batches for joiners, asking before each place whether a joiner waits for
one). The flow runs under the producer's lock, so this is time its I/O thread and publisher
cannot overlap. Single-threaded pure Python, so the fastest of a few repeats is a steady figure
even on a noisy machine.

    python -m benchmarks.flow_cost [--label after] [--repeat 5]
    # -> benchmarks/results/flow_cost-<label>-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

from benchmarks.sharing import machine, write
from tensorsocket.flow import Flow

#: (consumers, batches kept for replay)
CASES = ((1, 0), (4, 0), (8, 0), (1, 256), (4, 256))
RELEASED_TOGETHER = 4  # (tensorsocket.consumer.caller_turn sends a consumer's releases four to a message)


def per_batch_us(consumers: int, keep: int, batches: int = 3000) -> float:
    flow = Flow(window=8)
    for c in range(consumers):
        flow.join(c, 8)
    t0 = time.perf_counter()
    for i in range(batches):
        if keep:
            assert flow.restage() is None
        place = flow.reserve()
        assert place is not None
        flow.publish(place, i, keep)
        if i % RELEASED_TOGETHER == RELEASED_TOGETHER - 1:
            for c in range(consumers):
                flow.release(c, list(flow.consumers[c].held))
    return (time.perf_counter() - t0) / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="current", help="names the result file (e.g. the commit measured)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case; the fastest counts")
    args = parser.parse_args()
    figures = {}
    for consumers, keep in CASES:
        best = min(per_batch_us(consumers, keep) for _ in range(args.repeat))
        figures[f"{consumers} consumers, keep {keep}"] = round(best, 1)
        print(f"{consumers} consumers, keep {keep:3d}: {best:6.1f} us per batch")
    result = {
        "benchmark": "flow_cost",
        "label": args.label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "window": 8,
            "batches": 3000,
            "released_together": RELEASED_TOGETHER,
            "repeat": args.repeat,
        },
        "us_per_batch": figures,
    }
    print(f"wrote {write(result, f'flow_cost-{args.label}')}")


if __name__ == "__main__":
    main()
