"""What a trial calls: a Consumer of the producer on the node the trial runs on."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ..consumer import Consumer
from ..errors import ProducerLost
from .naming import current_node_id, node_name

DEFAULT_RECONNECT = 30.0  # seconds to wait for a restarted producer actor (Ray restarts it in a few)


def trial_label() -> str | None:
    """The Ray Tune trial's name when called inside one (how ``status`` shows this consumer)."""
    for module in ("ray.tune", "ray.train"):  # ray.tune.get_context from Ray 2.41 on
        if module not in sys.modules:  # a Tune trial's process has imported it: elsewhere, no trial
            continue
        try:
            get_context = getattr(sys.modules[module], "get_context", None)
            if get_context is None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                name = get_context().get_trial_name()
        except Exception:  # not in a Tune trial
            continue
        return None if name is None else str(name)
    return None


def consumer(name: str = "sweep", *, reconnect: float = DEFAULT_RECONNECT, **options: Any) -> Consumer:
    """A :class:`~tensorsocket.Consumer` of this node's producer of the fleet ``name`` (started
    with :func:`tensorsocket.ray.producers`), found from the Ray node this process runs on.

    Use it where the trial made its DataLoader. ``reconnect`` (default 30 s) lets the consumer
    ride through a restart of its node's producer actor; if none comes back it raises
    :class:`ProducerLost`. ``label`` defaults to the Tune trial's name. Other keyword arguments
    are Consumer options (``batch_size``, ``device``, ``timeout``, ...). RuntimeError outside
    Ray; ProducerLost, naming the fleet, when no producer serves this node.
    """
    node = current_node_id()
    served = node_name(name, node)
    if options.get("label") is None:
        options["label"] = trial_label()
    try:
        return Consumer(name=served, reconnect=reconnect, **options)
    except ProducerLost as exc:
        raise ProducerLost(
            f"{exc} (no tensorsocket.ray producer {served!r} answers on this node, {node[:16]}: does the "
            f"trial run inside `with tensorsocket.ray.producers(..., name={name!r})`, and did the fleet "
            "start a producer on this node?)"
        ) from exc
