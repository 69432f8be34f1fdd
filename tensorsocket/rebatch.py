"""Cut the producer's batches into batches of a consumer's own size; pure.

A consumer may ask for its own ``batch_size`` (and ``drop_last``, as torch's DataLoader takes
them) instead of the producer's. It feeds the producer's batches of one epoch, in order, to a
:class:`Rebatcher` and gets batches of its own size back: every sample exactly once per epoch, in
order. An output batch that lies inside one producer batch is made of views of it (zero-copy: it
stays in shared memory); only one that spans producer batches is assembled (``torch.cat`` /
``np.concatenate`` / list concatenation) into new, contiguous memory. At the end of the epoch
:meth:`Rebatcher.flush` returns the remainder (fewer than ``batch_size`` samples) as a last,
smaller batch, unless ``drop_last``.

Batch model: any nesting of tuple / list / dict whose leaves are torch tensors, NumPy arrays or
plain scalars (None, bool, int, float, str, bytes, NumPy scalars). Its length ``n`` is
:func:`batch_length`: dim 0 of its first tensor or array leaf with ``ndim >= 1`` (depth first, dict
order). Then:

* tensor and array leaves with ``ndim >= 1`` are per-sample: cut along dim 0. Each must have
  ``n`` rows, else ValueError naming the leaf.
* a list or tuple whose items are all plain scalars and whose length is ``n`` is per-sample too
  (``default_collate`` turns a str field into such a list): cut, staying a list or tuple. A
  batch-level scalar list whose length happens to equal ``n`` is therefore taken as per-sample.
* everything else (0-d tensors and arrays, scalars, scalar lists of another length) is
  batch-level: an output batch carries the value of the first producer batch it draws from.
* producer batches joined into one output must agree in structure: tree shape, dict keys, which
  leaves are per-sample and, for those, kind, dtype, device and shape past dim 0. A mismatch raises
  ValueError naming the path. Batches that are never joined may differ.
* a producer batch with ``n == 0`` contributes nothing; one with no per-sample tensor or array
  leaf cannot be cut and raises ValueError.
* containers come back as plain tuple / list / dict, as the consumer receives them.

Memory: a view pins the producer's shared memory (its slot cannot be reused while the view lives),
so between calls a Rebatcher holds views of the last producer batch pushed and nothing else.
Samples still pending from an earlier batch are copied out, once, when the next batch arrives
without completing an output batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

_SCALARS = (str, bytes, int, float, bool, type(None), np.generic)
_ARRAYS = (torch.Tensor, np.ndarray)
_REMEDY = "leave batch_size unset to receive the producer's batches as they are"


def batch_length(batch: Any) -> int | None:
    """Number of samples in ``batch``: dim 0 of its first tensor / array leaf with ``ndim >= 1``
    (depth first, dict order), or None if it has none."""
    if isinstance(batch, _ARRAYS):
        return int(batch.shape[0]) if batch.ndim >= 1 else None
    if isinstance(batch, dict):
        batch = batch.values()
    elif not isinstance(batch, (list, tuple)):
        return None
    for child in batch:
        n = batch_length(child)
        if n is not None:
            return n
    return None


def batches_per_epoch(samples: int, batch_size: int, drop_last: bool) -> int:
    """How many batches a Rebatcher yields for an epoch of ``samples`` samples (what ``len()`` of
    a rebatching consumer reports)."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise ValueError(f"samples must be a non-negative int, got {samples!r}")
    _check_args(batch_size, drop_last)
    return samples // batch_size if drop_last else -(-samples // batch_size)


def _check_args(batch_size: Any, drop_last: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(drop_last, bool):
        raise ValueError(f"drop_last must be a bool, got {drop_last!r}")


@dataclass
class _Piece:
    """A batch taken apart: its container skeleton (leaf indices at the leaves), its leaves in
    depth-first order, which of them are per-sample, and a (path, description) for every node
    so that two pieces can be checked for joinability with the path of the first difference."""

    n: int
    tree: Any = None
    leaves: list[Any] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)
    sig: list[tuple[str, str]] = field(default_factory=list)
    owned: bool = False  # its leaves are copies (of :func:`_own`), not views of an input


def _take_apart(batch: Any, n: int) -> _Piece:
    piece = _Piece(n)
    piece.tree = _walk(batch, "batch", piece)
    return piece


def _walk(node: Any, path: str, piece: _Piece) -> Any:
    # Module level and explicit accumulator, not a self-referencing closure: that would be a
    # reference cycle keeping the input's leaves (and its shared memory) alive until the cyclic GC.
    if isinstance(node, _ARRAYS) and node.ndim >= 1:
        if node.shape[0] != piece.n:
            raise ValueError(
                f"{path} has shape {tuple(node.shape)} but the batch has {piece.n} samples (dim 0 of "
                f"its first tensor), so it cannot be cut into samples; {_REMEDY}"
            )
        rest = ", ".join(["n", *map(str, node.shape[1:])])
        if isinstance(node, torch.Tensor):
            desc = f"per-sample tensor of {node.dtype} on {node.device} shaped ({rest})"
        else:
            desc = f"per-sample ndarray of {node.dtype} shaped ({rest})"
        return _leaf(node, path, desc, True, piece)
    if isinstance(node, (list, tuple)) and all(isinstance(x, _SCALARS) for x in node):
        if len(node) == piece.n:
            return _leaf(node, path, f"per-sample {type(node).__name__} of scalars", True, piece)
        return _leaf(node, path, "batch-level value", False, piece)
    if isinstance(node, dict):
        piece.sig.append((path, f"dict with keys {list(node)}"))
        return ("dict", [(k, _walk(v, f"{path}[{k!r}]", piece)) for k, v in node.items()])
    if isinstance(node, (list, tuple)):
        tag = "list" if isinstance(node, list) else "tuple"
        piece.sig.append((path, f"{tag} of {len(node)} items"))
        return (tag, [_walk(c, f"{path}[{i}]", piece) for i, c in enumerate(node)])
    return _leaf(node, path, "batch-level value", False, piece)


