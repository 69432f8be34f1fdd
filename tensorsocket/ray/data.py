"""A Ray Data pipeline as a producer's loader: read once per epoch with ``iter_torch_batches``.

Why: when a node's CPUs cannot decode and augment fast enough, a Ray Data pipeline runs those
stages as tasks on every node of the cluster, and the node's producer only pulls the finished
batches; its trials still read each batch once, zero-copy. Return one of these from the
PIPELINE function the fleet runs on each node.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any


class RayDataLoader:
    """Epochs of ``dataset.iter_torch_batches(batch_size=..., **kwargs)``.

    ``len()`` (batches per epoch, which a consumer's ``len()`` and re-cut ``batch_size`` need)
    is known when ``rows`` is given, or with ``count=True`` (``dataset.count()`` once, which may
    run the pipeline's reads); otherwise ``len()`` raises TypeError, which the producer accepts.
    With ``local_shuffle_buffer_size``, each epoch shuffles with seed ``seed + epoch`` (the
    producer calls :meth:`set_epoch`), so epochs differ and a run repeats.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        drop_last: bool = False,
        rows: int | None = None,
        count: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if not callable(getattr(dataset, "iter_torch_batches", None)):
            raise TypeError(f"dataset must be a ray.data.Dataset, got {type(dataset).__name__}")
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if rows is not None and (type(rows) is not int or rows < 0):
            raise ValueError(f"rows must be an int >= 0, got {rows!r}")
        reserved = {"batch_size", "drop_last", "local_shuffle_seed"} & set(kwargs)
        if reserved:
            raise TypeError(
                f"{', '.join(sorted(reserved))}: given by RayDataLoader itself (see its arguments)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.rows = int(dataset.count()) if rows is None and count else rows
        self.seed = seed
        self.epoch = 0
        self.kwargs = kwargs

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.rows is None:
            raise TypeError("RayDataLoader has no len() without rows= or count=True")
        div = self.rows // self.batch_size if self.drop_last else math.ceil(self.rows / self.batch_size)
        return int(div)

    def __iter__(self) -> Iterator[Any]:
        kwargs = dict(self.kwargs)
        if kwargs.get("local_shuffle_buffer_size"):
            kwargs["local_shuffle_seed"] = self.seed + self.epoch
        return iter(
            self.dataset.iter_torch_batches(batch_size=self.batch_size, drop_last=self.drop_last, **kwargs)
        )
