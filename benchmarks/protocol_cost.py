"""What tensorsocket itself costs per batch: CPU of the producer and of each consumer over
thousands of tiny batches (32x16 float32 + 32 int64 labels: only the protocol counts), and
batches/s, for several consumer settings side by side in one run.

Each consumer takes every batch and drops it at once (no training step), so the consumer's
process CPU per batch (``time.process_time()``, every thread: its I/O thread included) is what
tensorsocket costs it. Each process's CPU is also split by thread (each thread's own CPU
clock): the caller's thread, the I/O thread, and the rest of the process (ZeroMQ's own
threads). The producer's loader yields the same few batches over and over, made once.
Variants, one after the other in the same run, their order turned by one each round:

* ``read-only``: the default: host batches mapped read-only, no fingerprint check at release;
* ``check_writes``: ``Consumer(check_writes=True)``: writable mappings, each batch's sampled
  fingerprint checked at release (what every host consumer did before read-only mappings);
* ``zeromq``: as ``read-only``, but the producer offers no sessions (``TENSORSOCKET_SESSION=0``),
  so every message goes over ZeroMQ (what every consumer did before sessions);
* ``plain-waits``: as ``read-only``, but the consumers wait as ``SCHED_OTHER``
  (``TENSORSOCKET_YIELDING=0``: what they did before ``tensorsocket.yielding``).

Then, unless ``--no-goals``, issue 18's goals next to their floors, measured in the same run:
each round also runs ``benchmarks.lean_path``'s one-thread prototype (tensorsocket's own
per-batch code over bare Unix sockets, no heartbeats or liveness: a floor for CPU and
batches/s), and at the end ``benchmarks.overhead`` times ``next()`` after a 20 ms step for
1 MiB and 64 MiB batches against one bare view after the same sleep. The JPEG-scenario goal
takes minutes and runs on its own (``python3 -m benchmarks.sharing``).

    python3 -m benchmarks.protocol_cost [--batches 5000] [--consumers 1,4] [--repeat 3] [--no-goals] [--replay -1]
    # -> benchmarks/results/protocol_cost-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.sharing import RESULTS, SPAWN, machine, start_and_collect, write

VARIANTS = {"read-only": {}, "check_writes": {"check_writes": True}, "zeromq": {}, "plain-waits": {}}
#: The producer's environment per variant: "zeromq" offers no sessions (every message over ZeroMQ)
PRODUCER_ENV = {"zeromq": {"TENSORSOCKET_SESSION": "0"}}
#: The consumers' environment per variant (the producer's own waits are plain either way)
CONSUMER_ENV = {"plain-waits": {"TENSORSOCKET_YIELDING": "0"}}


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


#: Python threads by name, as the split reports them (the rest of a process is "other")
THREADS = {"MainThread": "caller", "tensorsocket-producer-io": "io", "tensorsocket-consumer-io": "io"}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process (``"process"``) and of each of its threads named in
    :data:`THREADS`, read from each thread's own CPU clock."""
    out = {"process": time.process_time()}
    for thread in threading.enumerate():
        role = THREADS.get(thread.name)
        if role is not None and thread.ident is not None:
            out[role] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return out


