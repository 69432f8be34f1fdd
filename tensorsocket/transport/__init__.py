"""Where batches live while consumers read them, behind one interface (``base``): host
shared memory (``shm``) and GPU memory shared by CUDA IPC (``cuda``, over the primitives in
``device``: the real ones, or the CPU stand-in selected by ``TENSORSOCKET_FAKE_CUDA=1``).
The two functions here pick a side's transport; nothing above this package names one."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .base import Lease, Reader, Receipt, Store
from .shm import ShmReader, ShmStore, sweep_stale

__all__ = ["Lease", "Reader", "Receipt", "Store", "open_reader", "open_store", "parse_device", "sweep_stale"]

log = logging.getLogger("tensorsocket")


def parse_device(device: Any) -> torch.device:
    """``device`` as a torch.device of type cpu or cuda; ValueError naming it otherwise (torch
    takes "cpu:1" too, a slip for "cuda:1": host memory has no second device)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return parsed


def open_store(device: Any) -> Store:
    """The producer's store for ``device``: host shared memory for "cpu", GPU memory shared by
    CUDA IPC for "cuda[:N]" (host shared memory, with a warning saying why, on a MIG GPU)."""
    parsed = parse_device(device)
    if parsed.type == "cuda":
        from .cuda import CudaStore, mig_reason

        why = mig_reason(parsed.index)
        if why is None:
            return CudaStore(parsed.index)
        log.warning("%s", why)
    return ShmStore()


def open_reader(
    kind: str, gpu: str | None, device: torch.device, stream: Any = None, check_writes: bool = False
) -> Reader:
    """The consumer's reader for the transport the producer's WELCOME names. Host shared
    memory is mapped read-only unless ``check_writes`` (then writable, and checked by
    fingerprint); GPU memory cannot be protected and is always checked."""
    if kind == "shm":
        return ShmReader(device, writable=check_writes)
    from .cuda import CudaReader

    return CudaReader(gpu, device, stream)
