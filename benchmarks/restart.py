"""Restart benchmark: how long trainers wait when the producer dies and a supervisor restarts
it, and what keeping the state file costs per batch.

* ``restart``: one consumer (``reconnect=60``, no training step, so it waits on the producer
  and holds nothing queued) reads ``tests/restart_pipeline.py``'s loaders, 192-sample epochs of
  4-sample batches with ``--delay-ms`` of loading per sample, served by ``tensorsocket serve
  --resume``. ``--restarts`` times, at a random moment 0.3-1.5 s after the producer began
  serving, this process SIGKILLs it and starts the same command at once (a supervisor). Per
  restart: seconds from the SIGKILL to the consumer's first batch from the successor (the
  consumer notes, with each batch, the pid of the producer it is joined to), split into the
  successor's start-up (interpreter, imports, reading the state file and, for a plain loader,
  running the epoch again up to the restart point: until it logs that it serves) and the rest
  (the consumer noticing and rejoining, the first batch). ``seeded`` is a plain DataLoader
  with a seeded generator (restarts run the epoch again), ``stateful`` torchdata's
  StatefulDataLoader (restarts load its state). Every run checks that the consumer saw the
  uninterrupted sequence.
  For scale, the start of a bare ``python -c "import torch, tensorsocket"`` is measured too.
* ``state-cost``: the producer's CPU per batch with ``resume=True`` less without, over
  ``--batches`` tiny batches (no loading delay), one consumer process, side by side in one run;
  and the state file's own share (encoding and writing it, at most every 0.1 s).

    python -m benchmarks.restart      # writes benchmarks/results/restart-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.sharing import ROOT, machine, write

SPAWN = mp.get_context("spawn")
EPOCHS, SAMPLES = 3, 192


def _consume(name: str, out: Any) -> None:
    """A consumer recording, per batch: when it got it, from which producer, and its samples."""
    from tensorsocket import Consumer

    got: list[tuple[float, int]] = []
    seen: list[list[Any]] = []
    with Consumer(name=name, timeout=5.0, reconnect=60.0) as consumer:
        while not consumer.finished:
            epoch = []
            for ids, noise in consumer:
                got.append((time.time(), consumer._conn.producer_pid))  # white-box: who sent it
                epoch += [(int(i), n.tolist()) for i, n in zip(ids, noise, strict=True)]
            if epoch:
                seen.append(epoch)
    out.put({"got": got, "seen": seen})


def _serve(name: str, pipeline: str, delay_ms: float, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensorsocket", "serve", f"tests/restart_pipeline.py:{pipeline}"]
    command += ["--name", name, "--epochs", str(EPOCHS), "--resume", "--log-level", "INFO"]
    command += ["--arg", f"delay={delay_ms / 1000}", "--arg", f"n={SAMPLES}", "--progress", "0"]
    with open(log, "a") as f:
        return subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def _serving_since(log: Path, lives: int, deadline: float) -> float:
    """Wait for the ``lives``-th "serving" line of the log; the time it was seen."""
    while time.monotonic() < deadline:
        if log.read_text().count(" serving tests/restart_pipeline.py") >= lives:
            return time.time()
        time.sleep(0.005)
    raise TimeoutError(f"the producer did not start serving:\n{log.read_text()[-2000:]}")


def restarts(pipeline: str, count: int, delay_ms: float, seed: int, folder: Path) -> dict[str, Any]:
    from tests import restart_pipeline

    name = f"bench-restart-{uuid.uuid4().hex[:8]}"
    log = folder / f"{name}.log"
    out = SPAWN.Queue()
    consumer = SPAWN.Process(target=_consume, args=(name, out))
    consumer.start()
    rng, kills, lives = random.Random(seed), [], 0
    proc = _serve(name, pipeline, delay_ms, log)
    while len(kills) < count:
        lives += 1
        _serving_since(log, lives, time.monotonic() + 120)
        time.sleep(rng.uniform(0.3, 1.5))
        if proc.poll() is not None:
            raise RuntimeError(f"the stream ended before {count} restarts; use more --delay-ms")
        killed = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = _serve(name, pipeline, delay_ms, log)
        serving = _serving_since(log, lives + 1, time.monotonic() + 120)
        kills.append({"killed": killed, "successor": proc.pid, "serving": serving})
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(log.read_text()[-2000:])
    result = out.get(timeout=60)
    consumer.join(timeout=30)
    expected = restart_pipeline.uninterrupted(getattr(restart_pipeline, pipeline)(n=SAMPLES), EPOCHS)
    exact = result["seen"] == expected
    waits = []
    for kill in kills:
        first = next(t for t, pid in result["got"] if pid == kill["successor"])
        waits.append(
            {
                "total_s": round(first - kill["killed"], 3),
                "successor_start_s": round(kill["serving"] - kill["killed"], 3),
                "rejoin_and_first_batch_s": round(first - kill["serving"], 3),
            }
        )
    totals = [w["total_s"] for w in waits]
    log.unlink()
    return {
        "loader": pipeline,
        "restarts": count,
        "exact": exact,
        "median_s": round(statistics.median(totals), 3),
        "max_s": round(max(totals), 3),
        "median_successor_start_s": round(statistics.median(w["successor_start_s"] for w in waits), 3),
        "each": waits,
    }


def _drain(name: str) -> None:
    from tensorsocket import Consumer

    with Consumer(name=name) as consumer:
        for _ in consumer:
            pass


def state_cost(batches: int) -> list[dict[str, Any]]:
    """Producer CPU per batch with and without resume=True, for both kinds of loader."""
    from tensorsocket import Producer
    from tests import restart_pipeline

    rows = []
    for pipeline in ("seeded", "stateful"):
        cpu: dict[bool, float] = {}
        writing = 0.0
        for resume in (False, True, False, True):  # interleaved: the machine drifts
            name = f"bench-cost-{uuid.uuid4().hex[:8]}"
            loader = getattr(restart_pipeline, pipeline)(n=batches * 4)
            with Producer(loader, name=name, resume=resume, slots=8, replay=0) as producer:
                reader = SPAWN.Process(target=_drain, args=(name,))
                reader.start()
                t0 = time.process_time()
                for _ in producer:
                    pass
                spent = time.process_time() - t0
                if resume:
                    writing += producer._publisher.tracker.seconds_writing  # type: ignore[union-attr]
            reader.join(timeout=60)
            cpu[resume] = cpu.get(resume, 0.0) + spent / 2
        rows.append(
            {
                "loader": pipeline,
                "batches": batches,
                "cpu_us_per_batch_plain": round(cpu[False] / batches * 1e6, 1),
                "cpu_us_per_batch_resume": round(cpu[True] / batches * 1e6, 1),
                "extra_us_per_batch": round((cpu[True] - cpu[False]) / batches * 1e6, 1),
                "state_file_writes_us_per_batch": round(writing / 2 / batches * 1e6, 1),
            }
        )
    return rows


def start_floor(runs: int = 3) -> float:
    """Seconds a bare ``python -c "import torch, tensorsocket"`` takes (median): the part of
    a restart no state file can save."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, tensorsocket"], check=True, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="loading time per sample")
    parser.add_argument("--batches", type=int, default=3000, help="batches for the state-cost part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    folder = ROOT / "benchmarks" / "results"
    started = datetime.now(timezone.utc)
    floor = start_floor()
    print(f"a bare interpreter with torch and tensorsocket imported starts in {floor:.2f} s")
    runs = [restarts(p, args.restarts, args.delay_ms, args.seed, folder) for p in ("seeded", "stateful")]
    for r in runs:
        print(
            f"{r['loader']:>8}: kill -> first batch from the successor: median {r['median_s']:.2f} s, "
            f"max {r['max_s']:.2f} s over {r['restarts']} restarts (successor start-up median "
            f"{r['median_successor_start_s']:.2f} s); sequence exact: {r['exact']}"
        )
    costs = state_cost(args.batches)
    for c in costs:
        print(
            f"{c['loader']:>8}: producer CPU per batch {c['cpu_us_per_batch_plain']:.0f} us plain, "
            f"{c['cpu_us_per_batch_resume']:.0f} us with resume=True (+{c['extra_us_per_batch']:.0f} us; "
            f"state file writes {c['state_file_writes_us_per_batch']:.0f} us of it)"
        )
    result = {
        "benchmark": "restart",
        "date": started.isoformat(timespec="seconds"),
        "command": ["python3", "-m", "benchmarks.restart", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine(),
        "config": vars(args) | {"epochs": EPOCHS, "samples_per_epoch": SAMPLES, "batch": 4},
        "python_import_torch_tensorsocket_s": floor,
        "restarts": runs,
        "state_cost": costs,
    }
    print("wrote", write(result, "restart", args.tag))
    if not all(r["exact"] for r in runs):
        raise SystemExit("a consumer's sequence differed from the uninterrupted loader's")


if __name__ == "__main__":
    main()
