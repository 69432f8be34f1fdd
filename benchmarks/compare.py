"""N trainers on one machine: N independent DataLoaders vs tensorsocket vs PyPI tensorsocket 0.0.5.

One invocation runs every system at every N (default 1, 2, 4, 8) on the same machine, the
same dataset and the same pipeline (``producer.imagefolder``: Pillow JPEG decode, random
resized crop, flip, normalise; batch 32, 224x224), one run after the other. Each independent
trainer's DataLoader has ``--workers`` loader processes; the one shared loader, that of a
shared system's producer and of the loader-alone reference, has ``--producer-workers`` (by
default ``--cpus`` when given, else ``--workers``: one loader may use every core that N
independent ones share):

* ``independent``: N trainers, each with its own DataLoader (the status quo);
* ``tensorsocket``: this repository; one producer runs the DataLoader, N consumers (host
  shared memory; on a GPU machine each trainer then copies each batch to the GPU);
* ``tensorsocket-gpu``: the same with the batches kept in GPU memory: ``Producer(device=
  "cuda:0")``, trainers ``Consumer(device="cuda:0")`` (zero-copy views of the producer's GPU
  memory). Needs a CUDA GPU (or ``TENSORSOCKET_FAKE_CUDA=1``, the CPU stand-in); elsewhere it
  is reported as not run, with the reason;
* ``tensorsocket-0.0.5``: the PyPI package, installed by this script into its own virtual
  environment (``data/upstream-tensorsocket-0.0.5``), which sees the same torch as this one
  through a ``.pth`` file, so both packages run on one torch build.

Each trainer simulates a training step of ``--step-ms`` (a sleep: the CPU stays free for
loading; on a GPU machine each batch is also copied to the GPU first), or with ``--model``
trains a torchvision model (e.g. ``resnet18``) on each batch, on the GPU when there is one. Two
reference runs bound what the systems can get: ``loader-alone`` (once: one shared loader
drained with no training step) and, with ``--model``, ``model-alone`` at every N (N trainers
training the model on one synthetic batch kept on the GPU, as many steps as the others, no
loader: the summary's ``model_ceiling``, what the GPU, or the CPU without one, allows). For
every run it records per-trainer samples/s (from each trainer's first batch to its last), the
CPU seconds of every process of the run (loader workers included: this process is their subreaper),
the peak memory of all of them together (RSS, and PSS, which counts shared pages once), the
GPU memory in use when nvidia-ml-py is there, and whether every trainer got every batch of
every epoch exactly once (shared systems: the same batches, in the same order, in every
trainer). A run that is not done after ``--timeout`` seconds is killed and reported as
stalled, with what each trainer had got by then. ``--repeat K`` runs every (system, N) K
times (round-robin, so drift hits every system alike); every run is kept in the JSON and the
summary quotes the median.

    python -m benchmarks.compare            # or: bash scripts/bench.sh
    # -> benchmarks/results/<machine>-<date>.json and .png, and a table for the README
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.sharing import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROLES = ROOT / "benchmarks" / "compare_roles.py"
SYSTEMS = ("independent", "tensorsocket", "tensorsocket-gpu", "tensorsocket-0.0.5")
UPSTREAM = "tensorsocket-0.0.5"
GPU_SYSTEM = "tensorsocket-gpu"
GPU_DEVICE = "cuda:0"
FAKE_CUDA = "TENSORSOCKET_FAKE_CUDA"  # "1": tensorsocket's CPU stand-in for the CUDA primitives
LOADER_ALONE = "loader-alone"  # one DataLoader drained with no training step: the pipeline's own rate
MODEL_ALONE = "model-alone"  # N trainers on one synthetic batch, no loader: what training allows
BATCH = 32
_PR_SET_CHILD_SUBREAPER = 36


# --------------------------------------------------------------------------- the upstream environment


def upstream_env() -> dict[str, str]:
    """This environment, less any PYTHONPATH entry holding another ``tensorsocket`` package
    (the repository's, say), which would otherwise shadow the one in 0.0.5's environment."""
    env = dict(os.environ)
    keep = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not Path(p, "tensorsocket").is_dir()
    ]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    return env


def upstream_python(venv: Path, wheels: Path | None = None, log: Any = print) -> tuple[Path | None, str]:
    """Create (once) a virtual environment holding PyPI tensorsocket 0.0.5; return its Python.

    The environment gets only ``tensorsocket==0.0.5`` and ``tornado`` (its one dependency that
    this environment lacks); a ``.pth`` file puts this environment's site-packages after its
    own, so torch, pyzmq, NumPy and Pillow are the very same builds for all three systems, and
    a CUDA torch is never downloaded again. ``wheels``: install from that folder, offline.
    The environment is made without pip (``--without-pip``: a Python without ``ensurepip``,
    as Debian's and Ubuntu's are without python3-venv, can still make it); this Python's own
    pip installs the two packages into its site-packages.
    Returns ``(None, why)`` when it cannot be set up: the table then says so.
    """
    python = venv / "bin" / "python"
    probe = "import tensorsocket, zmq, tornado, torch; print(tensorsocket.__version__, tensorsocket.__file__)"

    def check() -> str | None:
        done = subprocess.run(
            [str(python), "-c", probe], cwd=venv, capture_output=True, text=True, env=upstream_env()
        )
        words = done.stdout.split()
        if done.returncode == 0 and words[:1] == ["0.0.5"] and Path(words[1]).is_relative_to(venv):
            return None
        return (done.stderr.strip().splitlines() or [done.stdout.strip()])[-1]

    if python.exists() and check() is None:
        return python, "reused"
    log(f"installing PyPI tensorsocket 0.0.5 into {venv} ...")
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True
        )
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
        Path(site, "zz-host-environment.pth").write_text("\n".join(ours) + "\n")
        source = ["--no-index", "--find-links", str(wheels)] if wheels else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-compile",
                "--target",
                site,
                *source,
                "tensorsocket==0.0.5",
                "tornado>=6",
            ],
            check=True,
            capture_output=True,
            text=True,
            env=upstream_env() | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    except subprocess.CalledProcessError as exc:
        return None, f"could not install it: {(exc.stderr or '').strip().splitlines()[-1:]}"
    problem = check()
    return (None, f"installed but does not import: {problem}") if problem else (python, "installed")


# --------------------------------------------------------------------------- watching a run's processes


def _children_of(root: int) -> list[int]:
    """Every live descendant of ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; zeros if it is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, pss


class Watcher(threading.Thread):
    """Samples the total memory of this process's descendants until stopped, and with NVML the
    GPU's: memory in use, each descendant's own (by pid), and utilisation (percent of the
    sample period a kernel ran)."""

    def __init__(self, interval: float = 0.5, memory_cap_kib: int | None = None) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.memory_cap_kib = memory_cap_kib
        self.peak_rss_kib = self.peak_pss_kib = 0
        self.over_cap = False
        self.gpu_base_mib: float | None = None
        self.peak_gpu_mib: float | None = None
        self.peak_gpu_pid_mib: dict[int, float] = {}
        self.gpu_util: list[int] = []
        self._halt = threading.Event()
        self._gpu = _nvml_handle()
        if self._gpu is not None:
            self.gpu_base_mib = self._gpu_used()

    def _gpu_used(self) -> float:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(self._gpu).used / 2**20

    def _sample_gpu(self, pids: list[int]) -> None:
        import pynvml

        self.peak_gpu_mib = max(self.peak_gpu_mib or 0.0, self._gpu_used())
        self.gpu_util.append(pynvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
        ours = set(pids)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(self._gpu):
            if proc.pid in ours and proc.usedGpuMemory is not None:
                mib = round(proc.usedGpuMemory / 2**20, 1)
                self.peak_gpu_pid_mib[proc.pid] = max(self.peak_gpu_pid_mib.get(proc.pid, 0.0), mib)

    def run(self) -> None:
        me = os.getpid()
        while not self._halt.wait(self.interval):
            rss = pss = 0
            pids = _children_of(me)
            for pid in pids:
                r, p = _memory_kib(pid)
                rss, pss = rss + r, pss + p
            self.peak_rss_kib = max(self.peak_rss_kib, rss)
            self.peak_pss_kib = max(self.peak_pss_kib, pss)
            if self.memory_cap_kib and pss > self.memory_cap_kib:
                self.over_cap = True
            if self._gpu is not None:
                self._sample_gpu(pids)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _nvml_handle() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no nvidia-ml-py, no driver or no GPU: no GPU figures
        return None


def _free_port_block(count: int = 4) -> int:
    """A first port such that ``count`` consecutive ports are free now."""
    for _ in range(200):
        base = 20000 + int.from_bytes(os.urandom(2), "big") % 30000
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports found")


# --------------------------------------------------------------------------- one run


def _launch(
    python: Path | str, role: str, report: Path, log: Path, extra: list[str], cwd: Path
) -> subprocess.Popen:
    command = [str(python), str(ROLES), role, "--report", str(report), *extra]
    env = upstream_env() if role.startswith("up-") else None
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _reap_orphans(deadline_s: float = 10.0) -> None:
    """Wait for descendants re-parented to us (we are their subreaper) so their CPU time counts."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > end:
                for left in _children_of(os.getpid()):
                    try:
                        os.kill(left, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                end = time.monotonic() + deadline_s
            time.sleep(0.05)


def run_once(
    system: str, trainers: int, cfg: dict[str, Any], upstream: Path | None, rundir: Path
) -> dict[str, Any]:
    """Run one system with ``trainers`` trainers; return its figures."""
    rundir.mkdir(parents=True, exist_ok=True)
    workers = cfg["workers"] if system == "independent" else cfg["producer_workers"]  # one shared loader
    common = ["--data", cfg["data"], "--workers", str(workers), "--epochs", str(cfg["epochs"])]
    step_ms = 0 if system == LOADER_ALONE else cfg["step_ms"]
    common += ["--step-ms", str(step_ms), "--trainers", str(trainers)]
    if cfg.get("pipeline", "cpu") == "gpu":  # producer.imagefolder_gpu: decode and augment on a GPU
        common += ["--pipeline", "gpu", "--decode-device", cfg["decode_device"], "--decoder", cfg["decoder"]]
    if cfg["model"] and system != LOADER_ALONE:
        common += ["--model", cfg["model"]]
    python: Path | str = sys.executable
    extra: list[str] = []
    if system in ("independent", LOADER_ALONE):
        plan = [("loader-trainer", i) for i in range(trainers)]
    elif system == MODEL_ALONE:
        plan = [("synthetic-trainer", i) for i in range(trainers)]
        extra = ["--images", str(cfg["images"])]
    elif system in ("tensorsocket", GPU_SYSTEM):
        plan = [("ts-producer", None)] + [("ts-trainer", i) for i in range(trainers)]
        if cfg.get("hosted"):  # the producer in trainer 0's process, not one of its own
            plan = [("ts-hosting-trainer", 0)] + plan[2:]
        extra = ["--name", f"compare-{uuid.uuid4().hex[:8]}"]
        if system == GPU_SYSTEM:
            extra += ["--device", GPU_DEVICE]
    else:
        assert upstream is not None
        python = upstream
        plan = [("up-producer", None)] + [("up-trainer", i) for i in range(trainers)]
        extra = [
            "--port",
            str(_free_port_block()),
            "--producer-batch-size",
            str(cfg["upstream_producer_batch_size"]),
        ]
    cwd = rundir  # outside the package tree, so a local tensorsocket/ never shadows the installed one
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    watcher = Watcher(memory_cap_kib=cfg["memory_cap_kib"])
    watcher.start()
    started = time.perf_counter()
    procs, reports = [], []
    for role, rank in plan:
        name = role if rank is None else f"{role}-{rank}"
        report = rundir / f"{name}.json"
        reports.append(report)
        args = [*common, *extra] + ([] if rank is None else ["--rank", str(rank)])
        procs.append(_launch(python, role, report, rundir / f"{name}.log", args, cwd))
    stalled = over_cap = False
    deadline = started + cfg["timeout"]
    while any(p.poll() is None for p in procs):
        if time.perf_counter() > deadline:
            stalled = True
            break
        if watcher.over_cap:
            over_cap = True
            break
        time.sleep(0.1)
    wall = time.perf_counter() - started
    _kill(procs)
    for p in procs:
        p.wait()
    _reap_orphans()
    watcher.stop()
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)

    loaded = []
    for (role, rank), path, proc in zip(plan, reports, procs, strict=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {"complete": False}
        data.update(role=role, rank=rank, returncode=proc.returncode, log=str(rundir / f"{path.stem}.log"))
        loaded.append(data)
    return _judge(system, trainers, cfg, loaded, stalled, over_cap, wall, cpu, watcher)


def _judge(
    system: str,
    trainers: int,
    cfg: dict[str, Any],
    reports: list[dict[str, Any]],
    stalled: bool,
    over_cap: bool,
    wall: float,
    cpu: float,
    watcher: Watcher,
) -> dict[str, Any]:
    """Turn the processes' reports into one run's figures and verdicts."""
    expected_batches = math.ceil(cfg["images"] / BATCH)
    epochs = cfg["epochs"]
    trainer_reports = [r for r in reports if r["role"].endswith("trainer")]
    problems: list[str] = []
    if stalled:
        problems.append(f"stalled: not done after {cfg['timeout']:.0f} s, killed")
    if over_cap:
        problems.append(f"stopped: its processes used more than {cfg['memory_cap_kib'] // 2**20} GiB")
    for r in reports:
        killed_by_us = r["returncode"] == -signal.SIGKILL and (stalled or over_cap)
        if r["returncode"] != 0 and not killed_by_us:
            who = r["role"] if r["rank"] is None else f"{r['role']} {r['rank']}"
            problems.append(f"{who} exited with {r['returncode']} (log: {r['log']})")
    delivered = [sum(r.get("samples_per_epoch", [])) for r in trainer_reports]
    # A trainer that finished: samples/s from its first batch to its last. One that did not:
    # what it got over the whole time it was given, so a stall counts against the rate.
    rates = [
        r.get("samples_per_s", 0.0) if r.get("complete") else got / wall
        for r, got in zip(trainer_reports, delivered, strict=True)
    ]
    exact = True
    for r in trainer_reports:
        batches = r.get("batches_per_epoch", [])
        if not r.get("complete") or batches != [expected_batches] * epochs:
            exact = False
        if r.get("samples_per_epoch") != [cfg["images"]] * epochs:
            exact = False
        for prints in r.get("fingerprints", []) if system != MODEL_ALONE else []:  # one batch, again
            if len(set(prints)) != len(prints):
                exact = False
                problems.append(f"trainer {r['rank']} got a batch twice in one epoch")
                break
    if system not in ("independent", MODEL_ALONE) and trainer_reports:
        sequences = {json.dumps(r.get("fingerprints")) for r in trainer_reports}
        if len(sequences) > 1:
            exact = False
            problems.append("trainers of one shared run did not get the same batches")
    if not exact and delivered and max(delivered) < cfg["images"] * epochs and not (stalled or over_cap):
        problems.append(
            f"delivered {min(delivered)}-{max(delivered)} of {cfg['images'] * epochs} samples per trainer"
        )
    for r in trainer_reports:
        r.pop("fingerprints", None)  # kept out of the JSON: only their agreement matters
    for r in reports:
        r["peak_gpu_mib"] = watcher.peak_gpu_pid_mib.get(r.get("pid", -1))
    return {
        "system": system,
        "trainers": trainers,
        "per_trainer_samples_per_s": round(sum(rates) / len(rates), 1) if rates else 0.0,
        "min_trainer_samples_per_s": round(min(rates), 1) if rates else 0.0,
        "exact": exact and not problems,
        "stalled": stalled,
        "problems": problems,
        "delivered_samples_per_trainer": delivered,
        "expected_samples_per_trainer": cfg["images"] * epochs,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "peak_rss_mib": round(watcher.peak_rss_kib / 1024, 1),
        "peak_pss_mib": round(watcher.peak_pss_kib / 1024, 1),
        "peak_gpu_mib_over_idle": (
            None
            if watcher.peak_gpu_mib is None
            else round(watcher.peak_gpu_mib - (watcher.gpu_base_mib or 0), 1)
        ),
        "gpu_util_mean_pct": round(statistics.mean(watcher.gpu_util), 1) if watcher.gpu_util else None,
        "processes": reports,
    }


# --------------------------------------------------------------------------- the whole benchmark


def run(
    counts: tuple[int, ...] = (1, 2, 4, 8),
    systems: tuple[str, ...] = SYSTEMS,
    step_ms: float = 10.0,
    images: int = 1024,
    epochs: int = 2,
    workers: int = 2,
    timeout: float = 180.0,
    cpus: int | None = None,
    upstream_venv: Path | None = None,
    upstream_wheels: Path | None = None,
    upstream_producer_batch_size: int = 2,
    model: str | None = None,
    log: Any = print,
    repeat: int = 1,
    progress: Any = None,
    producer_workers: int | None = None,
    variants: dict[str, tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Run every system at every count, ``repeat`` times (round-robin); return every figure and
    the environment as a dict. ``progress``, if given, is called with the result so far (marked
    ``"partial": true``) after every run, so a benchmark stopped from outside leaves what it did.
    ``producer_workers``: the one shared loader's workers (default: ``cpus`` if given, else
    ``workers``). ``variants``: more systems for other benchmarks to name in ``systems``, each
    ``label: (one of SYSTEMS, configuration overrides)``, e.g. ``{"shared-gpu-pipeline":
    ("tensorsocket-gpu", {"pipeline": "gpu", "decode_device": "cuda", "decoder": "torchvision"})}``;
    their runs carry the label as ``system`` (the summary here lists SYSTEMS only)."""
    variants = variants or {}
    bases = {variants.get(s, (s, {}))[0] for s in systems}
    from producer.imagefolder import make_dataset

    try:  # descendants whose parent was killed come to us, so their CPU time is counted
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log("note: could not become a subreaper; CPU time of orphaned loader workers may be missed")
    if cpus:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cpus])  # every process inherits it
    data = ROOT / "data" / f"jpeg-{images}"
    root = str(make_dataset(data, count=images))
    upstream, upstream_note = None, "not asked for"
    if UPSTREAM in bases:
        upstream, upstream_note = upstream_python(
            upstream_venv or ROOT / "data" / "upstream-tensorsocket-0.0.5", upstream_wheels, log
        )
        log(f"PyPI tensorsocket 0.0.5: {upstream_note}")
    gpu_missing = gpu_unavailable() if GPU_SYSTEM in bases else None
    if gpu_missing:
        log(f"{GPU_SYSTEM}: not run: {gpu_missing}")
    avail_kib = _available_kib()
    cfg = {
        "data": root,
        "images": images,
        "epochs": epochs,
        "workers": workers,
        "producer_workers": producer_workers if producer_workers is not None else cpus or workers,
        "step_ms": step_ms,
        "timeout": timeout,
        "upstream_producer_batch_size": upstream_producer_batch_size,
        "model": model,
        "memory_cap_kib": int(avail_kib * 0.8) if avail_kib else None,
    }
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    runs: list[dict[str, Any]] = []
    env = machine()
    env["cpus_used"] = len(os.sched_getaffinity(0))
    env["gpu"] = gpu_name()

    def whole(partial: bool) -> dict[str, Any]:
        return {
            "benchmark": "compare",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": env,
            "config": {k: v for k, v in cfg.items() if k != "data"}
            | {
                "batch_size": BATCH,
                "image_size": 224,
                "counts": list(counts),
                "upstream": upstream_note,
                "systems": list(systems),
                "repeat": repeat,
                "gpu_path": gpu_missing or "run",
                "fake_cuda": os.environ.get(FAKE_CUDA) == "1",
                **({"variants": variants} if variants else {}),
            },
            **({"partial": True} if partial else {}),
            "summary": summarise(runs),
            "runs": runs,
        }

    references = (MODEL_ALONE,) if model else ()  # the model's own rate at every N
    plan = [(LOADER_ALONE, 1)] + [(system, n) for n in counts for system in references + systems]
    for rep in range(repeat):
        for system, n in plan:
            base, overrides = variants.get(system, (system, {}))
            if base == UPSTREAM and upstream is None:
                runs.append(_not_run(system, n, upstream_note) | _rep(rep, repeat))
                continue
            if base == GPU_SYSTEM and gpu_missing:
                runs.append(_not_run(system, n, gpu_missing) | _rep(rep, repeat))
                continue
            what = f"{n} trainer(s)" if system != LOADER_ALONE else "the pipeline's own rate"
            what += ", the model alone on one synthetic batch" if system == MODEL_ALONE else ""
            log(f"{system}: {what}{f' (run {rep + 1} of {repeat})' if repeat > 1 else ''} ...")
            folder = f"{system}-{n}" + (f"-run{rep + 1}" if repeat > 1 else "")
            rundir = ROOT / "data" / "compare-runs" / stamp / folder
            result = run_once(base, n, cfg | overrides, upstream, rundir) | {"system": system}
            result |= _rep(rep, repeat)
            runs.append(result)
            outcome = "exact" if result["exact"] else "; ".join(result["problems"]) or "not exact"
            log(
                f"  {result['per_trainer_samples_per_s']:8.1f} samples/s per trainer, "
                f"cpu {result['cpu_s']:.1f} s, wall {result['wall_s']:.1f} s, "
                f"peak PSS {result['peak_pss_mib']:.0f} MiB: {outcome}"
            )
            if progress is not None:
                progress(whole(partial=True))
    return whole(partial=False)


