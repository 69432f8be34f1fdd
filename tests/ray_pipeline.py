"""Pipelines for the Ray and Optuna tests: batches that say which samples they hold, so each
trial can check it saw every sample of every epoch exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch


class IndexLoader:
    """Batches ``(sample ids, features)`` of an epoch-seeded permutation of ``samples`` ids: the
    same for a given epoch in any process (a restarted producer's rerun repeats it exactly)."""

    def __init__(self, samples: int = 64, batch_size: int = 8, delay: float = 0.0, seed: int = 0) -> None:
        self.samples, self.batch_size, self.delay, self.seed = samples, batch_size, delay, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.samples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        order = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for start in range(0, self.samples, self.batch_size):
            if self.delay:
                time.sleep(self.delay)
            ids = order[start : start + self.batch_size]
            yield ids, ids.float().unsqueeze(1).repeat(1, 4)


def make_loader(samples: int = 64, batch_size: int = 8, delay: float = 0.0) -> IndexLoader:
    return IndexLoader(samples, batch_size, delay)


def make_ray_data_loader(rows: int = 48, batch_size: int = 8) -> Any:
    """A Ray Data pipeline (a map stage run as Ray tasks) as the producer's loader."""
    import ray.data

    from tensorsocket.ray import RayDataLoader

    def double(batch: dict[str, Any]) -> dict[str, Any]:
        return {"id": batch["id"], "twice": batch["id"] * 2}

    dataset = ray.data.range(rows, override_num_blocks=4).map_batches(double, batch_format="numpy")
    return RayDataLoader(dataset, batch_size, rows=rows)


def fail_to_build() -> Any:
    raise OSError("no such dataset: /nonexistent")
