"""What tensorsocket itself costs per batch: CPU of the producer and of each consumer over
thousands of tiny batches (32x16 float32 + 32 int64 labels: only the protocol counts), and
batches/s, for several consumer settings side by side in one run.

Each consumer takes every batch and drops it at once (no training step), so the consumer's
process CPU per batch (``time.process_time()``, every thread: its I/O thread included) is what
tensorsocket costs it. The producer's loader yields the same few batches over and over, made
once. Variants, one after the other in the same run:

* ``read-only``: the default: host batches mapped read-only, no fingerprint check at release;
* ``check_writes``: ``Consumer(check_writes=True)``: writable mappings, each batch's sampled
  fingerprint checked at release (what every host consumer did before read-only mappings);
* ``zeromq``: as ``read-only``, but the producer offers no sessions (``TENSORSOCKET_SESSION=0``),
  so every message goes over ZeroMQ (what every consumer did before sessions).

    python3 -m benchmarks.protocol_cost [--batches 5000] [--consumers 1,4] [--repeat 3]
    # -> benchmarks/results/protocol_cost-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.sharing import RESULTS, SPAWN, machine, write

VARIANTS = {"read-only": {}, "check_writes": {"check_writes": True}, "zeromq": {}}
#: The producer's environment per variant: "zeromq" offers no sessions (every message over ZeroMQ)
PRODUCER_ENV = {"zeromq": {"TENSORSOCKET_SESSION": "0"}}


class Tiny:
    """``batches`` batches an epoch, four distinct ones made once, yielded over and over."""

    def __init__(self, batches: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.made = [(torch.rand(32, 16, generator=g), torch.arange(32) + i) for i in range(4)]
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        return (self.made[i % 4] for i in range(self.batches))


def _produce(name: str, batches: int, consumers: int, env: dict[str, str], out: Any) -> None:
    os.environ.update(env)
    from tensorsocket import Producer

    torch.set_num_threads(1)
    with Producer(Tiny(batches), name=name, slots=8, replay=0, min_consumers=consumers) as producer:
        cpu0 = wall0 = None
        for i, _ in enumerate(producer):
            if i == 0:  # from the first batch on: start-up is not per-batch cost
                cpu0, wall0 = time.process_time(), time.perf_counter()
        out.put(
            {"role": "producer", "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}
        )


def _consume(name: str, options: dict[str, Any], out: Any) -> None:
    from tensorsocket import Consumer

    torch.set_num_threads(1)
    with Consumer(name=name, timeout=60, **options) as consumer:
        taken, cpu0 = 0, None
        for batch in consumer:
            if cpu0 is None:
                cpu0 = time.process_time()
            taken += 1
            del batch
        out.put({"role": "consumer", "cpu_s": time.process_time() - cpu0, "taken": taken})


def run_once(variant: str, consumers: int, batches: int, timeout: float) -> dict[str, Any]:
    name = f"cost-{uuid.uuid4().hex[:8]}"
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_consume, args=(name, VARIANTS[variant], out)) for _ in range(consumers)]
    procs.append(
        SPAWN.Process(target=_produce, args=(name, batches, consumers, PRODUCER_ENV.get(variant, {}), out))
    )
    for p in procs:
        p.start()
    reports = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    producer = next(r for r in reports if r["role"] == "producer")
    taken = [r for r in reports if r["role"] == "consumer"]
    n = batches - 1  # per batch after the first
    return {
        "variant": variant,
        "consumers": consumers,
        "producer_cpu_us_per_batch": round(producer["cpu_s"] / n * 1e6, 1),
        "consumer_cpu_us_per_batch": [round(r["cpu_s"] / n * 1e6, 1) for r in taken],
        "batches_per_s": round(n / producer["wall_s"], 1),
        "every_batch": all(r["taken"] == batches for r in taken),
    }


def line(r: dict[str, Any]) -> str:
    """One run, as printed."""
    wrong = f", wrong: {r['wrong_batches']}" if "wrong_batches" in r else ""
    return (
        f"{r['variant']:>13} x{r['consumers']}: consumer CPU {statistics.median(r['consumer_cpu_us_per_batch']):.1f} "
        f"us/batch, producer CPU {r['producer_cpu_us_per_batch']:.1f} us/batch, "
        f"{r['batches_per_s']:.0f} batches/s, every batch: {r['every_batch']}{wrong}"
    )


def medians(runs: list[dict[str, Any]], consumers: int, variants: Any) -> dict[str, dict[str, float]]:
    """Each variant's medians over its runs with ``consumers`` consumers."""
    out = {}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant and r["consumers"] == consumers]
        out[variant] = {
            "consumer_cpu_us_per_batch": statistics.median(
                statistics.median(r["consumer_cpu_us_per_batch"]) for r in mine
            ),
            "producer_cpu_us_per_batch": statistics.median(r["producer_cpu_us_per_batch"] for r in mine),
            "batches_per_s": statistics.median(r["batches_per_s"] for r in mine),
        }
    return out


def ratios(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``a``'s medians over ``b``'s, figure by figure."""
    return {
        k: round(a[k] / b[k], 2)
        for k in ("consumer_cpu_us_per_batch", "producer_cpu_us_per_batch", "batches_per_s")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--consumers", default="1,4", help="consumer counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (variant, count), round-robin")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.consumers.split(",")]
    runs = []
    for rep in range(args.repeat):
        for consumers in counts:
            for variant in VARIANTS:
                r = run_once(variant, consumers, args.batches, args.timeout) | {"run": rep + 1}
                runs.append(r)
                print(line(r), flush=True)
    summary = []
    for consumers in counts:
        row: dict[str, Any] = {"consumers": consumers, **medians(runs, consumers, VARIANTS)}
        row["consumer_cpu_check_writes_over_read_only"] = round(
            row["check_writes"]["consumer_cpu_us_per_batch"] / row["read-only"]["consumer_cpu_us_per_batch"],
            2,
        )
        row["read_only_over_zeromq"] = ratios(row["read-only"], row["zeromq"])  # what sessions change
        print(f"x{consumers}: read-only (sessions) / zeromq: {row['read_only_over_zeromq']}")
        summary.append(row)
    result = {
        "benchmark": "protocol_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.protocol_cost", *(argv or sys.argv[1:])],
        "machine": machine(),
        "config": {"batches": args.batches, "batch": "(float32 32x16, int64 32)", "slots": 8, "replay": 0},
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write(result, 'protocol_cost', folder=args.out or RESULTS)}")


if __name__ == "__main__":
    main()
