"""GPU memory per process, read through NVML (nvidia-ml-py), for ``Producer.status()``.

A module of its own because NVML is optional (``pip install 'tensorsocket[gpu]'``) and
``status()`` runs under the producer's lock, so it must stay cheap and never raise. This is
the one place the producer touches ``pynvml``: it initialises NVML at most once per process
(a failure, such as no nvidia-ml-py or no driver, is remembered and not retried at every
call), caches each GPU's handle by UUID, reuses a GPU's process list for :data:`MAX_AGE`
seconds, and turns every NVML error into "not known" (None). A GPU NVML does not know, such
as the CPU stand-in's (``TENSORSOCKET_FAKE_CUDA=1``), is not known either.

``tensorsocket status`` reads NVML on its own side as well (:mod:`.cli.gpu`: every GPU of the
host it runs on); this module answers for the producer's GPU, by the producer's pids.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

MIB = float(1 << 20)
MAX_AGE = 0.5  # seconds a GPU's process list is reused (a polled status() stays cheap)

_lock = threading.Lock()
_pid: int | None = None  # the process that initialised NVML (a forked child starts over)
_nvml: Any = None  # the pynvml module, once nvmlInit() succeeded in this process
_failed = False  # the import or nvmlInit() failed in this process: not tried again
_handles: dict[str, Any] = {}  # GPU UUID -> NVML handle; None: NVML does not know that GPU
_recent: dict[str, tuple[float, dict[int, float]]] = {}  # GPU UUID -> (when read, MiB by pid)


def _handle(uuid: str) -> Any:
    """NVML's handle of the GPU ``uuid``, or None (lock held)."""
    global _pid, _nvml, _failed
    if _pid != os.getpid():
        _pid, _nvml, _failed = os.getpid(), None, False
        _handles.clear()
        _recent.clear()
    if _failed:
        return None
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            _failed = True
            return None
        _nvml = pynvml
    if uuid not in _handles:
        try:
            _handles[uuid] = _nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            _handles[uuid] = None
    return _handles[uuid]


def bytes_by_pid(nvml: Any, handle: Any) -> dict[int, int]:
    """The GPU memory of each process with a CUDA context on the GPU of NVML ``handle``, in
    bytes by pid; a process NVML lists without a figure (``usedGpuMemory`` None) is left out.
    NVML errors propagate."""
    by_pid: dict[int, int] = {}
    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        memory = getattr(proc, "usedGpuMemory", None)
        if isinstance(memory, int):
            by_pid[int(proc.pid)] = by_pid.get(int(proc.pid), 0) + memory
    return by_pid


def process_mib(gpu: str | None) -> dict[int, float] | None:
    """The GPU memory, in MiB, of each process with a CUDA context on the GPU whose UUID is
    ``gpu`` (``GPU-...``), by pid as NVML reports it (the pids of this PID namespace where it
    is the host's). A process NVML lists without a figure (``usedGpuMemory`` None) is left
    out. None when this cannot be known: ``gpu`` None, nvidia-ml-py missing, NVML failing, or
    a GPU NVML does not know. Never raises."""
    if not gpu:
        return None
    try:
        with _lock:
            handle = _handle(gpu)
            if handle is None:
                return None
            now = time.monotonic()
            recent = _recent.get(gpu)
            if recent is not None and now - recent[0] < MAX_AGE:
                return dict(recent[1])
            used = {pid: round(memory / MIB, 1) for pid, memory in bytes_by_pid(_nvml, handle).items()}
            _recent[gpu] = (now, used)
            return dict(used)
    except Exception:
        return None
