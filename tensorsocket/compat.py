"""``TensorProducer`` / ``TensorConsumer``: accept the upstream tensorsocket 0.0.5 arguments,
so its users switch by changing an import.

Upstream connects over tcp ports; here a port maps to ``tcp://127.0.0.1:<port>`` (ports may
be int or str, as upstream's examples pass them). Arguments that only made sense for
upstream's design are accepted and ignored, with a warning when they would change behaviour.
"""

from __future__ import annotations

import warnings
from typing import Any

from .consumer import Consumer
from .producer import Producer

_UPSTREAM_DEFAULT_PORT = 5555


def _tcp(port: int | str) -> str:
    try:
        number = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"port must be a number, got {port!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    return f"tcp://127.0.0.1:{number}"


class TensorProducer(Producer):
    """``TensorProducer(data_loader, port=5555, ack_port=5556, heart_ports=(4444, 4445),
    rubber_band_pct=..., pack_fn=..., consumer_max_buffer_size=10, producer_batch_size=8)``.

    ``consumer_max_buffer_size`` becomes the number of slots; ``ack_port``, ``heart_ports``
    and ``rubber_band_pct`` have no counterpart (one socket carries everything); ``pack_fn``
    and ``producer_batch_size`` are ignored with a warning. ``join()`` closes.
    """

    def __init__(
        self,
        data_loader: Any,
        port: int | str = _UPSTREAM_DEFAULT_PORT,
        ack_port: int | str | None = None,
        heart_ports: Any = None,
        rubber_band_pct: float | None = None,
        pack_fn: Any = None,
        consumer_max_buffer_size: int = 8,
        producer_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if pack_fn is not None or producer_batch_size is not None:
            warnings.warn(
                "TensorProducer: pack_fn and producer_batch_size are ignored; batches are shared "
                "as the loader yields them",
                stacklevel=2,
            )
        kwargs.setdefault("slots", consumer_max_buffer_size)
        super().__init__(data_loader, endpoint=_tcp(port), **kwargs)


class TensorConsumer(Consumer):
    """``TensorConsumer(port=5555, ack_port=5556, heart_ports=..., unpack_fn=..., batch_size=...)``.

    Yields the loader's batches as upstream 0.0.5 does. ``batch_size`` re-cuts them, as
    upstream's does; unlike upstream it is not applied unless given (upstream's default of 64
    would silently re-cut every producer batch). ``unpack_fn`` is ignored with a warning.
    """

    def __init__(
        self,
        port: int | str = _UPSTREAM_DEFAULT_PORT,
        ack_port: int | str | None = None,
        heart_ports: Any = None,
        unpack_fn: Any = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if unpack_fn is not None:
            warnings.warn(
                "TensorConsumer: unpack_fn is ignored; batches arrive as the producer's loader yields them",
                stacklevel=2,
            )
        super().__init__(endpoint=_tcp(port), batch_size=batch_size, **kwargs)
