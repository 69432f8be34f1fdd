"""Four trainers training ResNet-18 on one GPU: four private GPU decode pipelines vs one shared.

Issue 17's measurement. When the CPU cannot decode JPEGs fast enough even once, users decode
on the GPU (nvJPEG) and every trainer runs its own GPU pipeline: the decode N times, and its
memory N times. Three ways, one after the other, same dataset, same GPU, ``--cpus`` cores:

* ``private-gpu-pipelines``: each trainer with its own ``producer.imagefolder_gpu`` loader
  (file reads in ``--workers`` workers, decode and augment on its GPU): the status quo;
* ``shared-gpu-pipeline``: one tensorsocket producer running that pipeline once, batches
  handed to the trainers over the GPU path (``device="cuda:0"``, views of its GPU memory);
* ``shared-gpu-pipeline-hosted``: the same, the producer hosted in trainer 0's process (a
  thread there) instead of a process of its own: one CUDA context fewer, the pipeline's GPU work
  in that trainer's context;
* ``shared-cpu-pipeline``: one producer running the CPU Pillow pipeline
  (``producer.imagefolder``, ``--producer-workers`` workers), over the GPU path too.

The runs are ``benchmarks.compare``'s (its process roles, its checks that every trainer got
every batch once and, shared, the same batches, its CPU and memory accounting), given these
three as variants of its systems; with ``--model`` (default resnet18) also its model-alone
reference, what training allows with no loader at all. Reported per way: samples/s per
trainer (the median of ``--repeat`` runs), GPU memory (NVML: the device's peak over idle, and
each process's own peak summed over the processes), mean GPU utilisation (NVML, sampled every
0.5 s), and the ratios issue 17 sets targets for: the shared GPU pipeline at least 2x the
private ones per trainer, with less GPU memory.

    python3 -m benchmarks.gpu_decode [--out DIR]   # -> DIR/gpu_decode-<gpu>-<date>.json
    python3 -m benchmarks.gpu_decode --smoke       # end to end without a GPU: the CPU stand-in of
                                                   # the CUDA primitives, decode on the CPU, 64 images
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import compare
from producer.imagefolder_gpu import torchvision_problem

PRIVATE, SHARED_GPU, SHARED_CPU = "private-gpu-pipelines", "shared-gpu-pipeline", "shared-cpu-pipeline"
HOSTED = "shared-gpu-pipeline-hosted"
WAYS = (PRIVATE, SHARED_GPU, HOSTED, SHARED_CPU)
SHARED = {SHARED_GPU: "shared", HOSTED: "hosted"}  # the ways judged against the private ones, by prefix


def variants(decode_device: str, decoder: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The ways as ``benchmarks.compare`` variants: (its system, configuration)."""
    gpu = {"pipeline": "gpu", "decode_device": decode_device, "decoder": decoder}
    return {
        PRIVATE: ("independent", gpu),
        SHARED_GPU: (compare.GPU_SYSTEM, gpu),
        HOSTED: (compare.GPU_SYSTEM, gpu | {"hosted": True}),
        SHARED_CPU: (compare.GPU_SYSTEM, {"pipeline": "cpu"}),
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None


def summarise(runs: list[dict[str, Any]], fake: bool = False) -> dict[str, Any]:
    """Per way: the medians over its runs, and the ratios the issue sets targets for (not
    judged against its targets on the CPU stand-in, ``fake``, where no GPU did any work)."""
    ways: dict[str, Any] = {}
    for way in (*WAYS, compare.MODEL_ALONE, compare.LOADER_ALONE):
        group = [r for r in runs if r["system"] == way]
        if not group:
            continue
        process_mib = [
            sum(p["peak_gpu_mib"] for p in r.get("processes", []) if p.get("peak_gpu_mib") is not None)
            or None
            for r in group
        ]
        ways[way] = {
            "per_trainer_samples_per_s": _median([r.get("per_trainer_samples_per_s") for r in group]),
            "runs_samples_per_s": [r.get("per_trainer_samples_per_s") for r in group],
            "verdict": compare._group_verdict(group),
            "gpu_mib_device_peak_over_idle": _median([r.get("peak_gpu_mib_over_idle") for r in group]),
            "gpu_mib_processes_sum": _median(process_mib),
            "gpu_util_mean_pct": _median([r.get("gpu_util_mean_pct") for r in group]),
        }
    summary: dict[str, Any] = {"ways": ways}
    if fake:
        summary["note"] = "CPU stand-in of the CUDA primitives, decode on the CPU: no GPU was used"
    private = ways.get(PRIVATE, {})
    for way, prefix in SHARED.items():
        shared = ways.get(way, {})
        if private.get("per_trainer_samples_per_s") and shared.get("per_trainer_samples_per_s"):
            ratio = shared["per_trainer_samples_per_s"] / private["per_trainer_samples_per_s"]
            summary[f"{prefix}_vs_private_rate"] = round(ratio, 2)
            if not fake:
                summary[f"{prefix}_rate_target_met"] = ratio >= 2.0
        for key in ("gpu_mib_device_peak_over_idle", "gpu_mib_processes_sum"):
            if private.get(key) and shared.get(key):
                summary[f"{prefix}_vs_private_{key}"] = round(shared[key] / private[key], 2)
        memory = summary.get(f"{prefix}_vs_private_gpu_mib_device_peak_over_idle")
        if memory is not None and not fake:
            summary[f"{prefix}_memory_target_met"] = memory < 1.0
    return summary


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table."""
    lines = [
        "| way | samples/s per trainer | GPU MiB (device peak over idle) | GPU MiB (sum of processes) "
        "| GPU util % | every batch once |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.0f}"

    for way, w in summary["ways"].items():
        cells = [way, cell(w["per_trainer_samples_per_s"]), cell(w["gpu_mib_device_peak_over_idle"]),
                 cell(w["gpu_mib_processes_sum"]), cell(w["gpu_util_mean_pct"]), w["verdict"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for way, prefix in SHARED.items():
        if f"{prefix}_vs_private_rate" not in summary:
            continue
        judged = {True: "met", False: "not met"}
        rate = judged.get(summary.get(f"{prefix}_rate_target_met"), "not judged")
        memory = judged.get(summary.get(f"{prefix}_memory_target_met"), "not judged")
        lines.append(f"{way} vs the private pipelines: {summary[f'{prefix}_vs_private_rate']:.2f}x per trainer "
                     f"(target 2x: {rate}), GPU memory target (less): {memory}")  # fmt: skip
    if "note" in summary:
        lines.append(f"note: {summary['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=4, help="cores for every process of a run (default 4)")
    parser.add_argument(
        "--model", default="resnet18", help="torchvision model each trainer trains ('' for none)"
    )
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated step when --model is ''")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)} (default all)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="file-reading workers of each private pipeline"
    )
    parser.add_argument("--producer-workers", type=int, help="the producer's loader workers (default --cpus)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as stalled")
    parser.add_argument("--decode-device", default="cuda")
    parser.add_argument("--decoder", default="torchvision", choices=("torchvision", "pillow"))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that needs no GPU: 64 images, one repeat, a 5 ms simulated step, decode on "
        "the CPU, and the CPU stand-in of the CUDA primitives (TENSORSOCKET_FAKE_CUDA=1) without a GPU",
    )
    parser.add_argument("--tag", help="machine name in the file name (default: the GPU's model, or 'fake')")
    parser.add_argument("--out", type=Path, default=compare.RESULTS)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        import torch

        args.images, args.repeat, args.model, args.step_ms, args.decode_device = 64, 1, "", 5.0, "cpu"
        args.decoder = "torchvision" if torchvision_problem() is None else "pillow"
        args.cpus = min(args.cpus, len(os.sched_getaffinity(0)))
        if not torch.cuda.is_available():
            os.environ[compare.FAKE_CUDA] = "1"  # inherited by every process of the runs
            print(f"smoke: no GPU, so {compare.FAKE_CUDA}=1 (the CPU stand-in); decoder {args.decoder}")
    ways = tuple(w for w in args.ways.split(",") if w)
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or not ways:
        parser.error(f"--ways takes {', '.join(WAYS)}; got {args.ways!r}")
    if not 1 <= args.cpus <= len(os.sched_getaffinity(0)):
        parser.error(f"--cpus must be between 1 and {len(os.sched_getaffinity(0))}, got {args.cpus}")

    def progress(partial: dict[str, Any]) -> None:  # the JSON so far, in case we are stopped
        if not args.no_write:
            write(partial | {"summary": summarise(partial["runs"], partial["config"]["fake_cuda"])}, args)

    result = compare.run(
        (args.trainers,), ways, args.step_ms, args.images, args.epochs, args.workers, args.timeout, args.cpus,
        model=args.model or None, repeat=args.repeat, progress=progress,
        producer_workers=args.producer_workers, variants=variants(args.decode_device, args.decoder),
    )  # fmt: skip
    command = ["python3", "-m", "benchmarks.gpu_decode", *(sys.argv[1:] if argv is None else argv)]
    result |= {"benchmark": "gpu_decode", "command": " ".join(command)}
    result["summary"] = summarise(result["runs"], result["config"]["fake_cuda"])
    print()
    print(table(result["summary"]))
    if not args.no_write:
        print("wrote", write(result, args))


def write(result: dict[str, Any], args: argparse.Namespace) -> Path:
    tag = args.tag or ("fake" if result["config"]["fake_cuda"] and not result["machine"]["gpu"] else None)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_decode-{compare.result_stem(result, tag)}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


if __name__ == "__main__":
    main()
