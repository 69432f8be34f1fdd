"""Sharing benchmark: N trainers fed by one shared JPEG pipeline vs N independent DataLoaders.

Every trainer simulates a GPU step of ``--step-ms`` (a sleep: the CPU is free for loading)
and counts samples/s from its first batch to its last. Each batch is first copied to the GPU,
as a real trainer's input step does; without one, into a reused host buffer, which reads every
byte as that copy would (until 2026-11-24 nothing read it: the loader alone never touched its
batches' pages, the producer copying them did). Three ways, one after the other:

* ``single``: one trainer with its own DataLoader: the pipeline's own rate, the bound;
* ``independent``: N trainers, each with its own DataLoader (the status quo);
* ``shared``: one tensorsocket producer running the same DataLoader, N consumers.

Every DataLoader is ``producer.imagefolder.make_loader`` (Pillow decode, random resized
crop, flip, normalise; batch 32, 224x224) with ``--workers`` worker processes. The shared
run also checks that every consumer got every batch of every epoch exactly once. Beside each
way's mean rate per trainer: the slowest shared trainer's, and (with 2 epochs or more) the rates
from the first batch of the second epoch on, when a producer's workers collate into reused
memory (in the first, their pools grow to hold the batches its replay budget keeps).

    python -m benchmarks.sharing            # writes benchmarks/results/sharing-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from producer.imagefolder import make_dataset, make_loader

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SPAWN = mp.get_context("spawn")


def tree_cpu(root: int) -> dict[int, list[float]]:
    """CPU seconds so far of ``root`` and of every process under it, by pid, from /proc:
    ``[parent pid, user, system, children]`` (children: of the ones it waited for, gone)."""
    hz = os.sysconf("SC_CLK_TCK")
    table: dict[int, list[float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # (the name may hold spaces)
        except OSError:
            continue  # gone meanwhile
        ppid, user, system, c_user, c_system = (int(fields[i]) for i in (1, 11, 12, 13, 14))
        table[int(entry)] = [ppid, user / hz, system / hz, (c_user + c_system) / hz]
    under, grew = {root}, True
    while grew:
        more = {pid for pid, row in table.items() if row[0] in under} - under
        under |= more
        grew = bool(more)
    return {pid: table[pid] for pid in under if pid in table}


def _window_cpu(before: dict[int, list[float]], after: dict[int, list[float]]) -> dict[str, list[float]]:
    """What each process spent between two :func:`tree_cpu` readings (JSON keys: pid strings)."""
    out = {}
    for pid, (ppid, user, system, children) in after.items():
        b = before.get(pid, [ppid, 0.0, 0.0, 0.0])
        out[str(pid)] = [ppid, round(user - b[1], 3), round(system - b[2], 3), round(children - b[3], 3)]
    return out


def _train(batches: Any, epochs: int, step_s: float, watch: int | None = None) -> dict[str, Any]:
    """Consume ``epochs`` epochs of ``batches`` with a simulated step; return the rate. With
    ``watch`` (a pid), also what every process under it spent in CPU meanwhile (by pid)."""
    samples = counted = 0
    start = None
    cpu_before: dict[int, list[float]] = {}
    cpu0 = time.process_time()
    per_epoch = []
    gpu = torch.cuda.is_available()
    staging = None
    later_start, later_samples = None, 0  # from the first batch of the second epoch on
    for epoch in range(epochs):
        n = 0
        for images, labels in batches:
            if gpu:
                images, labels = images.to("cuda", non_blocking=True), labels.to("cuda", non_blocking=True)
                torch.cuda.synchronize()
            else:  # read every byte once, as the copy to a GPU would, into one reused buffer
                if staging is None or staging.shape != images.shape:
                    staging = torch.empty_like(images)
                staging.copy_(images)
            if start is None:  # the clock starts at the first batch: start-up is not rate
                start = time.perf_counter()
                cpu_before = tree_cpu(watch) if watch else {}
            else:
                samples += images.shape[0]
            if epoch == 1 and later_start is None:
                later_start = time.perf_counter()
            elif later_start is not None:
                later_samples += images.shape[0]
            assert images.shape[1:] == (3, 224, 224) and labels.shape[0] == images.shape[0]
            del images, labels
            time.sleep(step_s)
            n += 1
            counted += 1
        per_epoch.append(n)
    end = time.perf_counter()
    elapsed = end - (start or end)
    return {
        "pid": os.getpid(),
        "cpu_window": _window_cpu(cpu_before, tree_cpu(watch)) if watch else None,
        "samples": samples,
        "samples_per_s": samples / elapsed if elapsed else 0.0,
        # past the first epoch, when a producer's pool has grown to hold what it keeps
        "later_samples": later_samples,
        "later_samples_per_s": later_samples / (end - later_start)
        if later_start and end > later_start
        else None,
        "batches": counted,
        "batches_per_epoch": per_epoch,
        "seconds": elapsed,
        "main_process_cpu_s": time.process_time() - cpu0,
    }


def _own_loader_trainer(
    root: str, workers: int, epochs: int, step_s: float, watch: int | None, out: Any
) -> None:
    torch.set_num_threads(1)
    report = _train(make_loader(root, batch_size=32, num_workers=workers), epochs, step_s, watch)
    out.put(report)


def _consumer_trainer(name: str, epochs: int, step_s: float, watch: int | None, out: Any) -> None:
    from tensorsocket import Consumer

    torch.set_num_threads(1)
    with Consumer(name=name, timeout=60) as consumer:
        report = _train(consumer, epochs, step_s, watch)
        report["len"] = len(consumer)
    out.put(report)


def _producer(
    root: str, name: str, workers: int, epochs: int, consumers: int, replay: int | None, out: Any
) -> None:
    from tensorsocket import Producer

    torch.set_num_threads(1)
    loader = make_loader(root, batch_size=32, num_workers=workers)
    producer = Producer(loader, name=name, slots=8, min_consumers=consumers, replay=replay)
    cpu0 = time.process_time()
    producer.serve(epochs=epochs)
    status = producer.status()
    out.put(
        {
            "producer": True,
            "pid": os.getpid(),
            "main_process_cpu_s": time.process_time() - cpu0,
            **{k: status[k] for k in ("published", "loader_wait", "publish_time", "slot_bytes")},
        }
    )


def collect(out: Any, procs: list[Any], reporters: int, timeout: float) -> list[Any]:
    """The first ``reporters`` reports put on ``out`` by ``procs``. Fails at once when one of
    them exits with an error before every report came (its traceback is above), else after
    ``timeout`` s with none: a benchmark whose child crashed never waits out its whole timeout."""
    reports: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(reports) < reporters:
        try:
            reports.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(reports)} of {reporters} processes reported; "
                    + (f"pids {dead} failed (tracebacks above)" if dead else f"none for {timeout:.0f} s")
                ) from None
    return reports


def start_and_collect(procs: list[Any], out: Any, reporters: int, timeout: float) -> list[dict[str, Any]]:
    """Start ``procs``, :func:`collect` their reports, then end them (killed if still there
    30 s after: a failed run leaves no process behind)."""
    for p in procs:
        p.start()
    try:
        return collect(out, procs, reporters, timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def _run(targets: list[tuple[Any, tuple[Any, ...]]], timeout: float) -> list[dict[str, Any]]:
    """Run every target in its own process; each puts one report on the queue it is given."""
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=t, args=(*args, out)) for t, args in targets]
    return start_and_collect(procs, out, len(procs), timeout)


def run(
    trainers: int = 4,
    step_ms: float = 10.0,
    images: int = 1024,
    epochs: int = 2,
    workers: int = 2,
    data: Path | None = None,
    modes: tuple[str, ...] = ("single", "independent", "shared"),
    log: Any = print,
    replay: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark, its ways in the order of ``modes``; return every figure (and what
    the run was) as a dict."""
    data = data or ROOT / "data" / f"jpeg-{images}"
    t0 = time.perf_counter()
    root = str(make_dataset(data, count=images))
    log(f"dataset: {images} JPEGs in {root} ({time.perf_counter() - t0:.1f} s)")
    step_s = step_ms / 1000
    timeout = 600.0
    result: dict[str, Any] = {}

    def single() -> None:
        log("single: one trainer, its own DataLoader ...")
        result["single"] = _run(
            [(_own_loader_trainer, (root, workers, epochs, step_s, os.getpid()))], timeout
        )

    def independent() -> None:
        log(f"independent: {trainers} trainers, each its own DataLoader ...")
        result["independent"] = _run(
            [(_own_loader_trainer, (root, workers, epochs, step_s, None))] * trainers, timeout
        )

    def shared() -> None:
        log(f"shared: one tensorsocket producer, {trainers} consumers ...")
        name = f"bench-{uuid.uuid4().hex[:8]}"
        targets = [(_consumer_trainer, (name, epochs, step_s, os.getpid()))]
        targets += [(_consumer_trainer, (name, epochs, step_s, None))] * (trainers - 1)
        targets.append((_producer, (root, name, workers, epochs, trainers, replay)))
        reports = _run(targets, timeout)
        result["producer"] = [r for r in reports if r.get("producer")]
        expected = -(-images // 32)
        consumers = [r for r in reports if not r.get("producer")]
        for r in consumers:
            r["exact"] = r["batches_per_epoch"] == [expected] * epochs and r["len"] == expected
        result["shared"] = consumers

    ways = {"single": single, "independent": independent, "shared": shared}
    for mode in modes:  # in the order given: rounds() swaps it every round
        ways[mode]()

    def rates(mode: str, key: str = "samples_per_s") -> list[float]:
        return [r[key] for r in result.get(mode, []) if r.get(key) is not None]

    def mean(mode: str, key: str = "samples_per_s") -> float:
        got = rates(mode, key) if mode != "producer" else []
        return sum(got) / len(got) if got else float("nan")

    summary = {mode: round(mean(mode), 1) for mode in result if mode != "producer"}
    cpu = {
        mode: where_cpu_went(result[mode], result.get("producer", []))
        for mode in ("single", "shared")
        if mode in result
    }
    if "shared" in result and "independent" in result:
        summary["shared_over_independent"] = round(mean("shared") / mean("independent"), 2)
    if "shared" in result and "single" in result:
        summary["shared_gap_to_single_pct"] = round(100 * (1 - mean("shared") / mean("single")), 1)
        # the wording: every consumer, so the slowest one too; and past the first epoch
        summary["slowest_shared_gap_to_single_pct"] = round(
            100 * (1 - min(rates("shared")) / mean("single")), 1
        )
        if rates("shared", "later_samples_per_s") and rates("single", "later_samples_per_s"):
            later = 1 - mean("shared", "later_samples_per_s") / mean("single", "later_samples_per_s")
            summary["after_first_epoch_gap_to_single_pct"] = round(100 * later, 1)
    return {
        "benchmark": "sharing",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "trainers": trainers,
            "step_ms": step_ms,
            "images": images,
            "epochs": epochs,
            "batch_size": 32,
            "image_size": 224,
            "workers_per_loader": workers,
            "replay_bytes": replay,  # None: the producer's default budget
        },
        "per_trainer_samples_per_s": summary,
        # machine CPU while the first trainer ran (first batch to last), ms per batch, by role
        "cpu_ms_per_batch": cpu,
        "runs": result,
    }


