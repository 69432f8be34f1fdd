"""Per-node producers on a Ray cluster (``pip install 'tensorsocket[ray]'``).

Driver::

    with tensorsocket.ray.producers("pipeline.py:make_loader", "sweep1", args={...}, cpus=3) as fleet:
        tuner.fit()            # or any Ray tasks / actors

Trial (on whichever node Ray placed it)::

    loader = tensorsocket.ray.consumer("sweep1", batch_size=64)

One producer actor per node, pinned there with ``cpus`` CPUs reserved, serves the pipeline
under ``<name>-<node id>``; a trial's consumer finds its node's producer from the node it runs
on. No batch crosses nodes through tensorsocket. See the README's "Sweeps across nodes".
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401  (this package's name shadows nothing: imports are absolute)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tensorsocket.ray needs Ray: pip install 'tensorsocket[ray]' (or 'ray[tune]>=2.40')"
    ) from exc

from .data import RayDataLoader
from .fleet import Fleet, producers
from .naming import node_name
from .trial import consumer

__all__ = ["Fleet", "RayDataLoader", "consumer", "node_name", "producers"]
