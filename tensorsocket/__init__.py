"""tensorsocket: one producer loads each batch once and shares it, zero-copy, with several
training processes on the same machine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BatchModified,
    Closed,
    Evicted,
    GpuPathError,
    GroupBroken,
    Hoarding,
    IoThreadDied,
    KeysError,
    ProducerLost,
    ProtocolError,
    Refused,
    StateFileError,
    TensorSocketError,
)

if TYPE_CHECKING:
    from .compat import TensorConsumer, TensorProducer
    from .consumer import Consumer
    from .producer import Producer
    from .sharding import node_sampler

__version__ = "0.1.0"

__all__ = [
    "BatchModified",
    "Closed",
    "Consumer",
    "Evicted",
    "GpuPathError",
    "GroupBroken",
    "Hoarding",
    "IoThreadDied",
    "KeysError",
    "ProducerLost",
    "Producer",
    "ProtocolError",
    "Refused",
    "StateFileError",
    "TensorConsumer",
    "TensorProducer",
    "TensorSocketError",
    "node_sampler",
]

# Imported on first use (PEP 562): `tensorsocket --help` and `tensorsocket status` then
# start without importing torch.
_LAZY = {
    "Consumer": "consumer",
    "Producer": "producer",
    "TensorConsumer": "compat",
    "TensorProducer": "compat",
    "node_sampler": "sharding",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
