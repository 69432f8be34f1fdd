"""Layouts sent once, by number; pure.

Almost every loader repeats a handful of layouts (the same tensors of the same shapes, a
short last batch). Checking and re-encoding the same layout for every batch was a fifth of a
consumer's CPU with small batches, so a producer numbers the layouts it publishes
(:class:`LayoutTable`) and announces each once: in a LAYOUT message to the consumers joined,
in WELCOME to one that joins later. A BATCH then carries the number. A consumer checks each
announced layout once, when it arrives, and keeps it compiled for building views
(:class:`Recipes`, :class:`Recipe`).

Layouts that change with every batch (variable-length sequences, or plain values such as file
names, which travel inside the layout) would fill any table: a layout is numbered the second
time it is seen, and past :data:`MAX_LAYOUTS` (or :data:`MAX_TABLE_BYTES`) a batch carries its
layout inline, checked and built as before.
"""

from __future__ import annotations

import hashlib
import operator
import threading
import warnings
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from . import layout
from .errors import ProtocolError
from .rebatch import batch_length

_from_numpy = torch.from_numpy
_as_is = layout.taken_as_is

MAX_LAYOUTS = 64  # numbered per stream; each consumer keeps them all
MAX_TABLE_BYTES = 1 << 20  # their encoded size together (a WELCOME carries them all)
_SEEN_ONCE = 256  # the last layouts seen once: one of them seen again is numbered
_ANY_SIZE = 1 << 62  # a numbered layout is checked before any arena: the BATCH's arena is checked then


class LayoutTable:
    """Producer side: the layouts numbered so far (never renumbered: a BATCH kept for replay
    names its layout for as long as the stream lasts). Used under the producer's lock."""

    def __init__(self) -> None:
        # by key(): a digest, so what is kept of a layout seen once is 16 bytes, whatever its size
        self._numbers: dict[bytes, int] = {}
        self._seen_once: dict[bytes, None] = {}  # oldest first
        self.entries: list[list[Any]] = []  # [number, layout] as WELCOME carries them
        self._bytes = 0

    def number(self, encoded: list[Any], key: tuple[bytes, int]) -> tuple[int | list[Any], list[Any] | None]:
        """What a BATCH with this layout (and its :func:`key`) carries: its number, or the
        layout itself; and the ``[number, layout]`` to announce before it when it is new."""
        key, size = key
        known = self._numbers.get(key)
        if known is not None:
            return known, None
        if len(self.entries) >= MAX_LAYOUTS or self._bytes + size > MAX_TABLE_BYTES:
            return encoded, None
        if key not in self._seen_once:  # a first sight: one-off layouts must not fill the table
            self._seen_once[key] = None
            if len(self._seen_once) > _SEEN_ONCE:
                del self._seen_once[next(iter(self._seen_once))]
            return encoded, None
        del self._seen_once[key]
        known = self._numbers[key] = len(self.entries)
        entry = [known, encoded]
        self.entries.append(entry)
        self._bytes += size
        return known, entry


def key(encoded: list[Any]) -> tuple[bytes, int]:
    """A layout's key in the table: a digest of its encoding, and the encoding's size."""
    packed = msgpack.packb(encoded, use_bin_type=True)
    return hashlib.blake2b(packed, digest_size=16).digest(), len(packed)


