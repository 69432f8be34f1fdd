"""The GPU path's costs, next to the host path's, in one run: ``Producer(device="cuda:0")``
keeps each batch in GPU memory and ``Consumer(device="cuda:0")`` yields views of it.

* ``next()`` latency: time inside a consumer's ``next()`` after a simulated training step
  (long enough that the producer is ahead), warm-up excluded, for each batch size (default
  1 MiB and 256 MiB), GPU path and host path (``device="cpu"`` on both sides). Target for
  the GPU path: p50 <= 100 us, the same for every size (views, no copy). Next to it, the
  floor: a bare tensor view timed after the same sleep in the same process (on the H100 VM
  anything timed right after a sleep costs ~80-90 us, so the floor says what is ours).
* Publish latency: the producer's time per batch from having the loader's batch to its
  BATCH message being sent, waiting for a free slot excluded (``status()``:
  ``(publish_time - slot_wait) / published``, over the batches after the first ``2 x slots``,
  once every place exists), next to a pinned host-to-device copy of the same bytes measured in
  the same run (``torch.empty(n, pin_memory=True).to("cuda", non_blocking=True)`` and a
  synchronize; p50) and the host path's publish time. Target: <= 1.2 x that copy + 0.5 ms.
  Also the producer process's CPU time per batch (``time.process_time()``, every thread),
  GPU path vs host path.
* GPU memory: a consumer's own (nvidia-ml-py, ``nvmlDeviceGetComputeRunningProcesses``, its
  pid) with a bare CUDA context, then after 10, 500 and 1000 batches of 64 MiB; target: at
  most 64 MiB over the bare context, flat. The producer's likewise (its context + places).

The loader yields a few synthetic batches (``producer.synthetic``) over and over, made once,
so it costs nothing per batch and the consumer can check every batch's bytes. With
``TENSORSOCKET_FAKE_CUDA=1`` (tensorsocket's CPU stand-in for the CUDA primitives) it runs end
to end on a machine without a GPU, the JSON labelled ``fake``; what needs a real GPU (the
pinned copy, NVML) is skipped and named in ``skipped``, never estimated.

    python3 -m benchmarks.gpu_path [--out DIR]
    # -> benchmarks/results/gpu_path-<h100|h200|fake>-<date>.json (or DIR/...)
    TENSORSOCKET_FAKE_CUDA=1 python3 -m benchmarks.gpu_path --sizes-mib 1,4 --batches 30 \\
        --memory-mib 4 --memory-checkpoints 10,30,60
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.overhead import _percentiles
from benchmarks.sharing import RESULTS, SPAWN, machine, write
from producer.synthetic import make_loader, verify_batch

FAKE = "TENSORSOCKET_FAKE_CUDA"
GPU = "cuda:0"
BATCH_SIZE = 32
SLOTS = 8


# --------------------------------------------------------------------------- where we are


def mode() -> tuple[str, str | None]:
    """("real", None) with a CUDA GPU; ("fake", why) with the CPU stand-in; ("none", why) else."""
    if os.environ.get(FAKE) == "1":
        return "fake", f"{FAKE}=1: CUDA primitives are tensorsocket's CPU stand-in, no GPU is used"
    if torch.cuda.is_available():
        return "real", None
    return "none", (
        f"no CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False) and {FAKE} "
        "is not 1: the GPU path was not run"
    )


def _nvml_device() -> Any:
    """NVML's handle of torch's device 0 (matched by UUID when torch gives one)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid_ = str(torch.cuda.get_device_properties(0).uuid)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            found = pynvml.nvmlDeviceGetUUID(handle)
            if (found.decode() if isinstance(found, bytes) else found).removeprefix("GPU-") == uuid_:
                return handle
    except Exception:
        pass
    return pynvml.nvmlDeviceGetHandleByIndex(0)