def gpu_unavailable() -> str | None:
    """Why ``tensorsocket-gpu`` cannot run here, or None when it can (a CUDA GPU, or the CPU
    stand-in selected by ``TENSORSOCKET_FAKE_CUDA=1``)."""
    if os.environ.get(FAKE_CUDA) == "1":
        return None
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (
            f"no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is False); "
            f"{FAKE_CUDA}=1 runs it on the CPU stand-in"
        )
    return None


def _rep(rep: int, repeat: int) -> dict[str, Any]:
    return {"run": rep + 1, "of": repeat} if repeat > 1 else {}


def _not_run(system: str, n: int, why: str) -> dict[str, Any]:
    return {"system": system, "trainers": n, "per_trainer_samples_per_s": None, "exact": False,
            "stalled": False, "problems": [f"not run: {why}"]}  # fmt: skip


def _available_kib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def verdict(run: dict[str, Any]) -> str:
    """One word or phrase for a run's table cell: exact, or what went wrong."""
    if run["exact"]:
        return "exact"
    got = run.get("delivered_samples_per_trainer") or []
    share = f", {min(got)}/{run['expected_samples_per_trainer']} samples" if got else ""
    if run.get("stalled"):
        return f"stalled{share}"
    if any(p.startswith("stopped:") for p in run["problems"]):
        return f"out of memory{share}"
    if any(p.startswith("not run") for p in run["problems"]):
        return "not run"
    return f"not exact{share}"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None


