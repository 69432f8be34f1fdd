"""Groups benchmark: the ranks of 2 DDP-style jobs fed by one producer vs one DataLoader each.

One node, the JPEG pipeline of ``producer.imagefolder`` (Pillow decode, random resized crop,
flip, normalise; batch 32, 224x224), ``--jobs`` jobs of ``--ranks`` ranks each (2 x 2), every
rank a separate process taking a simulated training step of ``--step-ms`` (a sleep) per batch.
No torch.distributed: the ranks of a job do not all-reduce, each just iterates. Three ways, one
after the other, on the same machine and dataset:

* ``independent``: each rank has its own DataLoader (``--workers`` workers) over the dataset
  with ``DistributedSampler(num_replicas=ranks, rank=r, shuffle=True, seed=job)`` and calls
  ``set_epoch`` every epoch (the status quo);
* ``groups``: one tensorsocket producer (default settings) runs one shuffled DataLoader
  (``--workers`` workers) and every rank is ``Consumer(group=job, rank=r, world_size=ranks)``;
* ``groups-no-replay``: the same with ``Producer(replay=0)``: no buffer for late joiners (all
  ranks join before the first batch here), to show what the default replay budget costs.

Per rank: samples/s from its first batch to its last (as ``benchmarks.sharing``). Per way, over
the whole process tree of the run (ranks, producer, every DataLoader worker): total CPU
seconds, from ``getrusage(RUSAGE_CHILDREN)`` of this process before and after, with this
process a child subreaper that waits for every descendant (so orphaned workers count too),
and that total less each spawned process's CPU at its target's entry (interpreter start-up and
imports, ~2.3 s each here); peak PSS of all of them together (``/proc/<pid>/smaps_rollup``
summed every 0.2 s); the peak number of processes. The dataset yields each sample's index as
a third field, so every rank records its sample ids: per job and epoch its ranks' ids must be
disjoint and together the whole epoch (``--images`` a multiple of 32 x ranks; otherwise the
tail is padded and the repeats are counted), every rank the same number of batches, equal to
its ``len()``; in the groups ways rank r of every job must also get the same ids.

    python -m benchmarks.groups          # writes benchmarks/results/groups-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import threading
import time
import uuid
from datetime import datetime, timezone
from multiprocessing import resource_tracker
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.compare import _PR_SET_CHILD_SUBREAPER, _children_of, _memory_kib
from benchmarks.sharing import ROOT, _train, collect, machine, write
from producer.imagefolder import ImageFolderDataset, make_dataset, seed_worker

SPAWN = mp.get_context("spawn")
BATCH = 32
MODES = ("independent", "groups", "groups-no-replay")


class IndexedImages(ImageFolderDataset):
    """The JPEG dataset with each sample's index as a third field: ``(image, label, index)``."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image, label = super().__getitem__(index)
        return image, label, index


def make_loader(root: str, workers: int, shard: tuple[int, int] | None = None, seed: int = 0) -> DataLoader:
    """``producer.imagefolder.make_loader`` over :class:`IndexedImages`; ``shard=(ranks, rank)``
    reads that rank's ``DistributedSampler`` share instead of shuffling the whole dataset.

    Workers are forked, as by default on Linux (Python < 3.14) in a process started by torchrun
    or a shell, and as in ``benchmarks.compare``: in a process started by multiprocessing's
    spawn (ours) they would be spawned too, each importing torch again (~2.3 CPU s here)."""
    dataset = IndexedImages(root, train=True, seed=seed)
    sampler = None if shard is None else DistributedSampler(dataset, *shard, shuffle=True, seed=seed)
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=seed_worker if workers > 0 else None,
        multiprocessing_context="fork" if workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


def group_name(job: int) -> str:
    """``job-a``, ``job-b``, ...: the group of job ``job`` (0-based)."""
    return f"job-{chr(ord('a') + job)}"


class Recording:
    """Iterates ``batches`` epoch by epoch as ``(images, labels)``, keeping each epoch's sample
    ids in ``ids``; calls ``sampler.set_epoch`` at each epoch's start, as a training loop does.
    A class, not a generator: no suspended frame holds the last batch during the step."""

    def __init__(self, batches: Any, sampler: Any = None) -> None:
        self.batches, self.sampler = batches, sampler
        self.ids: list[list[int]] = []
        self._it: Any = None

    def __iter__(self) -> Recording:
        if self.sampler is not None:
            self.sampler.set_epoch(len(self.ids))
        self.ids.append([])
        self._it = iter(self.batches)
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, index = next(self._it)
        self.ids[-1] += index.tolist()
        return images, labels