class LastLayout:
    """Producer side: the last batch's layout, planned, encoded and keyed. Almost every batch
    repeats it, and encoding, packing and digesting it again was ~3 us of a tiny batch's ~85 us of the
    producer's CPU (2-core VM). A layout is the same when its leaves and tree are equal; a tree
    with plain values is always encoded again (``1 == True``: only the encoding tells).

    Planning it again was more: walking a tuple of two tensors and making its leaves took ~10 us
    in a hot loop. So a batch laid out as the last one, when that was a tuple, list or dict (of
    the same str keys, in order) of tensors, is checked leaf by leaf: a tensor of the last one's
    dtype and shape that :func:`layout.plan` takes as it is (:func:`layout.taken_as_is`). Then
    it gets the last plan's tree and leaves, the very objects, with its own tensors as sources:
    ~3 us, the plan :func:`layout.plan` makes, and :meth:`encode` knows it at once. Any other
    batch goes the long way."""

    def __init__(self) -> None:
        self._leaves: tuple[layout.Leaf, ...] | None = None
        self._tree: Any = None
        self._encoded: list[Any] = []
        self._key: tuple[bytes, int] = (b"", 0)
        self._last: layout.Plan | None = None  # the last plan, if of a flat batch of tensors
        self._kind: type = tuple  # that batch's type
        self._keys: list[str] | None = None  # its keys, if a dict
        self._specs: list[tuple[torch.dtype, tuple[int, ...]]] = []  # its tensors' dtypes and shapes

    def plan(self, batch: Any) -> layout.Plan:
        """:func:`layout.plan` of ``batch``, without walking it when it repeats the last one's layout."""
        last = self._last
        if last is not None and type(batch) is self._kind and len(batch) == len(self._specs):
            tensors = batch if self._keys is None else batch.values() if list(batch) == self._keys else ()
            sources = []
            for t, (dtype, shape) in zip(tensors, self._specs, strict=False):  # (() if the keys differ)
                if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape):
                    break
                sources.append(t)
            if len(sources) == len(self._specs) and _as_is(sources):
                return layout.Plan(last.tree, last.leaves, tuple(sources), last.nbytes)
        plan = layout.plan(batch)
        self._remember(batch, plan)
        return plan

    def _remember(self, batch: Any, plan: layout.Plan) -> None:
        tag, children = plan.tree
        keys = [k for k, _ in children] if tag == layout.DICT else None
        nodes = [node for _, node in children] if keys is not None else children
        flat = tag in (layout.TUPLE, layout.LIST, layout.DICT) and not plan.values
        if not (flat and all(node[0] == layout.TENSOR for node in nodes)) or (
            keys is not None and not all(type(k) is str for k in keys)
        ):
            self._last = None
            return
        self._last, self._kind, self._keys = plan, type(batch), keys
        self._specs = [(t.dtype, leaf.shape) for t, leaf in zip(plan.sources, plan.leaves, strict=True)]

    def encode(self, plan: layout.Plan) -> tuple[list[Any], tuple[bytes, int]]:
        """``plan``'s layout as it travels, and its :func:`key`."""
        if plan.leaves == self._leaves and not plan.values and plan.tree == self._tree:
            return self._encoded, self._key
        encoded = plan.encode()
        self._leaves, self._tree, self._encoded, self._key = plan.leaves, plan.tree, encoded, key(encoded)
        return encoded, self._key


_quiet = threading.Lock()
_warned = False


def _quiet_read_only() -> None:
    """Spend torch's one warning (``TORCH_WARN_ONCE``) about tensors over read-only arrays here,
    swallowed: every :class:`Recipe` calls it when it is made, and views are then made straight
    over read-only mappings (read-only on purpose)."""
    global _warned
    with _quiet:
        if not _warned:
            read_only = np.zeros(1, dtype=np.uint8)
            read_only.flags.writeable = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.from_numpy(read_only)
            _warned = True


class Recipes:
    """Consumer side: the layouts announced on this stream, checked and compiled."""

    def __init__(self, entries: list[list[Any]] = ()) -> None:  # type: ignore[assignment]
        self._by_number: dict[int, Recipe] = {}
        self._leaves = 0  # in the layouts kept: a producer cannot make us keep more than a batch's worth
        for number, encoded in entries:
            self.define(number, encoded)

    def define(self, number: int, encoded: Any) -> None:
        """Check an announced layout (ProtocolError if malformed, or one too many)."""
        if number not in self._by_number and len(self._by_number) >= MAX_LAYOUTS:
            raise ProtocolError(f"producer announced more than {MAX_LAYOUTS} layouts")
        recipe = Recipe(encoded)
        old = self._by_number.get(number)
        self._leaves += len(recipe.leaves) - (len(old.leaves) if old is not None else 0)
        if self._leaves > layout.MAX_LEAVES:
            raise ProtocolError(f"producer announced layouts of more than {layout.MAX_LEAVES} leaves in all")
        self._by_number[number] = recipe

    def get(self, ref: Any) -> Recipe:
        """The recipe a BATCH names: by number, or inline (checked now)."""
        if type(ref) is int:
            recipe = self._by_number.get(ref)
            if recipe is None:
                raise ProtocolError(f"BATCH names layout {ref}, which was not announced")
            return recipe
        return Recipe(ref, compiled=False)  # used once: checked, not compiled