def rounds(count: int, **kwargs: Any) -> dict[str, Any]:
    """The loader alone and the shared producer, ``count`` times in turn (the order swapped
    every round); ``kwargs`` go to :func:`run`. Why: on the 2-core VM the same JPEG work cost
    the workers 76-114 ms of CPU a batch from one round to the next, and a round's gap ranged
    from -7% to 29% (sharing-vm-rounds-4trainers-2026-11-24.json), so one round says little.
    The medians, and tensorsocket's CPU a batch (the producer and consumers, less the loader
    alone's trainer: it includes the N - 1 more reads of each batch that N trainers make
    anyway), say more."""
    orders = [("single", "shared") if i % 2 == 0 else ("shared", "single") for i in range(count)]
    runs = [run(modes=order, **kwargs) for order in orders]
    cpu = [r["cpu_ms_per_batch"] for r in runs]
    own = [c["shared"]["producer"] + c["shared"]["trainers"] - c["single"]["trainers"] for c in cpu]

    def median(values: Any) -> float:
        return round(statistics.median(values), 2)

    def by_role(mode: str) -> dict[str, float]:
        return {role: median(c[mode][role] for c in cpu) for role in cpu[0][mode]}

    rates = [r["per_trainer_samples_per_s"] for r in runs]
    later = {}  # past the first epoch (when there is a second)
    if all("after_first_epoch_gap_to_single_pct" in r for r in rates):
        gaps = [r["after_first_epoch_gap_to_single_pct"] for r in rates]
        later = {"after_first_epoch_gap_pct": gaps, "after_first_epoch_gap_pct_median": median(gaps)}
    summary = {
        "gap_pct": [r["shared_gap_to_single_pct"] for r in rates],
        "gap_pct_median": median(r["shared_gap_to_single_pct"] for r in rates),
        "slowest_gap_pct": [r["slowest_shared_gap_to_single_pct"] for r in rates],
        "slowest_gap_pct_median": median(r["slowest_shared_gap_to_single_pct"] for r in rates),
        "samples_per_s_median": {mode: median(r[mode] for r in rates) for mode in ("single", "shared")},
        **later,
        "cpu_ms_per_batch_median": {mode: by_role(mode) for mode in ("single", "shared")},
        "tensorsocket_cpu_ms_per_batch": [round(x, 2) for x in own],
        "tensorsocket_cpu_pct_of_loader_alone": median(
            100 * x / c["single"]["total"] for x, c in zip(own, cpu, strict=True)
        ),
        "exact": all(c["exact"] for r in runs for c in r["runs"]["shared"]),
    }
    return {
        "benchmark": "sharing-rounds",
        "date": runs[0]["date"],
        "machine": machine(),
        "config": {**runs[0]["config"], "rounds": count},
        "summary": summary,
        "rounds": [
            {"order": list(order), **{k: r[k] for k in ("per_trainer_samples_per_s", "cpu_ms_per_batch")}}
            for order, r in zip(orders, runs, strict=True)
        ],
    }


