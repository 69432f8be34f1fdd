"""Epochs and shards: tell a loader's epoch-seeded parts which epoch starts, as a training
loop would, and build the sampler of one node's shard for a multi-node job.

Why the producer calls ``set_epoch``: a ``DistributedSampler`` (and any sampler, batch
sampler or dataset seeded by its epoch) shuffles by ``seed + epoch`` and learns the epoch
only from ``set_epoch(epoch)``, which a training loop calls before iterating. Inside a
producer nobody else calls it, so without this every epoch would repeat epoch 0's order.

Multi-node jobs run one producer per node over that node's shard (no batch crosses nodes):
:func:`node_sampler` is the ``DistributedSampler`` of the shard, with the node's rank and
the number of nodes taken from torchrun's environment unless given.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import DistributedSampler

log = logging.getLogger("tensorsocket")


def epoch_targets(loader: Any) -> list[Any]:
    """The objects of ``loader`` that have a callable ``set_epoch``, each once (by identity,
    since a DataLoader's ``batch_sampler.sampler`` is its ``sampler``), in the order a
    training loop would reach them: the loader itself, its sampler, its batch sampler and
    that one's sampler, its dataset. A list or a generator function has none of these."""
    candidates = [loader, getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates += [batch_sampler, getattr(batch_sampler, "sampler", None), getattr(loader, "dataset", None)]
    found: dict[int, Any] = {}  # by id: samplers and datasets need not be hashable
    for obj in candidates:
        if obj is not None and id(obj) not in found and callable(getattr(obj, "set_epoch", None)):
            found[id(obj)] = obj
    return list(found.values())


def set_epoch(loader: Any, epoch: int) -> list[Any]:
    """Call ``set_epoch(epoch)`` on each of :func:`epoch_targets`; return them."""
    targets = epoch_targets(loader)
    for obj in targets:
        obj.set_epoch(epoch)
    if targets:
        log.debug("epoch %d: set_epoch on %s", epoch, ", ".join(type(t).__name__ for t in targets))
    return targets


def open_epoch(loader: Any, epoch: int) -> Iterator[Any]:
    """Start epoch ``epoch`` of ``loader`` (an iterable, or a function returning one) as a
    training loop would: ``set_epoch`` first, then ``iter()`` (where a DataLoader draws its
    order)."""
    set_epoch(loader, epoch)
    if isinstance(loader, Iterable):
        return iter(loader)
    made = loader()
    try:
        return iter(made)
    except TypeError:
        raise TypeError(
            f"the loader function {_name(loader)} returned a value of type {type(made).__name__}, not an iterable of batches"
        ) from None


def check_factory(loader: Any) -> None:
    """TypeError at once if ``loader``, a function returning the loader, cannot be called
    with no arguments (as it is, once per epoch): a function that wants the epoch, say, or the
    DataLoader class itself. Before, it failed at the first epoch, in the consumers' errors."""
    if isinstance(loader, Iterable):
        return
    try:
        inspect.signature(loader).bind()
    except ValueError:  # no signature to read (some builtins): it is called as it is
        return
    except TypeError as exc:
        raise TypeError(
            f"loader {_name(loader)} is called with no arguments once per epoch to make the loader: {exc}"
        ) from None


def _name(loader: Any) -> str:
    return getattr(loader, "__qualname__", None) or repr(loader)


def node_sampler(
    dataset: Any,
    *,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler:
    """A ``DistributedSampler`` over this node's shard of ``dataset``, for the producer of
    one node in a multi-node job: one replica per node, so the nodes' shards are disjoint
    and together cover the dataset once per epoch (padded with repeats, as
    ``DistributedSampler`` does, when its length does not divide; ``drop_last`` drops them).

    ``node_rank`` defaults to torchrun's ``GROUP_RANK``, else ``NODE_RANK`` (Lightning and
    many launch scripts); ``num_nodes`` to ``WORLD_SIZE // LOCAL_WORLD_SIZE`` (torchrun).
    The producer calls the sampler's ``set_epoch`` at each epoch, so every epoch has a new
    order, the same on every node (same ``seed``). Raises ValueError naming what is missing
    or inconsistent.
    """
    if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
        raise ValueError(f"shuffle and drop_last must be bools, got {shuffle!r} and {drop_last!r}")
    if type(seed) is not int:
        raise ValueError(f"seed must be an int, got {seed!r}")
    rank, rank_from = _node_rank(node_rank)
    nodes, nodes_from = _num_nodes(num_nodes)
    if rank >= nodes:
        raise ValueError(
            f"node rank {rank} ({rank_from}) must be below the number of nodes {nodes} ({nodes_from})"
        )
    from torch.utils.data import DistributedSampler

    return DistributedSampler(
        dataset, num_replicas=nodes, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def _node_rank(node_rank: Any) -> tuple[int, str]:
    """The node rank and where it came from."""
    if node_rank is not None:
        if type(node_rank) is not int or node_rank < 0:
            raise ValueError(f"node_rank must be an int >= 0, got {node_rank!r}")
        return node_rank, "node_rank="
    # GROUP_RANK first: under torchrun's elastic rendezvous it is the rank the node was
    # given, whatever NODE_RANK a launch script exported.
    for var in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(var, "") != "":
            return _env_int(var, minimum=0), var
    raise ValueError(
        "node_sampler needs the node's rank: pass node_rank=, run under torchrun (it sets "
        "GROUP_RANK), or set NODE_RANK"
    )


def _num_nodes(num_nodes: Any) -> tuple[int, str]:
    """The number of nodes and where it came from."""
    if num_nodes is not None:
        if type(num_nodes) is not int or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        return num_nodes, "num_nodes="
    missing = [var for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE") if os.environ.get(var, "") == ""]
    if missing:
        raise ValueError(
            f"node_sampler needs the number of nodes: pass num_nodes=, or run under torchrun, which "
            f"sets WORLD_SIZE and LOCAL_WORLD_SIZE (not set: {', '.join(missing)})"
        )
    world, local = _env_int("WORLD_SIZE", minimum=1), _env_int("LOCAL_WORLD_SIZE", minimum=1)
    if world % local:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: nodes with different "
            "numbers of processes; pass num_nodes="
        )
    return world // local, f"WORLD_SIZE // LOCAL_WORLD_SIZE = {world} // {local}"


def _env_int(var: str, minimum: int) -> int:
    raw = os.environ[var]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {var}={raw!r} must be >= {minimum}")
    return value