def _split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`_thread_cpu` readings: each thread's, and the rest's."""
    spent = {role: after[role] - before[role] for role in after if role in before}
    spent["other"] = spent["process"] - sum(v for role, v in spent.items() if role != "process")
    return spent


def _produce(
    name: str, batches: int, consumers: int, env: dict[str, str], out: Any, replay: int | None = 0
) -> None:
    os.environ.update(env)
    from tensorsocket import Producer

    torch.set_num_threads(1)
    with Producer(Tiny(batches), name=name, slots=8, replay=replay, min_consumers=consumers) as producer:
        cpu0 = wall0 = None
        for i, _ in enumerate(producer):
            if i == 0:  # from the first batch on: start-up is not per-batch cost
                cpu0, wall0 = _thread_cpu(), time.perf_counter()
        spent, wall = _split(cpu0, _thread_cpu()), time.perf_counter() - wall0
        out.put({"role": "producer", "cpu_s": spent["process"], "threads_s": spent, "wall_s": wall})


def _consume(name: str, options: dict[str, Any], out: Any, env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})
    from tensorsocket import Consumer

    torch.set_num_threads(1)
    with Consumer(name=name, timeout=60, **options) as consumer:
        taken, cpu0 = 0, None
        for batch in consumer:
            if cpu0 is None:
                cpu0 = _thread_cpu()
            taken += 1
            del batch
        spent = _split(cpu0, _thread_cpu())  # (before close(): the I/O thread is still there)
        out.put({"role": "consumer", "cpu_s": spent["process"], "threads_s": spent, "taken": taken})


def run_once(
    variant: str, consumers: int, batches: int, timeout: float, replay: int | None = 0
) -> dict[str, Any]:
    name = f"cost-{uuid.uuid4().hex[:8]}"
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_consume, args=(name, VARIANTS[variant], out, CONSUMER_ENV.get(variant)))
        for _ in range(consumers)
    ]
    procs.append(
        SPAWN.Process(
            target=_produce, args=(name, batches, consumers, PRODUCER_ENV.get(variant, {}), out, replay)
        )
    )
    reports = start_and_collect(procs, out, len(procs), timeout)
    producer = next(r for r in reports if r["role"] == "producer")
    taken = [r for r in reports if r["role"] == "consumer"]
    n = batches - 1  # per batch after the first
    return {
        "variant": variant,
        "consumers": consumers,
        "producer_cpu_us_per_batch": round(producer["cpu_s"] / n * 1e6, 1),
        "consumer_cpu_us_per_batch": [round(r["cpu_s"] / n * 1e6, 1) for r in taken],
        "producer_threads_us_per_batch": _per_batch(producer["threads_s"], n),
        "consumer_threads_us_per_batch": [_per_batch(r["threads_s"], n) for r in taken],
        "batches_per_s": round(n / producer["wall_s"], 1),
        "every_batch": all(r["taken"] == batches for r in taken),
    }


def _per_batch(threads_s: dict[str, float], n: int) -> dict[str, float]:
    return {role: round(v / n * 1e6, 1) for role, v in threads_s.items() if role != "process"}


def line(r: dict[str, Any]) -> str:
    """One run, as printed."""
    wrong = f", wrong: {r['wrong_batches']}" if "wrong_batches" in r else ""
    return (
        f"{r['variant']:>13} x{r['consumers']}: consumer CPU {statistics.median(r['consumer_cpu_us_per_batch']):.1f} "
        f"us/batch, producer CPU {r['producer_cpu_us_per_batch']:.1f} us/batch, "
        f"{r['batches_per_s']:.0f} batches/s, every batch: {r['every_batch']}{wrong}"
        + ("" if "producer_threads_us_per_batch" not in r else "\n" + " " * 17 + by_thread(r))
    )


def by_thread(r: dict[str, Any]) -> str:
    """One run's CPU per batch split by thread (the consumers': their median)."""
    consumer = _by_role(r["consumer_threads_us_per_batch"])
    producer = r["producer_threads_us_per_batch"]
    return "by thread: consumer " + _roles(consumer) + "; producer " + _roles(producer)


def _roles(split: dict[str, float]) -> str:
    return ", ".join(f"{role} {split[role]:.0f}" for role in ("caller", "io", "other") if role in split)


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
        if all("producer_threads_us_per_batch" in r for r in mine):  # (lean_path's own runs have none)
            out[variant]["consumer_threads_us_per_batch"] = _by_role(
                [_by_role(r["consumer_threads_us_per_batch"]) for r in mine]
            )
            out[variant]["producer_threads_us_per_batch"] = _by_role(
                [r["producer_threads_us_per_batch"] for r in mine]
            )
    return out


def _by_role(splits: list[dict[str, float]]) -> dict[str, float]:
    """The median of each thread's figure over several splits (consumers, or runs)."""
    return {role: statistics.median(s[role] for s in splits) for role in splits[0]}


