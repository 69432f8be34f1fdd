"""Which way a GPU batch can reach a consumer: the facts (nvidia-ml-py and the kernel's boot
id) and the pure decisions over them.

Why a module of its own: CUDA IPC fails in ways that surface deep inside CUDA, long after
the cause (a consumer in another container or on another machine, a GPU in MIG mode, two
GPUs without peer access). Checking the facts when a consumer joins turns each of those
into one sentence that names the cause and the remedy, or into a slower path that works.

* :func:`producer_transport`: ``cuda`` when the producer's GPU can export IPC handles, else
  ``shm`` with the reason (MIG mode: CUDA IPC is not supported there).
* :func:`consumer_delivery`: for a consumer's device, ``views`` (the producer's GPU: no
  copy), ``peer_copy`` (another GPU with peer access, e.g. NVLink: a device-to-device copy
  on the consumer's stream), ``staged_copy`` (another GPU without peer access: the copy goes
  through host memory, which CUDA does for us, slower) or ``host_copy`` (``device="cpu"``);
  or :class:`GpuPathError` when no way exists.
* :func:`read_gpu` / :func:`peer_access`: the facts, from nvidia-ml-py, with errors that say
  what is missing.

The decisions take plain facts, so they are tested without a GPU; the readers are tested on
the GPU machine. Arenas are allocated with ``cudaMalloc`` directly (not through torch's
caching allocator), so torch's allocator backend (``cudaMallocAsync`` included) does not
matter to them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tensorsocket.errors import GpuPathError  # defined in errors.py; still importable from here
from tensorsocket.host import boot_id


@dataclass(frozen=True)
class GpuFacts:
    """What the checks need to know about one GPU, as seen from one process."""

    boot_id: str  # the kernel's boot id: equal for two processes on the same running machine
    uuid: str  # as NVML writes it, "GPU-..." (MIG instances: "MIG-...")
    name: str
    mig: bool  # MIG mode enabled: CUDA IPC is not supported


class Delivery(enum.Enum):
    VIEWS = "views"
    PEER_COPY = "peer_copy"
    STAGED_COPY = "staged_copy"
    HOST_COPY = "host_copy"


def producer_transport(gpu: GpuFacts) -> tuple[str, str | None]:
    """``("cuda", None)``, or ``("shm", why)`` when this GPU cannot share memory by CUDA IPC."""
    if gpu.mig:
        return "shm", (
            f"{gpu.name} ({gpu.uuid}) is in MIG mode, where CUDA IPC is not supported: batches go through "
            "host shared memory instead, and each consumer copies them to its GPU"
        )
    return "cuda", None


def consumer_delivery(producer: GpuFacts, consumer: GpuFacts | None, peer: bool) -> Delivery:
    """How a consumer gets batches that live on ``producer``'s GPU.

    ``consumer`` is None for ``device="cpu"``; ``peer`` is whether the consumer's GPU can
    access the producer's directly (ignored when they are the same GPU).
    """
    if consumer is None:
        return Delivery.HOST_COPY
    if not consumer.boot_id or consumer.boot_id != producer.boot_id:  # "": unknown, not a match
        raise GpuPathError(
            f"the consumer does not run on the producer's machine (boot id {consumer.boot_id} vs "
            f"{producer.boot_id}): GPU batches are shared within one machine only"
        )
    if consumer.mig:
        raise GpuPathError(
            f"the consumer's GPU {consumer.name} ({consumer.uuid}) is in MIG mode, where CUDA IPC is not "
            "supported: start the producer with device='cpu' and give this consumer device='cuda'"
        )
    if consumer.uuid == producer.uuid:
        return Delivery.VIEWS
    return Delivery.PEER_COPY if peer else Delivery.STAGED_COPY


# --------------------------------------------------------------------------- facts


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise GpuPathError("checking the GPUs needs nvidia-ml-py: pip install 'tensorsocket[gpu]'") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its subclasses; no driver, no library
        raise GpuPathError(
            f"NVML could not start ({exc}): is the NVIDIA driver installed and visible?"
        ) from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpu(uuid: str) -> GpuFacts:
    """The facts of the GPU with this UUID (``"GPU-..."``, or torch's form without the prefix)."""
    nvml = _nvml()
    wanted = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(wanted)
    except Exception as exc:
        raise GpuPathError(f"NVML does not know the GPU {wanted} ({exc})") from None
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        mig = current == nvml.NVML_DEVICE_MIG_ENABLE
    except Exception:  # not supported on this GPU: no MIG
        mig = False
    return GpuFacts(
        boot_id(), _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)), mig
    )


def peer_access(a: str, b: str) -> bool:
    """Whether GPU ``b`` can read GPU ``a``'s memory directly (NVML's P2P read status)."""
    if a == b:
        return True
    nvml = _nvml()
    try:
        status = nvml.nvmlDeviceGetP2PStatus(
            nvml.nvmlDeviceGetHandleByUUID(a),
            nvml.nvmlDeviceGetHandleByUUID(b),
            nvml.NVML_P2P_CAPS_INDEX_READ,
        )
    except Exception:  # not supported: treat as no peer access (the staged copy still works)
        return False
    return status == nvml.NVML_P2P_STATUS_OK


def torch_uuid(index: int) -> str:
    """NVML's name ("GPU-...") of torch's CUDA device ``index`` (CUDA_VISIBLE_DEVICES renumbers them)."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