def _cpu_s() -> float:
    """This process's CPU seconds so far; at a target's entry: interpreter start-up and imports."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank_report(
    report: dict[str, Any], job: int, rank: int, batches: Recording, length: int, startup: float
) -> dict[str, Any]:
    fields = {"role": "rank", "job": job, "rank": rank, "ids": batches.ids, "len": length}
    return report | fields | {"startup_cpu_s": startup, "done": time.time()}


def _own_loader_rank(
    root: str, job: int, rank: int, ranks: int, workers: int, epochs: int, step_s: float, out: Any
) -> None:
    startup = _cpu_s()
    torch.set_num_threads(1)
    loader = make_loader(root, workers, shard=(ranks, rank), seed=job)
    batches = Recording(loader, loader.sampler)
    out.put(_rank_report(_train(batches, epochs, step_s), job, rank, batches, len(loader), startup))


def _consumer_rank(name: str, job: int, rank: int, ranks: int, epochs: int, step_s: float, out: Any) -> None:
    from tensorsocket import Consumer

    startup = _cpu_s()
    torch.set_num_threads(1)
    with Consumer(name=name, group=group_name(job), rank=rank, world_size=ranks, timeout=60) as consumer:
        batches = Recording(consumer)
        report = _rank_report(_train(batches, epochs, step_s), job, rank, batches, len(consumer), startup)
    out.put(report)


def _producer(
    root: str, name: str, workers: int, epochs: int, consumers: int, replay: int | None, out: Any
) -> None:
    from tensorsocket import Producer

    startup = _cpu_s()
    torch.set_num_threads(1)
    producer = Producer(
        make_loader(root, workers), name=name, slots=8, min_consumers=consumers, replay=replay
    )
    cpu0 = time.process_time()
    producer.serve(epochs=epochs)
    status = producer.status()
    out.put(
        {
            "role": "producer",
            "replay_bytes": producer.replay,
            "startup_cpu_s": startup,
            "main_process_cpu_s": time.process_time() - cpu0,
            **{k: status[k] for k in ("published", "loader_wait", "publish_time", "slot_bytes")},
            "done": time.time(),
        }
    )


class TreeWatcher(threading.Thread):
    """Samples this process's descendants (less ``ignore``) every ``interval`` s: the peak of
    their summed PSS and the peak of their number."""

    def __init__(self, ignore: set[int], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.ignore, self.interval = ignore, interval
        self.peak_pss_kib = self.peak_processes = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            pids = [p for p in _children_of(os.getpid()) if p not in self.ignore]
            self.peak_processes = max(self.peak_processes, len(pids))
            self.peak_pss_kib = max(self.peak_pss_kib, sum(_memory_kib(p)[1] for p in pids))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _reap(ignore: set[int], deadline_s: float = 30.0) -> int:
    """Wait for every descendant not in ``ignore`` (orphans come to us: we are a subreaper), so
    their CPU time reaches RUSAGE_CHILDREN; SIGKILL what is left after ``deadline_s``. Returns
    how many had to be killed."""
    end, killed = time.monotonic() + deadline_s, 0
    while left := [p for p in _children_of(os.getpid()) if p not in ignore]:
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours (yet): its parent waits for it
                pass
        if time.monotonic() > end:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            end = time.monotonic() + deadline_s
        time.sleep(0.05)
    return killed


def _measure(targets: list[tuple[Any, tuple[Any, ...]]], timeout: float) -> dict[str, Any]:
    """Run every target in its own process (each puts one report on the queue it is given);
    return the reports and the whole tree's CPU seconds, peak PSS and peak process count."""
    ignore = set(_children_of(os.getpid()))  # multiprocessing's resource tracker
    load = os.getloadavg()[0]
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    watcher = TreeWatcher(ignore)
    watcher.start()
    started, since = time.perf_counter(), time.time()
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=t, args=(*args, out)) for t, args in targets]
    for p in procs:
        p.start()
    try:
        reports = collect(out, procs, len(procs), timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        killed = _reap(ignore)
        wall = time.perf_counter() - started
        watcher.stop()
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for r in reports:  # when (s after the run's start) each process had its first batch, was done
        done = r.pop("done") - since
        r["done_at_s"] = round(done, 2)
        if "seconds" in r:
            r["first_batch_at_s"] = round(done - r["seconds"], 2)
    return {
        "cpu_s": round(usage1.ru_utime - usage0.ru_utime + usage1.ru_stime - usage0.ru_stime, 2),
        "peak_pss_mib": round(watcher.peak_pss_kib / 1024, 1),
        "peak_processes": watcher.peak_processes,
        "wall_s": round(wall, 2),
        "load_1min_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
        "killed_at_end": killed,
        "exitcodes": [p.exitcode for p in procs],
        "reports": reports,
    }


def check(ranks_reports: list[dict[str, Any]], images: int, epochs: int, groups: bool) -> dict[str, Any]:
    """Per job and epoch: the ranks' ids disjoint and together the epoch; equal batch counts
    (and ``len()``) on every rank; with ``groups``, rank r of every job got the same ids."""
    by_job: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(ranks_reports, key=lambda r: (r["job"], r["rank"])):
        by_job.setdefault(r["job"], []).append(r)
    result: dict[str, Any] = {"disjoint": True, "covers": True, "equal_batches": True, "repeats": 0}
    for members in by_job.values():
        counts = {tuple(r["batches_per_epoch"]) for r in members} | {(r["len"],) * epochs for r in members}
        result["equal_batches"] &= len(counts) == 1 and all(len(r["ids"]) == epochs for r in members)
        for e in range(epochs):
            ids = [set(r["ids"][e]) for r in members]
            union = set().union(*ids)
            taken = sum(len(r["ids"][e]) for r in members)
            result["disjoint"] &= sum(map(len, ids)) == len(union) == taken
            result["covers"] &= union == set(range(images))
            result["repeats"] += taken - images
    if groups:  # one stream, one rule: rank r of every job gets the same share
        shares = {json.dumps([r["ids"] for r in members]) for members in by_job.values()}
        result["jobs_agree"] = len(shares) == 1
    result["exact"] = all(v for k, v in result.items() if k != "repeats")
    return result


def run(
    jobs: int = 2,
    ranks: int = 2,
    step_ms: float = 10.0,
    images: int = 1024,
    epochs: int = 4,
    workers: int = 2,
    modes: tuple[str, ...] = MODES,
    log: Any = print,
) -> dict[str, Any]:
    """Run the benchmark; return every figure (and what the run was) as a dict."""
    try:  # descendants whose parent died come to us, so their CPU time is counted
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log("note: could not become a subreaper; CPU time of orphaned loader workers may be missed")
    resource_tracker.ensure_running()  # now, so that it is no process of a measured run
    t0 = time.perf_counter()
    root = str(make_dataset(ROOT / "data" / f"jpeg-{images}", count=images))
    log(f"dataset: {images} JPEGs in {root} ({time.perf_counter() - t0:.1f} s)")
    step_s, timeout = step_ms / 1000, 600.0
    plan = [(j, r) for j in range(jobs) for r in range(ranks)]
    runs: dict[str, Any] = {}
    for mode in (m for m in MODES if m in modes):
        if mode == "independent":
            log(f"{mode}: {len(plan)} ranks, each its own DataLoader + DistributedSampler ...")
            targets = [(_own_loader_rank, (root, j, r, ranks, workers, epochs, step_s)) for j, r in plan]
        else:
            replay = 0 if mode == "groups-no-replay" else None  # None: the producer's default
            log(f"{mode}: one tensorsocket producer (replay={replay}), {jobs} groups of {ranks} ...")
            name = f"bench-groups-{uuid.uuid4().hex[:8]}"
            targets = [(_producer, (root, name, workers, epochs, len(plan), replay))]
            targets += [(_consumer_rank, (name, j, r, ranks, epochs, step_s)) for j, r in plan]
        runs[mode] = _measure(targets, timeout)
    env = machine() | {"cpus_used": len(os.sched_getaffinity(0)), "gpu": torch.cuda.is_available()}
    env["commit"] = _commit()
    return {
        "benchmark": "groups",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": env,
        "config": {
            "jobs": jobs,
            "ranks_per_job": ranks,
            "step_ms": step_ms,
            "images": images,
            "epochs": epochs,
            "batch_size": BATCH,
            "image_size": 224,
            "workers_per_loader": workers,
            "pss_sample_interval_s": 0.2,
        },
        "summary": summarise(runs, images, epochs),
        "runs": runs,
    }


def _commit() -> str | None:
    """HEAD of this checkout, with ``+dirty`` when tracked files differ from it; None without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def summarise(runs: dict[str, Any], images: int, epochs: int) -> dict[str, Any]:
    """Per mode: the checks (into ``runs``), per-rank rates and the tree's figures; then every
    groups mode over ``independent``. Drops the sample ids from ``runs``."""
    summary: dict[str, Any] = {}
    for mode, m in runs.items():
        members = sorted(
            (r for r in m["reports"] if r["role"] == "rank"), key=lambda r: (r["job"], r["rank"])
        )
        m["check"] = check(members, images, epochs, groups=mode != "independent")
        rates = {f"{group_name(r['job'])} r{r['rank']}": round(r["samples_per_s"], 1) for r in members}
        startup = sum(r["startup_cpu_s"] for r in m["reports"])
        summary[mode] = {
            "samples_per_s_per_rank": rates,
            "mean_samples_per_s_per_rank": round(sum(rates.values()) / len(rates), 1) if rates else None,
            "cpu_s": m["cpu_s"],
            "startup_cpu_s": round(startup, 2),
            "cpu_s_less_startup": round(m["cpu_s"] - startup, 2),
            **{k: m[k] for k in ("peak_pss_mib", "peak_processes", "wall_s")},
            "exact": m["check"]["exact"] and set(m["exitcodes"]) == {0} and not m["killed_at_end"],
        }
        for r in members:
            r.pop("ids")  # kept out of the JSON: only the checks on them matter
    base = summary.get("independent")
    for mode in [m for m in summary if m != "independent"] if base else []:
        a = summary[mode]
        keys = ("mean_samples_per_s_per_rank", "cpu_s", "cpu_s_less_startup", "peak_pss_mib")
        ratios = {k: round(a[k] / base[k], 2) if a[k] is not None and base[k] else None for k in keys}
        summary[f"{mode}_over_independent"] = ratios | {  # (None: a run too short to measure)
            "processes": f"{a['peak_processes']} vs {base['peak_processes']}"
        }
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict[str, Any]) -> str:
    """The summary as a readable table, with the ratios under it."""
    s = result["summary"]
    modes = [m for m in MODES if m in s]
    head = ["mode".ljust(16), *s[modes[0]]["samples_per_s_per_rank"], "mean samples/s"]
    head += ["CPU s", "less start-up", "peak PSS MiB", "processes", "wall s", "exact"]
    lines = [" | ".join(head)]
    for mode in modes:
        row = s[mode]
        cells = [f"{v:.1f}" for v in row["samples_per_s_per_rank"].values()]
        cells += [_fmt(row[k], ".1f") for k in ("mean_samples_per_s_per_rank", "cpu_s", "cpu_s_less_startup")]
        cells += [f"{row['peak_pss_mib']:.0f}", str(row["peak_processes"]), f"{row['wall_s']:.1f}"]
        lines.append(" | ".join([mode.ljust(16), *cells, "yes" if row["exact"] else "NO"]))
    for mode in modes[1:] if "independent" in s else []:
        r = s[f"{mode}_over_independent"]
        lines.append(
            f"{mode} / independent: per-rank samples/s {_fmt(r['mean_samples_per_s_per_rank'], '.2f')}x, "
            f"CPU s {_fmt(r['cpu_s'], '.2f')}x ({_fmt(r['cpu_s_less_startup'], '.2f')}x less start-up), "
            f"peak PSS {_fmt(r['peak_pss_mib'], '.2f')}x, processes {r['processes']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per job")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--images", type=int, default=1024, help="default: the dataset of benchmarks.sharing")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    parser.add_argument("--modes", default=",".join(MODES), help="a comma-separated subset of the default")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or not set(modes) <= set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    result = run(args.jobs, args.ranks, args.step_ms, args.images, args.epochs, args.workers, modes)
    print(table(result))
    for mode, m in result["runs"].items():
        print(f"{mode}: {json.dumps(m['check'])}; 1-min load before/after {m['load_1min_before_after']}")
    if not args.no_write:
        print("wrote", write(result, "groups"))


if __name__ == "__main__":
    main()