def ratios(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``a``'s medians over ``b``'s, figure by figure."""
    return {
        k: round(a[k] / b[k], 2)
        for k in ("consumer_cpu_us_per_batch", "producer_cpu_us_per_batch", "batches_per_s")
    }


def goal_table(
    summary: list[dict[str, Any]], lean: dict[int, dict[str, float]], latency: dict[str, Any]
) -> list[dict[str, Any]]:
    """Issue 18's goals: each one's figure from this run, its floor from the same run, and
    whether it is met. ``lean``: the one-thread prototype's medians by consumer count;
    ``latency``: a :func:`benchmarks.overhead.run` result."""
    rows: list[dict[str, Any]] = []
    for row in summary:
        n, ours, floor = row["consumers"], row["read-only"], lean[row["consumers"]]
        for key, what, target in (
            ("consumer_cpu_us_per_batch", f"consumer CPU per batch, {n} consumer(s) (us)", 60.0),
            ("producer_cpu_us_per_batch", f"producer CPU per batch, {n} consumer(s) (us)", 60.0 + 15.0 * n),
        ):
            rows.append({"goal": what, "measured": ours[key], "floor": floor[key], "target": target,
                         "met": ours[key] <= target})  # fmt: skip
        if n == 4:
            b = ours["batches_per_s"]
            rows.append({"goal": "batches/s, 4 consumers", "measured": b, "floor": floor["batches_per_s"],
                         "target": 5000.0, "met": b >= 5000.0})  # fmt: skip
    for size, r in latency["sizes"].items():
        bare = r["floor"]["after_step"]["p50_us"]
        rows.append({"goal": f"next() after a 20 ms step, {size}, p50 (us)", "measured": r["next"]["p50_us"],
                     "floor": bare, "target": 2 * bare, "met": r["next"]["p50_us"] <= 2 * bare})  # fmt: skip
    return rows


def format_goals(rows: list[dict[str, Any]]) -> str:
    """The goals table, as printed: the floor is lean_path's for CPU and batches/s, a bare
    view after the same sleep for next()."""
    out = [f"{'goal':<48} {'measured':>9} {'floor':>9} {'target':>9}  met"]
    for r in rows:
        out.append(
            f"{r['goal']:<48} {r['measured']:>9.1f} {r['floor']:>9.1f} {r['target']:>9.1f}  "
            + ("yes" if r["met"] else "no")
        )
    out.append("(the JPEG-scenario goals: python3 -m benchmarks.sharing)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--consumers", default="1,4", help="consumer counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (variant, count), round-robin")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-goals", action="store_true", help="skip the floors and the goals table")
    parser.add_argument(
        "--replay", type=int, default=0, help="the producer's replay budget in bytes (-1: its default)"
    )
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.consumers.split(",")]
    from benchmarks import lean_path, overhead  # (lean_path imports this module)

    runs, floors = [], []
    for rep in range(args.repeat):
        shift = rep % len(VARIANTS)  # (the order turns each round: no variant always runs after another)
        order = list(VARIANTS)[shift:] + list(VARIANTS)[:shift]
        for consumers in counts:
            for variant in order:
                replay = None if args.replay < 0 else args.replay
                r = run_once(variant, consumers, args.batches, args.timeout, replay) | {"run": rep + 1}
                runs.append(r)
                print(line(r), flush=True)
            if not args.no_goals:
                r = lean_path.run_lean("lean", consumers, args.batches, args.timeout) | {"run": rep + 1}
                floors.append(r)
                print(line(r), flush=True)
    summary = []
    for consumers in counts:
        row: dict[str, Any] = {"consumers": consumers, **medians(runs, consumers, VARIANTS)}
        row["consumer_cpu_check_writes_over_read_only"] = round(
            row["check_writes"]["consumer_cpu_us_per_batch"] / row["read-only"]["consumer_cpu_us_per_batch"],
            2,
        )
        row["read_only_over_zeromq"] = ratios(row["read-only"], row["zeromq"])  # what sessions change
        # and what waiting as SCHED_BATCH changes (tensorsocket.yielding)
        row["read_only_over_plain_waits"] = ratios(row["read-only"], row["plain-waits"])
        print(f"x{consumers}: read-only (sessions) / zeromq: {row['read_only_over_zeromq']}")
        print(
            f"x{consumers}: read-only (SCHED_BATCH waits) / plain-waits: {row['read_only_over_plain_waits']}"
        )
        summary.append(row)
    goals = None
    if not args.no_goals:
        latency = overhead.run(step_ms=20.0)
        goals = goal_table(summary, {c: medians(floors, c, ["lean"])["lean"] for c in counts}, latency)
        print(format_goals(goals))
    result = {
        "benchmark": "protocol_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.protocol_cost", *(argv or sys.argv[1:])],
        "machine": machine(),
        "config": {
            "batches": args.batches,
            "batch": "(float32 32x16, int64 32)",
            "slots": 8,
            "replay": args.replay,
        },
        "summary": summary,
        "goals": goals,
        "runs": runs,
        "floor_runs": floors,
    }
    print(f"wrote {write(result, 'protocol_cost', folder=args.out or RESULTS)}")


if __name__ == "__main__":
    main()