def gpu_memory(pid: int | None = None) -> dict[str, Any]:
    """GPU memory this pid uses (MiB, from NVML's compute processes; None if NVML does not list
    it) and the device's used memory, on a real GPU only."""
    import pynvml

    pid = os.getpid() if pid is None else pid
    handle = _nvml_device()
    mine = None
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid and proc.usedGpuMemory is not None:
            mine = round(proc.usedGpuMemory / 2**20, 1)
    return {"pid_mib": mine, "device_used_mib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20, 1)}


def _bare_context() -> dict[str, Any]:
    torch.cuda.init()
    torch.zeros(1, device=GPU)
    torch.cuda.synchronize()
    return gpu_memory()


# --------------------------------------------------------------------------- the two processes


class Cycle:
    """Re-iterable loader: ``batches`` batches per epoch, batch ``i`` being synthetic batch
    ``i % distinct`` (``producer.synthetic``), made once, so it costs nothing per batch."""

    def __init__(self, batch_bytes: int, batches: int, distinct: int = 4, pinned: bool = False) -> None:
        self.batches = batches
        self.made = list(make_loader(batch_bytes, BATCH_SIZE, min(distinct, batches)))
        if pinned:
            self.made = [tuple(t.pin_memory() for t in batch) for batch in self.made]

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        return (self.made[i % len(self.made)] for i in range(self.batches))


def _producer_stats(status: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    keys = ("published", "loader_wait", "slot_wait", "publish_time")
    return {k: status.get(k) for k in keys} | {"cpu_s": cpu_s}


def _produce(spec: dict[str, Any], out: Any) -> None:
    """Serve one epoch of ``spec["batches"]`` batches; report timings, CPU and GPU memory."""
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        torch.set_num_threads(1)
        real = spec["real"] and spec["device"] != "cpu"
        if real:
            report["gpu_bare_context"] = _bare_context()
        loader = Cycle(spec["batch_bytes"], spec["batches"], spec["distinct"], spec["pinned"])
        from tensorsocket import Producer

        checkpoints = set(spec["checkpoints"])
        steady_from = min(2 * SLOTS, spec["batches"] // 2)
        with Producer(
            loader, name=spec["name"], device=spec["device"], slots=SLOTS, replay=0, linger=30
        ) as p:
            cpu0 = time.process_time()
            for i, _ in enumerate(p, 1):
                if i == steady_from:
                    report["at_steady"] = _producer_stats(p.status(), time.process_time() - cpu0)
                if real and i in checkpoints:
                    report.setdefault("gpu_after", {})[str(i)] = gpu_memory()
            report["at_end"] = _producer_stats(p.status(), time.process_time() - cpu0)
            if real:
                report["gpu_end"] = gpu_memory()
    except BaseException as exc:  # reported, not raised: the other side must not wait for it
        report["error"] = f"{type(exc).__name__}: {exc}"
    out.put(report)


def _consume(spec: dict[str, Any], out: Any) -> None:
    """Take one epoch; time ``next()`` after each simulated step; check the bytes now and then."""
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        torch.set_num_threads(1)
        real = spec["real"] and spec["device"] != "cpu"
        if real:
            report["gpu_bare_context"] = _bare_context()
        from tensorsocket import Consumer

        step_s, warmup, every = spec["step_s"], spec["warmup"], spec["verify_every"]
        checkpoints = set(spec["checkpoints"])
        times: list[float] = []

        def check(batch: Any, index: int) -> None:
            verify_batch(batch, index % spec["distinct"], spec["batch_bytes"], BATCH_SIZE)

        with Consumer(name=spec["name"], device=spec["device"], timeout=60) as consumer:
            it = iter(consumer)
            first = next(it)  # start-up is not latency
            report["yielded_on"] = str(first[0].device)
            check(first, 0)
            del first
            received = 1
            for index in range(1, spec["batches"]):
                if step_s:
                    time.sleep(step_s)
                t0 = time.perf_counter()
                batch = next(it)
                elapsed = time.perf_counter() - t0
                received += 1
                if index >= warmup:  # the first pass over the places maps or opens them
                    times.append(elapsed)
                if every and index % every == 0:  # outside the timed region
                    check(batch, index)
                del batch
                if real and received in checkpoints:
                    report.setdefault("gpu_after", {})[str(received)] = gpu_memory()
            report["extra_batches"] = sum(1 for _ in it)  # the epoch's end; 0 expected
            if step_s:  # the floor: a bare tensor view after the same sleep, same process
                bare, floor = torch.zeros(8), []
                for _ in range(min(40, len(times)) or 1):
                    time.sleep(step_s)
                    t0 = time.perf_counter()
                    bare[:1]
                    floor.append(time.perf_counter() - t0)
                report["floor"] = _percentiles(floor)
        report["received"] = received
        report["next"] = _percentiles(times) if times else None
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    out.put(report)


def pair(spec: dict[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a producer and a consumer process on ``spec``; return their reports. A side that
    fails or says nothing within ``timeout`` seconds is reported with an ``error``; when the
    producer fails the consumer is stopped at once."""
    spec = spec | {"name": f"gpu-path-{uuid.uuid4().hex[:8]}"}
    queues = {"producer": SPAWN.Queue(), "consumer": SPAWN.Queue()}
    procs = {
        "producer": SPAWN.Process(target=_produce, args=(spec, queues["producer"])),
        "consumer": SPAWN.Process(target=_consume, args=(spec, queues["consumer"])),
    }
    for p in procs.values():
        p.start()
    reports: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < 2 and time.monotonic() < deadline:
        for who, q in queues.items():
            if who not in reports:
                try:
                    reports[who] = q.get(timeout=0.05)
                except queue.Empty:
                    if not procs[who].is_alive() and q.empty():
                        reports[who] = {"error": f"{who} exited with {procs[who].exitcode} without a report"}
        if "error" in reports.get("producer", {}) and "consumer" not in reports:
            reports["consumer"] = {"error": "stopped: the producer failed"}
    for who in queues:
        reports.setdefault(who, {"error": f"{who}: no report within {timeout:.0f} s, killed"})
    for p in procs.values():
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    return reports["producer"], reports["consumer"]


# --------------------------------------------------------------------------- figures


def _per_batch_ms(report: dict[str, Any]) -> dict[str, Any] | None:
    """Steady-state publish latency and CPU per batch, from the producer's two snapshots."""
    end, steady = report.get("at_end"), report.get("at_steady")
    if not end or not end.get("published"):
        return None
    start = steady or {
        "published": 0,
        "slot_wait": 0.0,
        "publish_time": 0.0,
        "loader_wait": 0.0,
        "cpu_s": 0.0,
    }
    n = end["published"] - start["published"]
    if n <= 0 or end.get("publish_time") is None or end.get("slot_wait") is None:
        return None

    def per(key: str) -> float:
        return round((end[key] - start[key]) / n * 1e3, 3)

    publish = ((end["publish_time"] - start["publish_time"]) - (end["slot_wait"] - start["slot_wait"])) / n
    return {
        "batches": n,
        "publish_ms": round(publish * 1e3, 3),
        "slot_wait_ms": per("slot_wait"),
        "loader_wait_ms": per("loader_wait"),
        "producer_cpu_ms": per("cpu_s"),
        "steady_state": steady is not None,
    }


def pinned_h2d(nbytes: int, repeats: int) -> dict[str, Any]:
    """p50/p99 (us) of a pinned host-to-device copy of ``nbytes``, and of the same from pageable
    memory staged through a pinned buffer (what a loader batch that is not pinned costs)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pinned, staged = [], []
    for i in range(repeats + 3):  # 3 warm-ups
        t0 = time.perf_counter()
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        if i >= 3:
            pinned.append(time.perf_counter() - t0)
        del dev
        t0 = time.perf_counter()
        host.copy_(pageable)
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        if i >= 3:
            staged.append(time.perf_counter() - t0)
        del dev
    return {"pinned": _percentiles(pinned), "pageable_staged_through_pinned": _percentiles(staged)}


def _label(kind: str) -> str:
    if kind == "fake":
        return "fake"
    if kind == "none":
        return "cpu"
    words = torch.cuda.get_device_name(0).split()
    return (words[1] if len(words) > 1 else words[0]).lower()


def _environment(kind: str) -> dict[str, Any]:
    env = machine()
    env["torch_cuda"] = torch.version.cuda
    if kind == "real":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            env["cuda_driver_api"] = pynvml.nvmlSystemGetCudaDriverVersion()
        except Exception as exc:
            env["driver"] = f"unknown ({type(exc).__name__}: {exc})"
    else:
        env["gpu"] = None
    return env


def _delta(after: dict[str, Any] | None, bare: dict[str, Any] | None) -> float | None:
    if not after or not bare or after.get("pid_mib") is None or bare.get("pid_mib") is None:
        return None
    return round(after["pid_mib"] - bare["pid_mib"], 1)


def run(
    sizes_mib: tuple[float, ...] = (1, 256),
    batches: int = 80,
    step_ms: float = 30.0,
    step_ms_per_mib: float = 0.5,
    warmup: int = 2 * SLOTS,
    memory_mib: float = 64,
    memory_checkpoints: tuple[int, ...] = (10, 500, 1000),
    h2d_repeats: int = 40,
    pinned: bool = False,
    timeout: float = 300.0,
    log: Any = print,
) -> dict[str, Any]:
    kind, why = mode()
    real = kind == "real"
    paths = {"gpu": GPU, "host": "cpu"} if kind != "none" else {"host": "cpu"}
    skipped: dict[str, str] = {}
    if not real:
        reason = why or ""
        skipped["pinned_h2d_reference"] = f"needs a real GPU; {reason}"
        skipped["gpu_memory"] = f"NVML needs a real GPU; {reason}"
        skipped["targets"] = f"judged on a real GPU only; {reason}"
        if pinned:  # (pin_memory() needs a CUDA driver: the stand-in has none)
            skipped["loader_batches_pinned"] = f"pinning needs a real GPU; {reason}"
            pinned = False
    if kind == "none":
        skipped["gpu_path"] = why or ""
    errors: list[str] = []
    result: dict[str, Any] = {
        "benchmark": "gpu_path",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.gpu_path", *sys.argv[1:]],
        "mode": kind,
        "machine": _environment(kind),
        "config": {
            "sizes_mib": list(sizes_mib),
            "batches": batches,
            "step_ms": step_ms,
            "step_ms_per_mib": step_ms_per_mib,
            "step_rule": "each size's step: max(step_ms, step_ms_per_mib x MiB), so the producer is ahead",
            "warmup_batches_excluded": warmup,
            "slots": SLOTS,
            "replay": 0,
            "batch": f"(uint8 ({BATCH_SIZE}, bytes/{BATCH_SIZE}), int64 ({BATCH_SIZE},)), synthetic",
            "loader_batches_pinned": pinned,
            "memory_mib": memory_mib,
            "memory_checkpoints": list(memory_checkpoints),
            "env": {FAKE: os.environ.get(FAKE)},
            "publish_definition": "(publish_time - slot_wait) / published from Producer.status(), between its "
            "snapshot after 2 x slots batches (every place exists) and the epoch's end; producer_cpu_ms: "
            "time.process_time() of the producer process (every thread) over the same batches",
            "targets": {
                "next_p50_us": "<= 100, the same for every size (GPU path)",
                "publish_ms": "<= 1.2 x pinned host-to-device copy p50 + 0.5 ms",
                "consumer_gpu_mib_over_bare_context": "<= 64, flat over 10, 500, 1000 batches",
            },
        },
        "skipped": skipped,
        "latency": {},
        "publish": {},
    }
    base = {"real": real, "distinct": 4, "pinned": pinned, "warmup": warmup, "checkpoints": ()}
    for mib in sizes_mib:
        nbytes = int(mib * 2**20)
        step_s = max(step_ms, step_ms_per_mib * mib) / 1e3
        key = f"{mib:g}MiB"
        lat: dict[str, Any] = {"step_ms": round(step_s * 1e3, 1)}
        pub: dict[str, Any] = {}
        for path, device in paths.items():
            log(f"{key}: {path} path, {batches} batches, {step_s * 1e3:.0f} ms steps ...")
            spec = base | {"device": device, "batch_bytes": nbytes, "batches": batches, "step_s": step_s,
                           "verify_every": 16}  # fmt: skip
            prod, cons = pair(spec, timeout)
            for who, rep in (("producer", prod), ("consumer", cons)):
                if "error" in rep:
                    errors.append(f"{key} {path} {who}: {rep['error']}")
                    log(f"  {who} failed: {rep['error']}")
            lat[path] = cons.get("next")
            lat[f"{path}_floor"] = cons.get("floor")
            lat[f"{path}_yielded_on"] = cons.get("yielded_on")
            pub[path] = _per_batch_ms(prod)
            if lat[path]:
                floor = lat[f"{path}_floor"]
                log(
                    f"  next() p50 {lat[path]['p50_us']:.1f} us, p99 {lat[path]['p99_us']:.1f} us"
                    + (f" (floor p50 {floor['p50_us']:.1f} us)" if floor else "")
                )
            if pub[path]:
                log(
                    f"  publish {pub[path]['publish_ms']:.3f} ms/batch, producer CPU {pub[path]['producer_cpu_ms']:.3f} ms/batch"
                )
        if real:
            pub["h2d_us"] = pinned_h2d(nbytes, h2d_repeats)
            h2d_ms = pub["h2d_us"]["pinned"]["p50_us"] / 1e3
            pub["target_ms"] = round(1.2 * h2d_ms + 0.5, 3)
            if pub.get("gpu"):
                pub["gpu_over_h2d"] = round(pub["gpu"]["publish_ms"] / h2d_ms, 2)
                pub["meets_target"] = pub["gpu"]["publish_ms"] <= pub["target_ms"]
            if lat.get("gpu"):
                lat["meets_target_p50_le_100us"] = lat["gpu"]["p50_us"] <= 100.0
            log(f"  pinned H2D p50 {h2d_ms:.3f} ms -> publish target {pub['target_ms']:.3f} ms")
        if pub.get("gpu") and pub.get("host") and pub["host"]["producer_cpu_ms"]:
            pub["producer_cpu_gpu_over_host"] = round(
                pub["gpu"]["producer_cpu_ms"] / pub["host"]["producer_cpu_ms"], 2
            )
        result["latency"][key] = lat
        result["publish"][key] = pub
    p50s = [v["gpu"]["p50_us"] for v in result["latency"].values() if v.get("gpu")]
    if len(p50s) > 1:
        result["latency"]["gpu_p50_largest_over_smallest"] = round(p50s[-1] / p50s[0], 2)

    if "gpu" in paths:
        count = max(memory_checkpoints)
        log(f"GPU memory: {count} batches of {memory_mib:g} MiB, no step ...")
        spec = base | {"device": GPU, "batch_bytes": int(memory_mib * 2**20), "batches": count, "step_s": 0.0,
                       "verify_every": 50, "warmup": 0, "checkpoints": tuple(memory_checkpoints)}  # fmt: skip
        prod, cons = pair(spec, timeout)
        for who, rep in (("producer", prod), ("consumer", cons)):
            if "error" in rep:
                errors.append(f"memory run {who}: {rep['error']}")
                log(f"  {who} failed: {rep['error']}")
        memory: dict[str, Any] = {
            "batches_received": cons.get("received"),
            "yielded_on": cons.get("yielded_on"),
        }
        if real:
            bare = cons.get("gpu_bare_context")
            after = cons.get("gpu_after", {})
            over = {n: _delta(v, bare) for n, v in after.items()}
            memory["consumer"] = {"bare_context": bare, "after_batches": after, "over_bare_mib": over}
            known = [v for v in over.values() if v is not None]
            if known:
                memory["consumer"]["max_over_bare_mib"] = max(known)
                memory["consumer"]["spread_mib"] = round(max(known) - min(known), 1)
                memory["consumer"]["meets_target_le_64mib"] = max(known) <= 64
            pbare = prod.get("gpu_bare_context")
            memory["producer"] = {
                "bare_context": pbare,
                "after_batches": prod.get("gpu_after", {}),
                "over_bare_mib": {n: _delta(v, pbare) for n, v in prod.get("gpu_after", {}).items()},
                "places_expected_mib": SLOTS * memory_mib,
            }
            log(f"  consumer over its bare context (MiB): {over}")
            log(f"  producer over its bare context (MiB): {memory['producer']['over_bare_mib']}")
        result["gpu_memory"] = memory
    result["errors"] = errors
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mib", default="1,256", help="batch sizes in MiB, comma-separated (default 1,256)"
    )
    parser.add_argument("--batches", type=int, default=80, help="batches per latency run (default 80)")
    parser.add_argument("--step-ms", type=float, default=30.0, help="simulated training step (default 30)")
    parser.add_argument(
        "--step-ms-per-mib", type=float, default=0.5,
        help="longer steps for big batches, so the producer stays ahead (default 0.5: 128 ms at 256 MiB)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2 * SLOTS, help="first batches not timed (default 16)")
    parser.add_argument(
        "--memory-mib", type=float, default=64, help="batch size of the memory run (default 64)"
    )
    parser.add_argument(
        "--memory-checkpoints", default="10,500,1000", help="read GPU memory after these many batches"
    )
    parser.add_argument("--pinned", action="store_true", help="the loader yields pinned batches")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per producer/consumer pair")
    parser.add_argument("--out", type=Path, help="folder for the JSON (default benchmarks/results)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(float(s) for s in args.sizes_mib.split(","))
        checkpoints = tuple(int(c) for c in args.memory_checkpoints.split(","))
        if min(sizes) <= 0 or min(checkpoints) < 1:
            raise ValueError
    except ValueError:
        parser.error("--sizes-mib and --memory-checkpoints take positive numbers separated by commas")
    if args.batches <= args.warmup:
        parser.error(f"--batches ({args.batches}) must exceed --warmup ({args.warmup})")
    result = run(
        sizes, args.batches, args.step_ms, args.step_ms_per_mib, args.warmup, args.memory_mib, checkpoints,
        pinned=args.pinned, timeout=args.timeout,
    )  # fmt: skip
    if result["errors"]:
        print("errors:", *result["errors"], sep="\n  ")
    if not args.no_write:
        print(
            "wrote",
            write(
                result,
                "gpu_path",
                tag=_label(result["mode"]) + ("-pinned" if args.pinned else ""),
                folder=args.out or RESULTS,
            ),
        )
    if result["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