def _leaf(value: Any, path: str, desc: str, cut: bool, piece: _Piece) -> int:
    piece.sig.append((path, desc))
    piece.leaves.append(value)
    piece.cut.append(cut)
    return len(piece.leaves) - 1


def _check_joinable(before: _Piece, after: _Piece) -> None:
    # Pre-order: if the trees differ, a node differs before either list runs out.
    for (path, was), (_, now) in zip(before.sig, after.sig, strict=False):
        if was != now:
            raise ValueError(
                f"producer batches cannot be joined into one batch: {path} was a {was}, the next "
                f"producer batch has a {now} there; {_REMEDY}"
            )


def _slice(piece: _Piece, start: int, stop: int) -> _Piece:
    """Samples ``start:stop`` of ``piece``: views for tensors and arrays (``t[a:b]`` never copies)."""
    leaves = [v[start:stop] if c else v for v, c in zip(piece.leaves, piece.cut, strict=True)]
    return replace(piece, n=stop - start, leaves=leaves)


def _own(piece: _Piece) -> _Piece:
    """``piece`` with its tensors and arrays copied out of the producer's memory (batch-level 0-d
    ones too), so that the producer batch it came from can be released; ``piece`` itself if
    it holds copies already (:meth:`Rebatcher.own_pending` made them)."""
    if piece.owned:
        return piece
    copies = [
        v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v
        for v in piece.leaves
    ]
    return replace(piece, leaves=copies, owned=True)


def _assemble(pieces: list[_Piece]) -> Any:
    """One output batch from consecutive pieces: as views if there is one, else joined per leaf."""
    first = pieces[0]
    if len(pieces) == 1:
        return _rebuild(first.tree, first.leaves)
    leaves = []
    for i, (value, cut) in enumerate(zip(first.leaves, first.cut, strict=True)):
        parts = [p.leaves[i] for p in pieces]
        if not cut:
            leaves.append(value)
        elif isinstance(value, torch.Tensor):
            leaves.append(torch.cat(parts))
        elif isinstance(value, np.ndarray):
            leaves.append(np.concatenate(parts))
        else:
            leaves.append(type(value)(itertools.chain.from_iterable(parts)))
    return _rebuild(first.tree, leaves)


def _rebuild(tree: Any, leaves: list[Any]) -> Any:
    if isinstance(tree, int):
        return leaves[tree]
    tag, children = tree
    if tag == "dict":
        return {k: _rebuild(c, leaves) for k, c in children}
    items = [_rebuild(c, leaves) for c in children]
    return items if tag == "list" else tuple(items)


class Rebatcher:
    """Turns one epoch of producer batches, pushed in order, into batches of ``batch_size``.

    ``push`` each producer batch and use the batches it returns; at the end of the epoch
    ``flush`` returns the remainder (None if there is none or ``drop_last``) and readies the
    Rebatcher for the next epoch.
    """

    def __init__(self, batch_size: int, drop_last: bool = False) -> None:
        _check_args(batch_size, drop_last)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._parts: list[_Piece] = []  # pending samples; only the last piece views an input
        self._count = 0

    @property
    def pending(self) -> int:
        """Samples held for the next output batch."""
        return self._count

    def own_pending(self) -> bool:
        """Copy the pending samples out of the input they view, so that it can go (a consumer
        at its hold limit that waits for the next input); True if there was such a view."""
        if not self._parts or self._parts[-1].owned:
            return False
        self._parts[-1] = _own(self._parts[-1])
        return True

    def push(self, batch: Any, first: int = 0) -> list:
        """Feed the next producer batch; return the output batches it completes (maybe none).
        ``first``: its samples before this one were handed out already (a consumer resumed
        from a state saved inside this batch), so they are left out."""
        n = batch_length(batch)
        if n is None:
            raise ValueError(
                "batch has no tensor or array leaf with a dim 0, so it cannot be rebatched "
                f"into samples; {_REMEDY}"
            )
        if n == 0:
            return []
        piece = _take_apart(batch, n)  # validates before any state changes
        if first and (self._parts or not 0 <= first <= n):
            raise ValueError(f"first={first} must be within the batch's {n} samples, with none pending")
        out, start, size = [], first, self.batch_size
        if self._parts:
            _check_joinable(self._parts[0], piece)
            need = size - self._count
            if n < need:
                # Still no complete batch: copy the previous input's samples out so that it can go.
                self._parts[-1] = _own(self._parts[-1])
                self._parts.append(_slice(piece, 0, n))
                self._count += n
                return []
            out.append(_assemble([*self._parts, _slice(piece, 0, need)]))
            self._parts, self._count, start = [], 0, need
        while n - start >= size:
            out.append(_assemble([_slice(piece, start, start + size)]))
            start += size
        if start < n:
            self._parts, self._count = [_slice(piece, start, n)], n - start
        return out

    def flush(self) -> object | None:
        """End of epoch: the remainder batch, or None (nothing left, or ``drop_last``)."""
        parts, self._parts, self._count = self._parts, [], 0
        if not parts or self.drop_last:
            return None
        return _assemble(parts)