class Recipe:
    """A checked layout, compiled: for each leaf the slice of the region it reads and how to
    view it, so a batch is built in a few NumPy steps per leaf (a torch slice-and-view chain
    costs ~3x as much)."""

    def __init__(self, encoded: Any, compiled: bool = True) -> None:
        _quiet_read_only()  # (its batches' regions may be read-only mappings)
        self.tree, self.leaves = layout.check(encoded, _ANY_SIZE)
        self.nbytes: int = encoded[2]
        tags: dict[int, str] = {}
        if compiled:
            _tags(self.tree, tags)
        self._host = (
            [_host_step(leaf, tags.get(i, layout.TENSOR)) for i, leaf in enumerate(self.leaves)]
            if compiled
            else None
        )
        self._assemble = _assembler(self.tree) if compiled else None
        # Every leaf a tensor with a NumPy twin (the usual batch): (shape, twin, offset) each,
        # viewed in one comprehension instead of a step's call per leaf
        twins = [_NUMPY_TWINS.get(leaf.dtype) for leaf in self.leaves]
        self._tensors = (
            [(leaf.shape, twin, leaf.offset) for leaf, twin in zip(self.leaves, twins, strict=True)]
            if compiled
            and all(tags.get(i, layout.TENSOR) == layout.TENSOR for i in range(len(twins)))
            and all(twin is not None for twin in twins)
            else None
        )
        self.samples: int | None = None  # of a built batch (rebatch.batch_length), from the first one
        self.counted = False  # samples is known (the consumer reads it without calling count())

    def build(self, region: torch.Tensor | np.ndarray) -> Any:
        """The batch as views of ``region`` (see :func:`layout.build`; same result)."""
        if self._host is None or not isinstance(region, np.ndarray):  # torch's own views
            return layout.build(self.tree, self.leaves, region)
        if self._tensors is not None:  # (what each leaf's step does, without the calls)
            views = [_from_numpy(np.ndarray(shape, twin, region, at)) for shape, twin, at in self._tensors]
            return self._assemble(views)  # type: ignore[misc]
        return self._assemble([step(region) for step in self._host])  # type: ignore[misc]

    def count(self, batch: Any) -> int | None:
        """The samples in a batch built from this recipe (the same for every one)."""
        if not self.counted:
            self.samples, self.counted = batch_length(batch), True
        return self.samples


def _tags(node: list[Any], tags: dict[int, str]) -> None:
    tag, payload = node
    if tag in (layout.TUPLE, layout.LIST):
        for child in payload:
            _tags(child, tags)
    elif tag == layout.DICT:
        for _, child in payload:
            _tags(child, tags)
    elif tag != layout.VALUE:
        tags[payload] = tag


def _numpy_twins() -> dict[str, np.dtype]:
    """The torch dtypes (by wire name) that torch.from_numpy makes from a NumPy dtype."""
    twins = {}
    for code in "?bBhHiIlLefdFD":
        try:
            dtype = torch.from_numpy(np.empty(0, dtype=code)).dtype
        except TypeError:  # a NumPy dtype torch has no twin for
            continue
        twins[layout.TORCH_NAMES[dtype]] = np.dtype(code)
    return twins


_NUMPY_TWINS = _numpy_twins()  # bfloat16, the float8s, complex32 ... have none


def _host_step(leaf: layout.Leaf, tag: str) -> Any:
    """A function of the host region that returns this leaf's view (as layout.build makes it)."""
    # (np.ndarray over the region, at the leaf's offset: one call where a slice, a view and a
    # reshape were three, ~0.4 us a leaf less; the layout was checked to fit, and the array's
    # base is the region, so the region lives while it does)
    start, end, shape = leaf.offset, leaf.offset + leaf.nbytes, leaf.shape
    if tag == layout.TENSOR:
        twin = _NUMPY_TWINS.get(leaf.dtype)
        if twin is not None:
            return lambda region: _from_numpy(np.ndarray(shape, twin, region, start))
        dtype = layout.TORCH_DTYPES[leaf.dtype]
        if leaf.nbytes == 0:
            return lambda region: torch.empty(shape, dtype=dtype)
        return lambda region: _from_numpy(region[start:end]).view(dtype).view(shape)
    np_dtype = np.dtype(leaf.dtype)

    def array(region: np.ndarray) -> Any:
        a = np.ndarray(shape, np_dtype, region, start)
        a.flags.writeable = False
        return a[()] if tag == layout.NPSCALAR else a

    return array


_BRANCHES = (layout.TUPLE, layout.LIST, layout.DICT)


def _assembler(node: list[Any]) -> Callable[[list[Any]], Any]:
    """A function that puts a batch's leaf views into the layout's tree, made once per layout
    (walking the tree for every batch was ~4 us of a 2-leaf batch's ~50 us)."""
    tag, payload = node
    if tag == layout.VALUE:
        return lambda views: payload
    if tag not in _BRANCHES:
        return operator.itemgetter(payload)  # a leaf: its view
    if tag == layout.DICT:
        pairs = [(key, _assembler(child)) for key, child in payload]
        return lambda views: {key: part(views) for key, part in pairs}
    parts = [_assembler(child) for child in payload]
    if tag == layout.LIST:
        return lambda views: [part(views) for part in parts]
    if len(payload) >= 2 and all(child[0] not in (*_BRANCHES, layout.VALUE) for child in payload):
        return operator.itemgetter(*(child[1] for child in payload))  # a tuple of leaves: one C call
    return lambda views: tuple([part(views) for part in parts])
