"""Loaders for the restart tests, served by ``tensorsocket serve tests/restart_pipeline.py:...``:
sample ids with a random "augmentation" drawn from the global torch generator (a loader
without workers draws in the producer's process), in a shuffled order."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class Augmented(Dataset):
    """Sample i is (i, two random numbers): ids to check exactness, noise to check that the
    random states were restored too. Each of the first ``slow_for`` samples taken (all: None)
    takes ``delay`` seconds."""

    def __init__(self, n: int, delay: float, slow_for: int | None = None) -> None:
        self.n, self.delay, self.slow_for, self.taken = n, delay, slow_for, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.delay and (self.slow_for is None or self.taken < self.slow_for):
            time.sleep(self.delay)
        self.taken += 1
        return torch.tensor(i), torch.rand(2)


def _shuffled(
    kind: Any, n: int, batch_size: int, delay: float, seed: int, slow_for: int | None = None
) -> Any:
    """A loader of ``kind`` whose order depends only on its seeded generator (and whose
    augmentations only on the seeded global one)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    return kind(Augmented(n, delay, slow_for), batch_size=batch_size, shuffle=True, generator=generator)


def seeded(
    n: int = 96, batch_size: int = 4, delay: float = 0.0, seed: int = 7, slow_for: int | None = None
) -> DataLoader:
    """A plain DataLoader: a restart runs the epoch again up to where it was (a successor's
    rerun made slow with ``slow_for``: its first samples)."""
    return _shuffled(DataLoader, n, batch_size, delay, seed, slow_for)


def stateful(n: int = 96, batch_size: int = 4, delay: float = 0.0, seed: int = 7) -> Any:
    """torchdata's StatefulDataLoader: a restart loads its saved state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return _shuffled(StatefulDataLoader, n, batch_size, delay, seed)


def stateful_workers(n: int = 96, batch_size: int = 4, delay: float = 0.0, seed: int = 7) -> Any:
    """A StatefulDataLoader whose two workers draw the augmentations (each seeded from the
    loader's generator at iter()): its saved state does not hold their random states, so a
    restart runs the epoch again from its start, as for a plain DataLoader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    data = Augmented(n, delay)
    return StatefulDataLoader(data, batch_size=batch_size, shuffle=True, generator=generator, num_workers=2)


class FromTheOs(Sampler):
    """A shuffle seeded by the OS at each epoch: no restored random state repeats it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return iter(torch.randperm(self.n, generator=g).tolist())


def unrepeatable(n: int = 96, batch_size: int = 4, delay: float = 0.0) -> DataLoader:
    """An order no restart can repeat."""
    return DataLoader(Augmented(n, delay), batch_size=batch_size, sampler=FromTheOs(n))


def uninterrupted(loader: Any, epochs: int) -> list[list[Any]]:
    """What the loader yields over ``epochs`` epochs, as a producer would run it (set_epoch,
    then iterate): per epoch, the (id, noise) of each sample in order."""
    from tensorsocket.sharding import set_epoch

    out = []
    for epoch in range(epochs):
        set_epoch(loader, epoch)
        out.append(
            [(int(i), noise.tolist()) for ids, noises in loader for i, noise in zip(ids, noises, strict=True)]
        )
    return out
