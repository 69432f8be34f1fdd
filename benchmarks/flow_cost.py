"""The flow's cost per batch as the replay buffer grows: reserve + publish + one release per
consumer, 8 consumers, for 16, 512 and 4104 places (the most a producer makes). The flow runs
under the producer's lock, so this is time its I/O thread and publisher cannot overlap.

    python -m benchmarks.flow_cost [--label after]   # writes benchmarks/results/flow_cost-<label>-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

from benchmarks.sharing import machine, write
from tensorsocket.flow import Flow


def per_batch_us(places: int, consumers: int = 8, batches: int = 3000) -> float:
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
    label = parser.parse_args().label
    figures = {}
    for places in (16, 512, 4104):
        figures[places] = round(per_batch_us(places), 1)
        print(f"{places:5d} places: {figures[places]:7.1f} us per batch (8 consumers)")
    result = {
        "benchmark": "flow_cost",
        "label": label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {"consumers": 8, "window": 8, "batches": 3000},
        "us_per_batch_by_places": figures,
    }
    print(f"wrote {write(result, f'flow_cost-{label}')}")


if __name__ == "__main__":
    main()
