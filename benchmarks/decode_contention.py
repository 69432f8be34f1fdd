"""Why a shared GPU decode pipeline slows down beside training (issue 17): the pipeline's own
rate alone, beside trainers on other cores (they share only the GPU with it), and beside the
same trainers on its own cores (they share the GPU and the CPU, as in ``benchmarks.gpu_decode``).

``benchmarks.gpu_decode`` measured on an H200 that the producer's GPU pipeline waited 2.4-2.6 s
for 32 batches while 4 ResNet-18 trainers trained beside it, where alone it makes a batch every
12 ms. This tells the two causes apart: a pipeline that keeps its rate beside trainers on
other cores and loses it on shared ones is short of CPU; one that loses it either way is
short of the GPU (time-sliced between the processes' CUDA contexts).

    python3 -m benchmarks.decode_contention            # on a GPU machine with 2 x --cores cores
    python3 -m benchmarks.decode_contention --smoke    # no GPU: decode on the CPU, sleeping trainers

The pipeline runs as ``python3 -m producer.imagefolder_gpu`` (a batch counts once the GPU has
finished it); its CPU time is that process's and its workers'. Writes
``benchmarks/results/decode_contention-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import compare
from benchmarks.sharing import machine
from producer.imagefolder import make_dataset

_RATE = re.compile(r"num_workers=\d+, threads=\d+:\s+([\d.]+) samples/s \((\d+) samples")


def _started(command: list[str], cores: list[int], **popen: Any) -> subprocess.Popen:
    """``command`` in a session of its own, moved onto ``cores`` as it starts (a preexec_fn is
    unsafe in a parent with threads); its children, forked later, inherit them."""
    proc = subprocess.Popen(command, start_new_session=True, **popen)
    os.sched_setaffinity(proc.pid, cores)
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill every process group first, then reap: one slow to die leaves none running."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(30)


def start_trainers(args: argparse.Namespace, cores: list[int], folder: Path) -> list[subprocess.Popen]:
    """``args.trainers`` model-alone trainers (``benchmarks.compare_roles``) on ``cores``, each
    with an epoch long enough to outlast the measurement; stderr into ``folder``."""
    command = [sys.executable, "-m", "benchmarks.compare_roles", "synthetic-trainer", "--epochs", "1",
               "--images", "10000000", "--step-ms", str(args.step_ms), "--model", args.model]  # fmt: skip
    procs = []
    for rank in range(args.trainers):
        with open(folder / f"trainer-{rank}.err", "w") as err:
            procs.append(_started(
                [*command, "--rank", str(rank), "--report", str(folder / f"trainer-{rank}.json")],
                cores, stdout=subprocess.DEVNULL, stderr=err,
            ))  # fmt: skip
    return procs


def _trainer_rates(folder: Path) -> list[float]:
    rates = []
    for path in sorted(folder.glob("trainer-*.json")):
        with contextlib.suppress(ValueError):  # (caught mid-write)
            rates.append(float(json.loads(path.read_text()).get("samples_per_s") or 0.0))
    return rates


def wait_until_training(args: argparse.Namespace, procs: list[subprocess.Popen], folder: Path) -> float:
    """Seconds until every trainer reported a rate (it has trained past its first batch), at
    most ``args.warmup``; a trainer that died or never got there is an error, with its stderr."""
    start = time.monotonic()
    while time.monotonic() - start < args.warmup:
        rates = _trainer_rates(folder)
        if any(p.poll() is not None for p in procs):
            break
        if len(rates) == len(procs) and all(r > 0 for r in rates):
            return round(time.monotonic() - start, 1)
        time.sleep(0.2)
    tails = {rank: (folder / f"trainer-{rank}.err").read_text()[-800:] for rank in range(len(procs))}
    raise RuntimeError(f"trainers not all training after {args.warmup} s (exit codes "
                       f"{[p.poll() for p in procs]}): {tails}")  # fmt: skip


def pipeline_rate(args: argparse.Namespace, cores: list[int], root: Path) -> dict[str, Any]:
    """The GPU pipeline's samples/s and CPU seconds per 1000 samples, on ``cores``."""
    command = [sys.executable, "-m", "producer.imagefolder_gpu", "--root", str(root), "--count", str(args.count),
               "--seconds", str(args.seconds), "--workers", str(args.workers), "--device", args.device,
               "--decoder", args.decoder, "--threads", str(args.threads)]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = _started(command, cores, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=args.seconds + 120)
    finally:
        _stop([proc])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = _RATE.search(out or "")
    if proc.returncode or match is None:
        raise RuntimeError(f"the pipeline failed ({proc.returncode}): {(out or '')[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rate, samples = float(match.group(1)), int(match.group(2))
    return {"samples_per_s": rate, "samples": samples, "cpu_s": round(cpu, 2),
            "cpu_ms_per_batch_of_32_startup_included": round(1000 * cpu / max(samples, 1) * 32, 1)}  # fmt: skip


def condition(
    args: argparse.Namespace, name: str, mine: list[int], theirs: list[int] | None, root: Path
) -> dict:
    """One measurement: the pipeline on ``mine``, trainers on ``theirs`` (None: no trainers)."""
    with tempfile.TemporaryDirectory(prefix="ts-contention-") as tmp:
        trainers = [] if theirs is None else start_trainers(args, theirs, Path(tmp))
        try:
            warmup = wait_until_training(args, trainers, Path(tmp)) if trainers else 0.0
            result = pipeline_rate(args, mine, root)
            result["trainers_alive_after"] = sum(p.poll() is None for p in trainers)
            result["trainer_samples_per_s"] = [round(r, 1) for r in _trainer_rates(Path(tmp))]
            result["trainers_training_after_s"] = warmup
        finally:
            _stop(trainers)
    result |= {"condition": name, "pipeline_cores": mine, "trainer_cores": theirs}
    print(f"{name:>34}: {result['samples_per_s']:7.1f} samples/s, "
          f"{result['cpu_ms_per_batch_of_32_startup_included']:6.1f} ms CPU a batch of 32 (start-up included)", flush=True)  # fmt: skip
    return result


def _siblings(cores: list[int]) -> dict[int, str]:
    """Each core's hyperthread siblings: "other cores" that share physical ones share more."""
    found = {}
    for core in cores:
        path = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list")
        found[core] = path.read_text().strip() if path.exists() else "unknown"
    return found


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, ``--smoke``'s applied; too few cores here is a usage error."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", type=int, default=4, help="cores of the pipeline, and of the trainers")
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument(
        "--model", default="resnet18", help="torchvision model each trainer trains ('' for none)"
    )
    parser.add_argument("--step-ms", type=float, default=10.0, help="a sleeping trainer's step (--model '')")
    parser.add_argument("--workers", type=int, default=4, help="the pipeline's file-reading workers")
    parser.add_argument("--threads", type=int, default=1, help="the pipeline's batches made at once")
    parser.add_argument("--count", type=int, default=512, help="images in the dataset")
    parser.add_argument("--seconds", type=float, default=12.0, help="each measurement")
    parser.add_argument(
        "--warmup",
        type=float,
        default=90.0,
        help="at most this many seconds for the trainers to start training",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decoder", default="torchvision", choices=("torchvision", "pillow"))
    parser.add_argument("--smoke", action="store_true", help="no GPU: decode on the CPU, trainers sleep")
    parser.add_argument("--tag", help="machine name in the file name (default: the GPU's model)")
    parser.add_argument("--out", type=Path, default=compare.RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.decoder, args.model, args.cores, args.trainers = "cpu", "pillow", "", 1, 1
        args.count, args.seconds, args.workers = 64, 2.0, 1
    available = len(os.sched_getaffinity(0))
    if available < 2 * args.cores:
        parser.error(f"--cores {args.cores} needs {2 * args.cores} cores here, {available} are available")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    available = sorted(os.sched_getaffinity(0))
    mine, others = available[: args.cores], available[args.cores : 2 * args.cores]

    with tempfile.TemporaryDirectory(prefix="ts-imagefolder-") as tmp:
        root = make_dataset(Path(tmp), count=args.count)
        runs = [
            condition(args, "alone", mine, None, root),
            condition(args, "trainers on other cores (GPU shared)", mine, others, root),
            condition(args, "trainers on its cores (GPU and CPU)", mine, mine, root),
        ]
    alone = runs[0]["samples_per_s"]
    result = {
        "benchmark": "decode_contention",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | {"gpu": compare.gpu_name(), "thread_siblings": _siblings(mine + others)},
        "command": " ".join(
            ["python3", "-m", "benchmarks.decode_contention", *(sys.argv[1:] if argv is None else argv)]
        ),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"smoke": args.smoke},
        "runs": runs,
        "vs_alone": {r["condition"]: round(r["samples_per_s"] / alone, 2) for r in runs},
    }
    print("vs alone:", result["vs_alone"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = (
        args.out
        / f"decode_contention-{compare.result_stem(result, args.tag or ('smoke' if args.smoke else None))}.json"
    )
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
