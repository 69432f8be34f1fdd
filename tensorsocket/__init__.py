"""tensorsocket: one producer loads each batch once and shares it, zero-copy, with several
training processes on the same machine."""

from .compat import TensorConsumer, TensorProducer
from .consumer import Consumer
from .errors import BatchModified, Evicted, ProducerLost, ProtocolError, TensorSocketError
from .producer import Producer

__version__ = "0.1.0"

__all__ = [
    "BatchModified",
    "Consumer",
    "Evicted",
    "ProducerLost",
    "Producer",
    "ProtocolError",
    "TensorConsumer",
    "TensorProducer",
    "TensorSocketError",
]