def _group_verdict(group: list[dict[str, Any]]) -> str:
    """The verdict of one (system, N) over its repeats: exact only if every run was."""
    verdicts = [verdict(r) for r in group]
    bad = [v for v in verdicts if v != "exact"]
    if not bad or len(group) == 1:
        return verdicts[0]
    if len(bad) == len(group) and len(set(bad)) == 1:
        return bad[0]
    return f"{bad[0]}; {len(bad)} of {len(group)} runs"


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trainer count: each system's per-trainer rate (the median over its repeats,
    every repeat's rate beside it) and the ratios the README quotes."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["system"], r["trainers"]), []).append(r)
    alone = _median([r.get("per_trainer_samples_per_s") for r in by.get((LOADER_ALONE, 1), [])])
    rows = []
    for n in sorted({r["trainers"] for r in runs if r["system"] in SYSTEMS}):
        row: dict[str, Any] = {"trainers": n}
        for system in SYSTEMS:
            group = by.get((system, n))
            if group:
                row[system] = _median([r.get("per_trainer_samples_per_s") for r in group])
                row[f"{system}_ok"] = _group_verdict(group)
                if len(group) > 1:
                    row[f"{system}_runs"] = [r.get("per_trainer_samples_per_s") for r in group]
        model = by.get((MODEL_ALONE, n))
        if model:  # what N trainers get with no loader at all: the GPU's bound at this N
            row["model_ceiling"] = _median([r.get("per_trainer_samples_per_s") for r in model])
            row["model_ceiling_ok"] = _group_verdict(model)
        ours, independent, gpu = row.get("tensorsocket"), row.get("independent"), row.get(GPU_SYSTEM)
        if ours and independent:
            row["vs_independent"] = round(ours / independent, 2)
        stalled = any(r.get("stalled") for r in by.get((UPSTREAM, n), []))
        if ours and row.get(UPSTREAM) and not stalled:  # no ratio to a stall
            row["vs_0.0.5"] = round(ours / row[UPSTREAM], 2)
        if ours and alone:
            row["gap_to_loader_pct"] = round(100 * (1 - ours / alone), 1)
        if gpu and independent:
            row["gpu_vs_independent"] = round(gpu / independent, 2)
        if gpu and ours:
            row["gpu_vs_host_path"] = round(gpu / ours, 2)
        if gpu and alone:
            row["gpu_gap_to_loader_pct"] = round(100 * (1 - gpu / alone), 1)
        rows.append(row)
    return rows