def where_cpu_went(trainers: list[dict[str, Any]], producers: list[dict[str, Any]]) -> dict[str, float]:
    """CPU ms per batch (user + system) of each role while the watching trainer ran: the
    trainers (consumers), the producer's own process, the DataLoader workers (under the
    producer, or under a trainer with its own loader), and the rest (the benchmark itself)."""
    watched = next((r for r in trainers if r.get("cpu_window")), None)
    if watched is None or not watched["samples"]:
        return {}
    window = {int(pid): row for pid, row in watched["cpu_window"].items()}
    trainer_pids = {r["pid"] for r in trainers}
    producer_pids = {r["pid"] for r in producers}
    owners = trainer_pids | producer_pids  # a DataLoader's workers are under one of these

    def under_an_owner(ppid: int) -> bool:
        # (its children, or further down: a worker started through a forkserver is the
        # server's child, and the server the owner's)
        while ppid not in owners and ppid in window:
            ppid = window[ppid][0]
        return ppid in owners

    roles = {"trainers": 0.0, "producer": 0.0, "loader_workers": 0.0, "other": 0.0}
    for pid, (ppid, user, system, children) in window.items():
        if pid in owners:
            roles["trainers" if pid in trainer_pids else "producer"] += user + system
            roles["loader_workers"] += children  # workers it waited for, gone
        elif under_an_owner(ppid):
            roles["loader_workers"] += user + system + children
        else:
            roles["other"] += user + system + children
    per_batch = 1000 / (watched["samples"] / 32)
    out = {role: round(seconds * per_batch, 2) for role, seconds in roles.items()}
    out["total"] = round(sum(roles.values()) * per_batch, 2)
    return out


