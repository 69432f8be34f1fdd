"""The flow's cost per batch as the replay buffer grows: reserve + publish + one release per
consumer, 8 consumers, for 16, 512 and 4104 places (the most a producer makes). The flow runs
under the producer's lock, so this is time its I/O thread and publisher cannot overlap.

    python -m benchmarks.flow_cost
"""

from __future__ import annotations

import time

from tensorsocket.flow import Flow


def per_batch_us(places: int, consumers: int = 8, batches: int = 3000) -> float:
    flow = Flow(window=8, places=places)
    for c in range(consumers):
        flow.join(c, 8)
    t0 = time.perf_counter()
    for i in range(batches):
        slot = flow.reserve()
        assert slot is not None
        flow.publish(slot, i)
        for c in range(consumers):
            flow.release(c, list(flow.consumers[c].held))
    return (time.perf_counter() - t0) / batches * 1e6


def main() -> None:
    for places in (16, 512, 4104):
        print(f"{places:5d} places: {per_batch_us(places):7.1f} us per batch (8 consumers)")


if __name__ == "__main__":
    main()