def table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table (what the README shows). The GPU path's columns appear
    when it was asked for, the model alone's when there was one (``--model``)."""
    gpu = any(GPU_SYSTEM in row for row in result["summary"])
    model = any("model_ceiling" in row for row in result["summary"])
    head = "| trainers | independent DataLoaders | tensorsocket |"
    head += " tensorsocket, GPU path |" if gpu else ""
    head += " PyPI tensorsocket 0.0.5 |"
    head += " the model alone, no loader (the bound) |" if model else ""
    head += " vs independent | vs 0.0.5 | gap to the loader alone |"
    head += " GPU path vs independent | GPU path vs host path |" if gpu else ""
    lines = [head, "| ---: |" + " ---: |" * (head.count("|") - 2)]
    repeat = result.get("config", {}).get("repeat", 1)
    if repeat > 1:
        lines.insert(0, f"Samples/s per trainer: the median of {repeat} runs each.\n")

    def cell(row: dict[str, Any], system: str) -> str:
        rate = row.get(system)
        ok = row.get(f"{system}_ok", "")
        text = "not run" if rate is None else f"{rate:.0f}"
        return text if ok in ("exact", "") or rate is None else f"{text} ({ok})"

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}x" if key in row else ""

    for row in result["summary"]:
        versus = ratio(row, "vs_0.0.5")
        if not versus and row.get(f"{UPSTREAM}_ok", "").startswith("stalled"):
            versus = "(0.0.5 stalled)"
        gap = f"{row['gap_to_loader_pct']:.1f}%" if "gap_to_loader_pct" in row else ""
        cells = [str(row["trainers"]), cell(row, "independent"), cell(row, "tensorsocket")]
        cells += [cell(row, GPU_SYSTEM)] if gpu else []
        cells += [cell(row, UPSTREAM)] + ([cell(row, "model_ceiling")] if model else [])
        cells += [ratio(row, "vs_independent"), versus, gap]
        cells += [ratio(row, "gpu_vs_independent"), ratio(row, "gpu_vs_host_path")] if gpu else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resources_table(result: dict[str, Any]) -> str:
    """Every run's rate, CPU time, memory and verdict as a Markdown table."""
    gpu = any(r.get("peak_gpu_mib_over_idle") is not None for r in result["runs"])
    head = (
        "| trainers | system | samples/s per trainer | CPU s (all processes) | peak RSS MiB | peak PSS MiB |"
    )
    head += " GPU MiB |" if gpu else ""
    lines = [head + " wall s | every batch once |", "| ---: | --- |" + " ---: |" * (5 + gpu) + " --- |"]
    shown_not_run = set()
    for r in result["runs"]:
        system = r["system"] + (f" (run {r['run']})" if "run" in r else "")
        if r.get("per_trainer_samples_per_s") is None:
            if (r["system"], r["trainers"]) in shown_not_run:
                continue  # the same reason for every repeat
            shown_not_run.add((r["system"], r["trainers"]))
            why = "; ".join(r["problems"]) if verdict(r) == "not run" else verdict(r)
            lines.append(f"| {r['trainers']} | {r['system']} |" + " |" * (5 + gpu) + f" {why} |")
            continue
        cells = [f"{r['per_trainer_samples_per_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['peak_rss_mib']:.0f}",
                 f"{r['peak_pss_mib']:.0f}"]  # fmt: skip
        if gpu:
            cells.append("" if r["peak_gpu_mib_over_idle"] is None else f"{r['peak_gpu_mib_over_idle']:.0f}")
        cells += [f"{r['wall_s']:.1f}", "yes" if r["exact"] else verdict(r)]
        lines.append(f"| {r['trainers']} | {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Per-trainer samples/s against N for each system; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    counts = [row["trainers"] for row in result["summary"]]
    for system, style in zip(SYSTEMS, ("s-", "o-", "D-", "^-"), strict=True):
        points = [
            (row["trainers"], row.get(system)) for row in result["summary"] if row.get(system) is not None
        ]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=system)
        for row in result["summary"]:
            if row.get(system) is not None and row.get(f"{system}_ok") != "exact":
                ax.annotate(row[f"{system}_ok"].replace(" samples", "").replace("not exact, ", "got "),
                            (row["trainers"], row[system]), textcoords="offset points", xytext=(4, 6),
                            fontsize=8)  # fmt: skip
    alone = _median(
        [r.get("per_trainer_samples_per_s") for r in result["runs"] if r["system"] == LOADER_ALONE]
    )
    if alone:
        ax.axhline(
            alone, linestyle="--", color="grey", linewidth=1, label="the loader alone, no training step"
        )
    model = [(row["trainers"], row["model_ceiling"]) for row in result["summary"] if row.get("model_ceiling")]
    if model:
        ax.plot([p[0] for p in model], [p[1] for p in model], "x:", color="black", linewidth=1,
                label="the model alone, no loader")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("trainers (N)")
    ax.set_ylabel("samples/s per trainer")
    env = result["machine"]
    where = env.get("gpu") or f"{env['cpus_used']} CPU cores, no GPU"
    cfg = result["config"]
    step = f"{cfg['model']} training" if cfg.get("model") else f"{cfg['step_ms']:g} ms step"
    ax.set_title(f"JPEG pipeline, batch {cfg['batch_size']}, {step}; {where}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def result_stem(result: dict[str, Any], tag: str | None) -> str:
    gpu = result["machine"].get("gpu")
    name = tag or ("-".join(gpu.lower().split()[1:2]) if gpu else None) or platform.node() or "host"
    return f"{name}-{result['date'][:10]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trainers", default="1,2,4,8", help="comma-separated trainer counts (default 1,2,4,8)"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated training step per batch")
    parser.add_argument(
        "--model",
        help="train this torchvision model (e.g. resnet18; needs torchvision) instead of --step-ms; "
        "adds the model-alone reference run at every N",
    )
    parser.add_argument("--images", type=int, default=1024, help="images per epoch (32 batches of 32)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes of each independent trainer's DataLoader"
    )
    parser.add_argument(
        "--producer-workers",
        type=int,
        help="worker processes of the one shared loader: the producers' (tensorsocket, tensorsocket-gpu, "
        "0.0.5) and the loader-alone reference's (default: --cpus when given, else --workers)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as stalled")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every (system, N) this many times; the summary quotes the median",
    )
    parser.add_argument("--cpus", type=int, help="run everything on this many CPU cores (default: all)")
    parser.add_argument("--upstream-venv", type=Path, help="where to put tensorsocket 0.0.5's environment")
    parser.add_argument(
        "--upstream-wheels", type=Path, help="install 0.0.5 and tornado from this folder, offline"
    )
    parser.add_argument(
        "--upstream-producer-batch-size",
        type=int,
        default=2,
        help="loader batches tensorsocket 0.0.5 sends as one group (default 2: its own default, 8, "
        "runs out of memory with 224x224 batches and 1 crashes it)",
    )
    parser.add_argument("--tag", help="machine name in the result files (default: GPU model or host name)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the result files")
    parser.add_argument("--no-write", action="store_true", help="print only; write no result files")
    parser.add_argument(
        "--show",
        type=Path,
        help="run nothing: recompute the summary of this result JSON from its runs, print its tables, redraw its plot",
    )
    args = parser.parse_args(argv)
    if args.show:
        result = json.loads(args.show.read_text())
        result["summary"] = summarise(result["runs"])  # derived: follows this code's rules
        print(table(result), resources_table(result), sep="\n\n")
        png = plot(result, args.show.with_suffix(".png"))
        print("plot:", png or "not drawn (matplotlib is not installed)")
        if not args.no_write:
            args.show.write_text(json.dumps(result, indent=2) + "\n")
        return
    try:
        counts = tuple(int(c) for c in args.trainers.split(","))
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--trainers must be positive integers separated by commas, got {args.trainers!r}")
    systems = tuple(s.strip() for s in args.systems.split(","))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.repeat < 1:
        parser.error(f"--repeat must be a positive integer, got {args.repeat}")
    if args.cpus is not None and not 1 <= args.cpus <= len(os.sched_getaffinity(0)):
        parser.error(f"--cpus must be between 1 and {len(os.sched_getaffinity(0))}, got {args.cpus}")
    for option, value in (("--workers", args.workers), ("--producer-workers", args.producer_workers)):
        if value is not None and value < 0:
            parser.error(f"{option} must be 0 or more, got {value}")

    def progress(partial: dict[str, Any]) -> None:  # the JSON so far, in case we are stopped
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{result_stem(partial, args.tag)}.json").write_text(json.dumps(partial, indent=2) + "\n")

    result = run(
        counts, systems, args.step_ms, args.images, args.epochs, args.workers, args.timeout, args.cpus,
        args.upstream_venv, args.upstream_wheels, args.upstream_producer_batch_size, args.model,
        repeat=args.repeat, progress=None if args.no_write else progress, producer_workers=args.producer_workers,
    )  # fmt: skip
    print()
    print(table(result))
    print()
    print(resources_table(result))
    if args.no_write:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result, args.tag)
    path = args.out / f"{stem}.json"
    png = plot(result, args.out / f"{stem}.png")
    result["plot"] = png.name if png else "not drawn: matplotlib is not installed (pip install matplotlib)"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", path, "and", png or "no plot (matplotlib is not installed)")


if __name__ == "__main__":
    main()