def machine() -> dict[str, Any]:
    """The environment a benchmark ran in, for its JSON."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def write(result: dict[str, Any], name: str, tag: str | None = None, folder: Path | None = None) -> Path:
    """Write ``result`` to ``<folder>/<name>-<tag>-<date>.json`` (default: benchmarks/results and
    the host name); return the path."""
    folder = folder or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    day = result["date"][:10]
    path = folder / f"{name}-{tag or platform.node() or 'host'}-{day}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument(
        "--images",
        type=int,
        default=1024,
        help="32 batches per epoch: short epochs measure the drain at each epoch end",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    parser.add_argument(
        "--replay", type=int, default=None, help="the producer's replay budget in bytes (default: its own)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="over 1: the loader alone and shared, in turn, that many times; medians",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    common = {
        "trainers": args.trainers,
        "step_ms": args.step_ms,
        "images": args.images,
        "epochs": args.epochs,
        "workers": args.workers,
        "replay": args.replay,
    }
    if args.rounds > 1:
        result = rounds(args.rounds, **common)
        print(json.dumps(result["summary"], indent=2))
        if not args.no_write:
            tag = f"{platform.node() or 'host'}-rounds-{args.trainers}trainers"
            print("wrote", write(result, "sharing", tag=tag))
        return
    result = run(**common)
    print(json.dumps(result["per_trainer_samples_per_s"], indent=2))
    for mode, roles in result["cpu_ms_per_batch"].items():
        print(f"{mode}: machine CPU ms per batch, by role: {roles}")
    for r in result["runs"].get("shared", []):
        print(f"shared consumer exact={r['exact']} batches/epoch={r['batches_per_epoch']}")
    if not args.no_write:
        print("wrote", write(result, "sharing"))


if __name__ == "__main__":
    main()
