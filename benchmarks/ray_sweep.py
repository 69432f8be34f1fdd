"""A Ray Tune sweep on a 2-node local cluster: trials with their own DataLoaders vs per-node
tensorsocket producers (``tensorsocket.ray``).

Four trials, two per node (each node has two ``trial`` resources and each trial takes one),
read ``--epochs`` epochs of the JPEG pipeline of ``producer/imagefolder.py`` (Pillow decode,
random resized crop, flip, normalise; batch 32, 224x224) with a simulated training step of
``--step-ms`` (a sleep) per batch. Either each trial runs ``make_loader(num_workers=W)`` itself
(``own``), or each node runs one producer over the same ``make_loader(num_workers=W)`` and its
two trials read it (``shared``). Logical CPUs match: a node has ``2 (1 + W)``; an own-loader
trial takes ``1 + W``, a shared trial 1 and the producer ``1 + W``.

Measured per trial: samples/s from its first batch to its last, samples per epoch and a
checksum of the label sequence (a node's two shared trials must match). For the run: the CPU
seconds of every process of the cluster (trials, loader workers, producers, Ray's own) from
before the producers start to the end of ``tuner.fit()``, from ``psutil`` samples every 0.2 s (a process that exits between samples
loses at most that much).

Each configuration runs in a fresh cluster in a fresh network namespace (``unshare -n``;
Ray binds every interface by default):

    python3 -m benchmarks.ray_sweep        # writes benchmarks/results/ray_sweep-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = f"{ROOT / 'producer' / 'imagefolder.py'}:make_loader"
FLEET = "bench-sweep"


def trial(config: dict[str, Any]) -> None:
    """Read the epochs with a simulated step; report rate, samples per epoch, label checksum."""
    import ray
    import torch
    from ray import train, tune

    report = getattr(tune, "report", None) or train.report  # ray.tune.report from Ray 2.41 on

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    if config["shared"]:
        from tensorsocket.ray import consumer

        loader: Any = consumer(FLEET, timeout=60.0)
    else:
        from producer.imagefolder import make_loader

        loader = make_loader(config["root"], batch_size=32, num_workers=config["workers"])
    samples, start, per_epoch, checksum, startup_cpu = 0, None, [], 0, 0.0
    try:
        for _ in range(config["epochs"]):
            n = 0
            for images, labels in loader:
                if start is None:
                    start = time.perf_counter()  # start-up is not rate
                    startup_cpu = time.process_time()
                else:
                    samples += len(labels)
                n += len(labels)
                checksum = (checksum * 31 + int(labels.sum()) * 7 + len(labels)) % (1 << 61)
                assert images.shape[1:] == (3, 224, 224)
                del images, labels
                time.sleep(config["step_s"])
            per_epoch.append(n)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    elapsed = time.perf_counter() - (start or time.perf_counter())
    report(
        {
            "node": ray.get_runtime_context().get_node_id(),
            "samples_per_s": samples / elapsed if elapsed else 0.0,
            "seconds": elapsed,
            "samples_per_epoch": per_epoch,
            "checksum": checksum,
            "pid": os.getpid(),
            "startup_cpu_s": startup_cpu,
            "cpu_s": time.process_time(),
        }
    )


class CpuMeter:
    """CPU seconds of this process's descendants (the whole local cluster) between start and stop."""

    def __init__(self, every: float = 0.2) -> None:
        import psutil

        self.psutil, self.every = psutil, every
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, initial: bool) -> None:
        for p in self.psutil.Process().children(recursive=True):
            try:
                with p.oneshot():
                    t, name, parent = p.cpu_times(), " ".join(p.cmdline()[:1]) or p.name(), p.ppid()
            except self.psutil.Error:
                continue
            used = t.user + t.system
            if initial:
                self.first[p.pid] = used
            self.last[p.pid] = max(used, self.last.get(p.pid, 0.0))
            if not name.startswith("ray::IDLE") or p.pid not in self.names:
                self.names[p.pid] = name  # a worker's title names what it last ran
            self.parents[p.pid] = parent

    def _run(self) -> None:
        while not self.stop_event.wait(self.every):
            self._sample(False)

    def start(self) -> None:
        self._sample(True)
        self.thread.start()

    def stop(self) -> dict[str, float]:
        self._sample(False)
        self.stop_event.set()
        self.thread.join(5)
        by_kind: dict[str, float] = {}
        self.other: list[tuple[str, float]] = []
        for pid, used in self.last.items():
            kind = self._kind(pid)
            by_kind[kind] = by_kind.get(kind, 0.0) + used - self.first.get(pid, 0.0)
            if kind == "other" and used - self.first.get(pid, 0.0) > 0.5:
                self.other.append((self.names[pid][:80], round(used - self.first.get(pid, 0.0), 2)))
        return {k: round(v, 2) for k, v in sorted(by_kind.items())} | {
            "total": round(sum(by_kind.values()), 2)
        }

    def _kind(self, pid: int) -> str:
        """producers / trials (each with its loader's worker processes), ray (its own processes
        and idle workers), other."""
        seen = pid
        while seen in self.names:
            name = self.names[seen]
            if "NodeProducer" in name:
                return "producers"
            if "ImplicitFunc" in name:
                return "trials"
            seen = self.parents.get(seen, 0)
        name = self.names[pid]
        ray_own = (
            "raylet",
            "gcs_server",
            "ray::",
            "default_worker",
            "log_monitor",
            "monitor.py",
            "dashboard",
        )
        return "ray" if any(k in name for k in ray_own) else "other"


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in a fresh 2-node cluster (called inside the network namespace)."""
    import ray
    from ray import train, tune
    from ray.cluster_utils import Cluster

    import tensorsocket.ray as tsray

    shared = args.run == "shared"
    node_cpus = 2 * (1 + args.workers)
    tmp = tempfile.mkdtemp(prefix="tsb-")
    # Ray writes the cluster's address under $RAY_TMPDIR/ray whatever temp_dir says, and does
    # not make that folder (/tmp/ray is missing where Ray never ran): keep it in ours.
    os.environ["RAY_TMPDIR"] = tmp
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": node_cpus,
            "resources": {"trial": 2},
            "temp_dir": os.path.join(tmp, "ray"),
        },
    )
    cluster.add_node(num_cpus=node_cpus, resources={"trial": 2})
    result: dict[str, Any] = {"config": args.run}
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        cluster.wait_for_nodes()
        meter = CpuMeter()  # from before the producers start: their start-up counts too
        meter.start()
        fleet = (
            tsray.producers(
                PIPELINE,
                FLEET,
                args={"root": args.root, "num_workers": args.workers},
                cpus=1 + args.workers,
                min_consumers=2,
                grace=120,
                replay=0,
            )
            if shared
            else None
        )
        space = {
            "shared": shared,
            "root": args.root,
            "workers": args.workers,
            "epochs": args.epochs,
            "step_s": args.step_ms / 1000,
            "n": tune.grid_search(list(range(4))),
        }
        resources = {"cpu": 1 if shared else 1 + args.workers, "trial": 1}
        tuner = tune.Tuner(
            tune.with_resources(trial, resources),
            param_space=space,
            run_config=(getattr(tune, "RunConfig", None) or train.RunConfig)(
                storage_path=os.path.join(tmp, "tune"), name="bench", verbose=0
            ),
        )
        start = time.perf_counter()
        try:
            results = tuner.fit()
        finally:
            result["fit_s"] = round(time.perf_counter() - start, 2)
            result["cpu_s"] = meter.stop()
            result["cpu_other_processes"] = meter.other
            if fleet is not None:
                result["served"] = {
                    n[:16]: sorted(c["label"] for c in r["served"]) for n, r in fleet.status().items()
                }
                fleet.close()
                result["left"] = {n[:16]: c["left"] for n, c in fleet.cleanup.items()}
        result["trials"] = [
            {"error": None if r.error is None else str(r.error)[:500]}
            | {
                k: (r.metrics or {}).get(k)
                for k in (
                    "node",
                    "samples_per_s",
                    "seconds",
                    "samples_per_epoch",
                    "checksum",
                    "startup_cpu_s",
                    "cpu_s",
                )
            }
            for r in results
        ]
    finally:
        ray.shutdown()
        cluster.shutdown()
        subprocess.run(["rm", "-rf", tmp], timeout=60)
    return result


def summarize(run: dict[str, Any], images: int, epochs: int) -> dict[str, Any]:
    trials = run["trials"]
    rates = [t["samples_per_s"] for t in trials if t["samples_per_s"] is not None]
    exact = all(t["error"] is None and t["samples_per_epoch"] == [images] * epochs for t in trials)
    nodes = {t["node"] for t in trials}
    same = all(len({t["checksum"] for t in trials if t["node"] == n}) == 1 for n in nodes)
    return {
        "mean_samples_per_s_per_trial": round(sum(rates) / len(rates), 1) if rates else None,
        "samples_per_s": [round(r, 1) for r in rates],
        "cpu_s": run["cpu_s"],
        "fit_s": run["fit_s"],
        "trials_per_node": sorted(sum(t["node"] == n for t in trials) for n in nodes),
        "every_sample_each_epoch": exact,
        "same_stream_on_a_node": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per loader (default 1)")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--configs", default="own,shared")
    parser.add_argument("--tag", default=None, help="file name tag (default: the host name)")
    parser.add_argument("--run", choices=["own", "shared"], help=argparse.SUPPRESS)  # inside the namespace
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.run:
        Path(args.out).write_text(json.dumps(run_config(args)))
        return 0

    from benchmarks.sharing import machine, write
    from producer.imagefolder import make_dataset

    root = make_dataset(ROOT / "data" / f"jpeg-{args.images}", count=args.images)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TUNE_DISABLE_AUTO_CALLBACK_LOGGERS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    runs: dict[str, Any] = {}
    load_before = list(os.getloadavg())  # other work on the machine skews CPU-bound figures
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            inner = (
                f"ip link set lo up && exec {sys.executable} -m benchmarks.ray_sweep --run {config} "
                f"--root {root} --out {out} --epochs {args.epochs} --workers {args.workers} "
                f"--step-ms {args.step_ms}"
            )
            done = subprocess.run(
                ["unshare", "-n", "sh", "-c", inner],
                cwd=ROOT,
                env=env,
                timeout=600,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            runs[config] = json.loads(out.read_text())
        summary = summarize(runs[config], args.images, args.epochs)
        print(
            f"{config:>6}: {summary['mean_samples_per_s_per_trial']} samples/s per trial, "
            f"CPU {summary['cpu_s']['total']} s, exact: {summary['every_sample_each_epoch']}",
            flush=True,
        )
    result = {
        "benchmark": "ray_sweep",
        "date": datetime.now(timezone.utc).isoformat(),
        "command": ["python3", "-m", "benchmarks.ray_sweep", *sys.argv[1:]],
        "load_average_before_after": [load_before, list(os.getloadavg())],
        "machine": machine() | {"ray": __import__("ray").__version__},
        "config": {
            "nodes": 2,
            "trials": 4,
            "trials_per_node": 2,
            "images": args.images,
            "epochs": args.epochs,
            "batch_size": 32,
            "image_size": 224,
            "workers_per_loader": args.workers,
            "step_ms": args.step_ms,
        },
        "summary": {c: summarize(r, args.images, args.epochs) for c, r in runs.items()},
        "runs": runs,
    }
    print(f"wrote {write(result, 'ray_sweep', args.tag)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
