"""How GPU batches would reach each consumer (``transport/gpu_topology.py``): every decision on
plain facts, the NVML readers against a stand-in module (the real NVML needs a GPU: the last
test runs there and is skipped elsewhere)."""

from __future__ import annotations

import sys
import types

import pytest

from tensorsocket.host import boot_id
from tensorsocket.transport import gpu_topology as topo
from tensorsocket.transport.gpu_topology import Delivery, GpuFacts, GpuPathError

H100 = GpuFacts("boot-1", "GPU-aaaa", "NVIDIA H100", mig=False)
OTHER = GpuFacts("boot-1", "GPU-bbbb", "NVIDIA H100", mig=False)


def test_the_producer_shares_by_cuda_ipc_unless_its_gpu_is_in_mig_mode() -> None:
    assert topo.producer_transport(H100) == ("cuda", None)
    transport, why = topo.producer_transport(GpuFacts("boot-1", "GPU-aaaa", "NVIDIA A100", mig=True))
    assert transport == "shm"
    assert "NVIDIA A100 (GPU-aaaa) is in MIG mode" in why and "host shared memory" in why


@pytest.mark.parametrize(
    ("consumer", "peer", "delivery"),
    [
        (None, False, Delivery.HOST_COPY),
        (H100, False, Delivery.VIEWS),
        (H100, True, Delivery.VIEWS),
        (OTHER, True, Delivery.PEER_COPY),
        (OTHER, False, Delivery.STAGED_COPY),
    ],
)
def test_each_consumer_device_gets_the_cheapest_way_that_works(consumer, peer, delivery) -> None:
    assert topo.consumer_delivery(H100, consumer, peer) is delivery


def test_a_consumer_that_cannot_be_served_is_told_why_and_what_to_do() -> None:
    elsewhere = GpuFacts("boot-2", "GPU-aaaa", "NVIDIA H100", mig=False)
    with pytest.raises(GpuPathError, match=r"not run on the producer's machine \(boot id boot-2 vs boot-1\)"):
        topo.consumer_delivery(H100, elsewhere, True)
    unknown = GpuFacts("", "GPU-aaaa", "NVIDIA H100", mig=False)
    with pytest.raises(GpuPathError, match="not run on the producer's machine"):
        topo.consumer_delivery(unknown, unknown, True)  # an unreadable boot id matches nothing
    mig = GpuFacts("boot-1", "MIG-cccc", "NVIDIA A100", mig=True)
    with pytest.raises(GpuPathError, match=r"MIG mode.*start the producer with device='cpu'"):
        topo.consumer_delivery(H100, mig, False)


def _fake_nvml(monkeypatch: pytest.MonkeyPatch, **overrides) -> types.SimpleNamespace:
    gpus = {"GPU-aaaa": ("h0", b"NVIDIA H100", 0), "GPU-bbbb": ("h1", "NVIDIA A100", 1)}
    by_handle = {h: (uuid, name, mig) for uuid, (h, name, mig) in gpus.items()}

    def handle_by_uuid(uuid: str) -> str:
        if uuid not in gpus:
            raise RuntimeError("Not Found")
        return gpus[uuid][0]

    fields = dict(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetUUID=lambda h: by_handle[h][0],
        nvmlDeviceGetName=lambda h: by_handle[h][1],
        nvmlDeviceGetMigMode=lambda h: (by_handle[h][2], by_handle[h][2]),
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlDeviceGetP2PStatus=lambda a, b, caps: 0 if {a, b} == {"h0", "h1"} and caps == 0 else 4,
        NVML_P2P_CAPS_INDEX_READ=0,
        NVML_P2P_STATUS_OK=0,
    )
    fake = types.SimpleNamespace(**(fields | overrides))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_reading_the_facts_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_nvml(monkeypatch)
    me = boot_id()
    assert len(me) == 36  # the kernel's UUID for this boot
    assert topo.read_gpu("aaaa") == GpuFacts(me, "GPU-aaaa", "NVIDIA H100", mig=False)  # torch's form
    assert topo.read_gpu("GPU-bbbb") == GpuFacts(me, "GPU-bbbb", "NVIDIA A100", mig=True)
    with pytest.raises(GpuPathError, match="NVML does not know the GPU GPU-zzzz"):
        topo.read_gpu("zzzz")
    assert topo.peer_access("GPU-aaaa", "GPU-bbbb") and topo.peer_access("GPU-aaaa", "GPU-aaaa")

    def unsupported(*_: object) -> int:
        raise RuntimeError("Not Supported")

    monkeypatch.setattr(fake, "nvmlDeviceGetP2PStatus", unsupported)
    assert not topo.peer_access("GPU-aaaa", "GPU-bbbb")  # unknown: the staged copy still works
    monkeypatch.setattr(fake, "nvmlDeviceGetMigMode", unsupported)
    assert not topo.read_gpu("GPU-bbbb").mig  # a GPU without MIG support is not in MIG mode


def test_missing_nvml_or_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuPathError, match=r"needs nvidia-ml-py: pip install 'tensorsocket\[gpu\]'"):
        topo.read_gpu("GPU-aaaa")

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    _fake_nvml(monkeypatch, nvmlInit=no_driver)
    with pytest.raises(GpuPathError, match=r"NVML could not start \(NVML Shared Library Not Found\)"):
        topo.peer_access("GPU-aaaa", "GPU-bbbb")


@pytest.mark.gpu
def test_the_real_gpu_facts_agree_with_torch() -> None:
    import torch

    pytest.importorskip("pynvml")
    uuid = topo.torch_uuid(0)
    facts = topo.read_gpu(uuid)
    assert facts.uuid == uuid and facts.name == torch.cuda.get_device_name(0)
    assert facts.boot_id == boot_id()
    assert topo.peer_access(uuid, uuid)
    assert topo.consumer_delivery(facts, facts, False) is Delivery.VIEWS
    assert topo.producer_transport(facts)[0] == ("shm" if facts.mig else "cuda")
