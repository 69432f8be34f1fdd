"""What a consumer costs per batch when it trains between batches: process CPU per batch of
consumers that sleep a "training step" after each batch, split by thread, with the wake-ups of
the consumer's I/O thread per batch (its voluntary context switches), and the time inside
next(). ``benchmarks.protocol_cost`` measures a consumer that takes batches back to back;
there the caller's thread reads every batch itself and the I/O thread hardly runs. With a
step, each wake-up of a thread costs ~250 us of CPU on the 2-core VM (cold caches), more than
the Python that builds a batch, so how often the I/O thread wakes is most of the cost.

Two cases, each with 1 and 4 consumers, 1 MiB batches (the cost does not grow with the size:
batches are views of shared memory):

* ``producer ahead``: the loader yields made batches (the producer keeps the window full),
  each consumer steps ``--step-ms`` (20) after each batch;
* ``loader behind``: the loader sleeps ``--loader-ms`` (30) per batch, the consumers step
  10 ms: they wait in next() for every batch.

    python3 -m benchmarks.step_cpu [--batches 150] [--repeat 2] [--tag T | --out PATH]
    # -> benchmarks/results/step_cpu-<host or T>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.protocol_cost import _split, _thread_cpu
from benchmarks.sharing import SPAWN, machine, start_and_collect, write

BATCH_BYTES = 1 << 20
CASES = {"producer ahead": (0.0, 20.0), "loader behind": (30.0, 10.0)}  # (loader ms, step ms)


class Made:
    """``batches`` batches of ``BATCH_BYTES``, two made once and yielded in turn, each after
    ``loader_s`` of sleep (a loader slower than the consumers, without using CPU)."""

    def __init__(self, batches: int, loader_s: float) -> None:
        self.made = [(torch.full((BATCH_BYTES,), i, dtype=torch.uint8),) for i in range(2)]
        self.batches, self.loader_s = batches, loader_s

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        for i in range(self.batches):
            if self.loader_s:
                time.sleep(self.loader_s)
            yield self.made[i % 2]


def _produce(name: str, batches: int, consumers: int, loader_s: float) -> None:
    from tensorsocket import Producer

    torch.set_num_threads(1)
    with Producer(Made(batches, loader_s), name=name, slots=8, replay=0, min_consumers=consumers) as producer:
        for _ in producer:
            pass


def voluntary_switches(thread: threading.Thread) -> int:
    """The voluntary context switches of ``thread`` so far: each is a sleep, so each wake-up."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise RuntimeError("no voluntary_ctxt_switches in /proc/self/task/*/status")


def _consume(name: str, step_s: float, out: Any) -> None:
    from tensorsocket import Consumer

    torch.set_num_threads(1)
    with Consumer(name=name, timeout=60) as consumer:
        io = next(t for t in threading.enumerate() if t.name == "tensorsocket-consumer-io")
        it = iter(consumer)
        batch = next(it)  # start-up is not per-batch cost
        want, wrong, inside = 1, 0, []
        del batch
        cpu0, woken0 = _thread_cpu(), voluntary_switches(io)
        for _ in range(len(consumer) - 1):
            time.sleep(step_s)
            t0 = time.perf_counter()
            batch = next(it)
            inside.append(time.perf_counter() - t0)
            wrong += int(batch[0][0].item() != want % 2)
            want += 1
            del batch
        spent, woken = _split(cpu0, _thread_cpu()), voluntary_switches(io) - woken0
        n = want - 1
        out.put(
            {
                "cpu_us_per_batch": round(spent["process"] / n * 1e6, 1),
                "threads_us_per_batch": {
                    k: round(v / n * 1e6, 1) for k, v in spent.items() if k != "process"
                },
                "io_wakeups_per_batch": round(woken / n, 2),
                "next_p50_us": round(statistics.median(inside) * 1e6, 1),
                "batches": want,
                "wrong": wrong,
            }
        )


def run_case(case: str, consumers: int, batches: int, timeout: float = 300.0) -> dict[str, Any]:
    loader_ms, step_ms = CASES[case]
    name = f"step-{uuid.uuid4().hex[:8]}"
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_consume, args=(name, step_ms / 1000, out)) for _ in range(consumers)]
    procs.append(SPAWN.Process(target=_produce, args=(name, batches, consumers, loader_ms / 1000)))
    reports = start_and_collect(procs, out, consumers, timeout)

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in reports), 2)

    return {
        "case": case,
        "consumers": consumers,
        "loader_ms": loader_ms,
        "step_ms": step_ms,
        "cpu_us_per_batch": median("cpu_us_per_batch"),
        "threads_us_per_batch": {
            role: round(statistics.median(r["threads_us_per_batch"][role] for r in reports), 1)
            for role in reports[0]["threads_us_per_batch"]
        },
        "io_wakeups_per_batch": median("io_wakeups_per_batch"),
        "next_p50_us": median("next_p50_us"),
        "exact": all(r["wrong"] == 0 and r["batches"] == batches for r in reports),
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (case, consumers)'s medians over its repeats."""
    keys = sorted({(r["case"], r["consumers"]) for r in runs}, key=lambda k: (list(CASES).index(k[0]), k[1]))
    rows = []
    for case, consumers in keys:
        mine = [r for r in runs if r["case"] == case and r["consumers"] == consumers]
        rows.append(
            {
                "case": case,
                "consumers": consumers,
                **{
                    k: round(statistics.median(r[k] for r in mine), 2)
                    for k in ("cpu_us_per_batch", "io_wakeups_per_batch", "next_p50_us")
                },
                "exact": all(r["exact"] for r in mine),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tag", default=None, help="in the file name instead of the host name")
    parser.add_argument("--out", default=None, help="write here instead")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.repeat):
        for case in CASES:
            for consumers in (1, 4):
                r = run_case(case, consumers, args.batches)
                runs.append(r)
                print(
                    f"{case:>14} x{consumers}: consumer CPU {r['cpu_us_per_batch']:7.1f} us/batch "
                    f"(caller {r['threads_us_per_batch']['caller']:.0f}, io {r['threads_us_per_batch']['io']:.0f}), "
                    f"I/O wake-ups {r['io_wakeups_per_batch']:.2f}/batch, next() p50 {r['next_p50_us']:.0f} us, "
                    f"exact {r['exact']}",
                    flush=True,
                )
    result = {
        "benchmark": "step_cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": ["python3", "-m", "benchmarks.step_cpu", *(argv if argv is not None else os.sys.argv[1:])],
        "machine": machine(),
        "config": {"batches": args.batches, "batch_bytes": BATCH_BYTES, "slots": 8, "cases": CASES},
        "summary": summarize(runs),
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)
    elif not args.no_write:
        print("wrote", write(result, "step_cpu", tag=args.tag))


if __name__ == "__main__":
    main()
