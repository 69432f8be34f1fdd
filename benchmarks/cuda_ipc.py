"""CUDA IPC costs the cuda transport is designed around (GPU only), measured across two real
processes: opening an arena's IPC handle (why handles are opened once per consumer, not per
batch), a ready-event round trip (record in one process, stream wait + query in the other),
and pinned host-to-device copy bandwidth (the producer's upload) for 1 MiB and 256 MiB.

    python -m benchmarks.cuda_ipc     # writes benchmarks/results/cuda_ipc-<gpu>-<date>.json
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SPAWN = mp.get_context("spawn")
OPENS = 50
ROUND_TRIPS = 200


def _opener(handles: list[bytes], size: int, ready: bytes, conn: Any) -> None:
    from tensorsocket.transport.cuda_ipc import IpcEvent, open_arena

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context exists before timing
    open_us = []
    for handle in handles:
        t0 = time.perf_counter()
        view = open_arena(handle, size, 0)
        open_us.append((time.perf_counter() - t0) * 1e6)
        del view  # closes the mapping
    event = IpcEvent(0, ready)
    marker = torch.cuda.Event()
    conn.send(open_us)
    waits = []
    for _ in range(ROUND_TRIPS):
        conn.recv()  # the producer recorded
        t0 = time.perf_counter()
        event.wait()
        marker.record()
        marker.synchronize()
        waits.append((time.perf_counter() - t0) * 1e6)
        conn.send(None)
    conn.send(waits)


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        "p50": round(statistics.median(values), 1),
        "p99": round(values[min(len(values) - 1, int(len(values) * 0.99))], 1),
        "n": len(values),
    }


def _h2d(nbytes: int, repeats: int) -> float:
    """GB/s of pinned host -> device copies on a side stream."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def main() -> None:
    from tensorsocket.transport.cuda_ipc import DeviceArena, IpcEvent

    size = 64 << 20
    arenas = [DeviceArena(size, 0) for _ in range(OPENS)]
    ready = IpcEvent(0)
    ready.record()
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_opener, args=([a.handle for a in arenas], size, ready.handle, theirs))
    child.start()
    open_us = mine.recv()
    for _ in range(ROUND_TRIPS):
        ready.record()
        mine.send(None)
        mine.recv()
    waits = mine.recv()
    child.join(60)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "ipc_open_handle_us": _percentiles(open_us),
        "ready_event_wait_us": _percentiles(waits),
        "pinned_h2d_GBps": {"1MiB": round(_h2d(1 << 20, 2000), 2), "256MiB": round(_h2d(256 << 20, 20), 2)},
    }
    for a in arenas:
        a.free()
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    gpu = result["gpu"].split()[1].lower() if len(result["gpu"].split()) > 1 else "gpu"
    path = RESULTS / f"cuda_ipc-{gpu}-{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
