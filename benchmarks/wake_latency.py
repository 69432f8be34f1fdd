"""How long after its batch is published a consumer waiting in next() gets it, with the CPUs
idle and with every CPU busy, for waits as ``SCHED_BATCH`` (``tensorsocket.yielding``, the
default) and plain ones (``TENSORSOCKET_YIELDING=0``), in turn in one run.

Why: a thread that waits as ``SCHED_BATCH`` does not preempt the thread running where it
wakes; with an idle CPU it runs at once, as before, but with every CPU busy it waits for the
scheduler's next tick (4 ms at HZ=250). That is what saves the per-batch switches when
processes outnumber cores (``benchmarks.protocol_cost``); this measures what it costs a
trainer that waits for its data on a saturated machine.

The loader stamps each batch with ``time.monotonic_ns()`` as it yields it, every
``--period-ms`` (20), so consumers always wait; each consumer reads the clock as next()
returns. ``busy``: one process per CPU spins meanwhile (a DataLoader's workers at full tilt).

    python3 -m benchmarks.wake_latency [--batches 200] [--consumers 1,4] [--repeat 2] [--tag T]
    # -> benchmarks/results/wake_latency-<host or T>-<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks.sharing import SPAWN, collect, machine, write

MODES = {"batch waits": "1", "plain waits": "0"}  # TENSORSOCKET_YIELDING


class Stamped:
    """``batches`` batches, one every ``period`` s, each stamped with the time it is yielded."""

    def __init__(self, batches: int, period: float) -> None:
        self.batches, self.period = batches, period

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        for _ in range(self.batches):
            time.sleep(self.period)
            yield torch.tensor([time.monotonic_ns()], dtype=torch.int64)


def _produce(name: str, batches: int, period: float, consumers: int) -> None:
    from tensorsocket import Producer

    with Producer(Stamped(batches, period), name=name, slots=8, replay=0, min_consumers=consumers) as p:
        for _ in p:
            pass


def _consume(name: str, out: Any, yielding: str) -> None:
    os.environ["TENSORSOCKET_YIELDING"] = yielding  # (before tensorsocket is imported: read then)
    from tensorsocket import Consumer

    lags = []
    with Consumer(name=name, timeout=60) as consumer:
        for batch in consumer:
            lags.append((time.monotonic_ns() - int(batch[0])) / 1000)
            del batch
    out.put(lags[1:])  # (the first waited for everyone to join)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def run_case(mode: str, consumers: int, busy: bool, batches: int, period: float) -> dict[str, Any]:
    name, out, stop = f"lag-{uuid.uuid4().hex[:8]}", SPAWN.Queue(), SPAWN.Event()
    spinners = [SPAWN.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 1)] if busy else []
    procs = [SPAWN.Process(target=_consume, args=(name, out, MODES[mode])) for _ in range(consumers)]
    procs.append(SPAWN.Process(target=_produce, args=(name, batches, period, consumers)))
    try:
        for p in spinners + procs:
            p.start()
        reports = collect(out, procs, consumers, 120 + batches * period * 2)  # (a crashed child: at once)
        lags = [lag for report in reports for lag in report]
    finally:
        stop.set()
        for p in spinners + procs:
            p.join(timeout=30)
    lags.sort()

    def pct(q: float) -> float:
        return round(lags[min(len(lags) - 1, int(q * len(lags)))], 1)

    return {
        "mode": mode,
        "consumers": consumers,
        "cpus": "busy" if busy else "idle",
        "lag_us": {
            "p50": pct(0.5),
            "p90": pct(0.9),
            "p99": pct(0.99),
            "mean": round(statistics.fmean(lags), 1),
        },
        "samples": len(lags),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--consumers", default="1,4")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tag", default=None, help="in the file name instead of the host name")
    args = parser.parse_args(argv)
    runs = []
    for rep in range(args.repeat):
        for busy in (False, True):
            for consumers in (int(c) for c in args.consumers.split(",")):
                for mode in list(MODES) if rep % 2 == 0 else list(MODES)[::-1]:
                    r = run_case(mode, consumers, busy, args.batches, args.period_ms / 1000)
                    runs.append(r)
                    lag = r["lag_us"]
                    print(
                        f"CPUs {r['cpus']:4} x{consumers} {mode:11}: lag p50 {lag['p50']:8.1f} us  "
                        f"p90 {lag['p90']:8.1f}  p99 {lag['p99']:8.1f}  mean {lag['mean']:8.1f}",
                        flush=True,
                    )
    summary = []
    for busy in ("idle", "busy"):
        for consumers in sorted({r["consumers"] for r in runs}):
            for mode in MODES:
                rs = [r for r in runs if (r["cpus"], r["consumers"], r["mode"]) == (busy, consumers, mode)]
                summary.append(
                    {
                        "cpus": busy,
                        "consumers": consumers,
                        "mode": mode,
                        **{
                            k: round(statistics.median(r["lag_us"][k] for r in rs), 1)
                            for k in rs[0]["lag_us"]
                        },
                    }
                )
    result = {
        "benchmark": "wake_latency",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [
            "python3",
            "-m",
            "benchmarks.wake_latency",
            *(argv if argv is not None else sys.argv[1:]),
        ],
        "machine": machine(),
        "config": {"batches": args.batches, "period_ms": args.period_ms, "slots": 8},
        "summary_median_of_runs_us": summary,
        "runs": runs,
    }
    print("wrote", write(result, "wake_latency", tag=args.tag))


if __name__ == "__main__":
    main()
