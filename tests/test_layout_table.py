"""Layouts sent once, by number: the producer's table, the consumer's compiled recipes (the
same batch as layout.build, bit for bit, as views), and a stream whose layouts outgrow the
table, with a late joiner that learns the numbers from its WELCOME."""

from __future__ import annotations

import gc
import mmap
import re
import time
import weakref
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tensorsocket import Producer, layout, layout_table
from tensorsocket.errors import ProtocolError
from tensorsocket.layout_table import LayoutTable, Recipe, Recipes
from tests.support import SPAWN, same, serving, wait_until


def _random(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A 3x2 tensor of ``dtype`` with random bytes (0 or 1 for bool)."""
    size = 6 * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 2 if dtype is torch.bool else 256, size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(3, 2)


def _batches() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    every_dtype = {name: _random(d, seed) for seed, (name, d) in enumerate(layout.TORCH_DTYPES.items())}
    return {
        "every torch dtype": every_dtype,
        "nested": (
            torch.rand(4, 3, generator=g),
            [
                torch.arange(5),
                {"np": np.arange(6, dtype=np.float16).reshape(2, 3), "v": [None, 1, "s", b"b"]},
            ],
            np.float64(2.5),
            np.int8(-3),
        ),
        "zero-size and 0-d": (
            torch.zeros(0, 7),
            torch.tensor(7),
            np.zeros((0, 2), dtype=np.int32),
            np.array(1.5),
        ),
        "bool and bfloat16": (
            torch.rand(4, generator=g) > 0.5,
            torch.rand(4, generator=g).to(torch.bfloat16),
        ),
        "one tensor": torch.rand(2, 2, generator=g),
        "tuples of one, of none, of a value": (
            (torch.rand(2, generator=g),),
            (),
            {"t": (np.int8(1), None)},
            [(torch.arange(3), torch.arange(2))],
        ),
        "no leaves": {"a": None, "b": [1, 2.0]},
    }


def _written(batch: Any) -> tuple[list[Any], np.ndarray]:
    plan = layout.plan(batch)
    region = np.zeros(max(plan.nbytes, 1), dtype=np.uint8)
    layout.write(plan, torch.from_numpy(region))
    return plan.encode(), region[: plan.nbytes]


def _kinds(batch: Any) -> list[str]:
    """Each leaf's kind and read-only flag, in order (what `same` does not compare)."""
    out: list[str] = []
    layout.map_tensors(batch, lambda t: out.append(f"tensor {t.dtype}") or t)
    if isinstance(batch, np.ndarray | np.generic):
        out.append(f"numpy {type(batch).__name__} {getattr(batch, 'flags', None) and batch.flags.writeable}")
    elif isinstance(batch, dict | list | tuple):
        for child in batch.values() if isinstance(batch, dict) else batch:
            if not isinstance(child, torch.Tensor):
                out.extend(_kinds(child))
    return out


@pytest.mark.parametrize("writable", [False, True], ids=["read-only", "writable"])
@pytest.mark.parametrize("batch", _batches().values(), ids=_batches().keys())
def test_a_recipe_builds_what_layout_build_builds(batch, writable):
    encoded, region = _written(batch)
    region.flags.writeable = writable
    recipe = Recipe(encoded)
    tree, leaves = layout.check(encoded, region.size)
    expected = layout.build(tree, leaves, region)
    got = recipe.build(region)
    assert same(got, expected) and same(got, batch)
    assert _kinds(got) == _kinds(expected)
    # and from a torch region (what a GPU reader leases): torch's own views
    assert same(recipe.build(torch.from_numpy(region.copy())), expected)


def test_recipe_views_are_zero_copy_and_keep_the_region_alive():
    """As the shm reader leases it: a region over a mapping, a finalizer on the region (the
    release), which must fire only once the last view is gone."""
    batch = (torch.rand(8, 4), np.arange(3, dtype=np.int64))
    encoded, written = _written(batch)
    mapping = mmap.mmap(-1, written.size)
    mapping[:] = written.tobytes()
    region = np.frombuffer(mapping, dtype=np.uint8)
    released = []
    weakref.finalize(region, released.append, True)
    tensor, array = Recipe(encoded).build(region)
    start = region.ctypes.data
    assert start <= tensor.data_ptr() < start + region.size
    assert start <= array.ctypes.data < start + region.size
    assert not array.flags.writeable
    del region
    gc.collect()
    assert released == [] and same((tensor, array), batch)  # the views hold the region
    del tensor
    gc.collect()
    assert released == []
    del array
    gc.collect()
    assert released == [True]


def test_a_recipe_counts_the_samples_batch_length_counts():
    encoded, region = _written({"meta": ["x"], "x": torch.zeros(5, 2), "y": torch.zeros(3)})
    recipe = Recipe(encoded)
    assert recipe.count(recipe.build(region)) == 5


def num(table: LayoutTable, encoded: list[Any]) -> Any:
    return table.number(encoded, layout_table.key(encoded))


def test_the_table_numbers_a_layout_seen_again_and_announces_it_once():
    table = LayoutTable()
    a, b = layout.plan(torch.zeros(2, 3)).encode(), layout.plan((torch.zeros(2), 1)).encode()
    assert num(table, a) == (a, None)  # seen once: inline (a one-off must not take a number)
    assert num(table, b) == (b, None)
    assert num(table, b) == (0, [0, b])
    assert num(table, a) == (1, [1, a])
    assert num(table, a) == (1, None) and num(table, b) == (0, None)
    assert table.entries == [[0, b], [1, a]]


def test_layouts_seen_once_long_ago_are_forgotten():
    table = LayoutTable()
    first = layout.plan(torch.zeros(1)).encode()
    num(table, first)
    for n in range(300):
        num(table, layout.plan(torch.zeros(n + 2)).encode())
    assert num(table, first) == (first, None)  # a first sight again
    assert table.entries == []


def _numbered(table: LayoutTable, encoded: list[Any]) -> Any:
    num(table, encoded)
    return num(table, encoded)[0]


def test_a_full_table_sends_new_layouts_inline():
    table = LayoutTable()
    for n in range(layout_table.MAX_LAYOUTS):
        assert _numbered(table, layout.plan(torch.zeros(n + 1)).encode()) == n
    extra = layout.plan(torch.zeros(1000)).encode()
    assert _numbered(table, extra) == extra
    assert num(table, layout.plan(torch.zeros(5)).encode()) == (4, None)  # the known still are
    big = LayoutTable()
    huge = layout.plan({f"k{i:06d}": 0 for i in range(100_000)}).encode()  # over MAX_TABLE_BYTES
    assert _numbered(big, huge) == huge and big.entries == []


def test_recipes_refuse_unknown_numbers_and_too_many_layouts():
    recipes = Recipes([[3, layout.plan(torch.zeros(2)).encode()]])
    assert recipes.get(3).nbytes == 256  # one aligned leaf
    with pytest.raises(ProtocolError, match="not announced"):
        recipes.get(4)
    with pytest.raises(ProtocolError):
        recipes.define(5, ["not", "a layout"])
    for n in range(layout_table.MAX_LAYOUTS - 1):
        recipes.define(100 + n, layout.plan(torch.zeros(1)).encode())
    recipes.define(3, layout.plan(torch.zeros(1)).encode())  # a number again: replaced, not added
    with pytest.raises(ProtocolError, match="more than"):
        recipes.define(999, layout.plan(torch.zeros(1)).encode())


# --- a stream whose layouts outgrow the table ------------------------------------------------

BATCHES = layout_table.MAX_LAYOUTS + 16


def many_shapes(index: int) -> Any:
    """Batch ``index``: layouts that repeat from the first batches on (numbered early), then a
    new layout (width) per batch, enough to fill the table, then layouts seen before; with a
    plain value that repeats every 3."""
    width = 1 + (index % 2 if index < 8 else index if index < BATCHES - 8 else index % 5)
    g = torch.Generator().manual_seed(index)
    return torch.rand(2, width, generator=g), {"i": torch.tensor([index]), "s": f"b{index % 3}"}


class ManyShapes:
    def __len__(self) -> int:
        return BATCHES

    def __iter__(self) -> Any:
        for i in range(BATCHES):
            time.sleep(0.01)  # a stream that lasts while the late joiner joins
            yield many_shapes(i)


def consume_many(name: str, late: bool, go: Any, results: Any) -> None:
    from tensorsocket import Consumer

    report: dict[str, Any] = {"late": late, "bad": [], "seen": [], "error": None}
    try:
        go.wait(60)
        with Consumer(name=name, timeout=30, late_join="replay" if late else "now") as consumer:
            for epoch in range(2):
                for batch in consumer:
                    index = int(batch[1]["i"])
                    report["seen"].append((epoch, index))
                    if not same(batch, many_shapes(index)):
                        report["bad"].append((epoch, index))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


def test_layouts_past_the_table_travel_inline_and_a_late_joiner_gets_the_numbers(name):
    results, go_first, go_late = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    procs = [
        SPAWN.Process(target=consume_many, args=(name, late, go, results))
        for late, go in ((False, go_first), (True, go_late))
    ]
    for p in procs:
        p.start()
    producer = Producer(ManyShapes(), name=name, slots=4, replay=1 << 24, min_consumers=1)
    with serving(producer, epochs=2) as (thread, errors):
        go_first.set()
        wait_until(lambda: producer.status()["next_seq"] >= BATCHES // 2, 60, "half an epoch published")
        assert (
            producer._shared.layouts.entries
        )  # numbered already: the late joiner learns them in its WELCOME
        go_late.set()  # joins mid-stream, and replays the epoch from its start
        thread.join(120)
        assert not errors, errors
    reports = {r["late"]: r for r in (results.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(30)
    whole = [(e, i) for e in range(2) for i in range(BATCHES)]
    for report in reports.values():
        assert report["error"] is None and report["bad"] == [], report
    assert reports[False]["seen"] == whole
    # The late joiner replays the epoch it joined in from its start (epoch 0, or 1 when under
    # load it joined after epoch 0 ended), then goes on: whole epochs, each from index 0.
    late = reports[True]["seen"]
    epochs = len(late) // BATCHES
    assert epochs in (1, 2) and late == [(e, i) for e in range(epochs) for i in range(BATCHES)], late
    assert len(producer._shared.layouts.entries) == layout_table.MAX_LAYOUTS  # the table did fill


def test_recipes_refuse_more_leaves_in_all_than_one_batch_may_have():
    wide = layout.plan([torch.zeros(1)] * 40_000).encode()
    recipes = Recipes([[0, wide]])
    recipes.define(0, wide)  # the same number again: counted once
    with pytest.raises(ProtocolError, match="leaves in all"):
        recipes.define(1, wide)


def test_the_last_layout_is_reused_only_while_it_is_the_same():
    last = layout_table.LastLayout()
    x = torch.zeros(4, 3)
    first, key = last.encode(layout.plan((x, torch.arange(4))))
    again, same = last.encode(layout.plan((x + 1, torch.arange(4, 8))))  # other bytes, same layout
    assert again is first and same == key
    other, other_key = last.encode(layout.plan((torch.zeros(5, 3), torch.arange(5))))
    assert other_key != key and other == layout.plan((torch.zeros(5, 3), torch.arange(5))).encode()
    # Plain values compare equal across types and signs, but travel as they are
    for a, b in ((1, True), (0.0, -0.0), (1, 1.0)):
        encoded_a, key_a = last.encode(layout.plan({"x": x, "v": a}))
        encoded_b, key_b = last.encode(layout.plan({"x": x, "v": b}))
        assert key_a != key_b, (a, b)
        assert msgpack.packb(encoded_b) == msgpack.packb(layout.plan({"x": x, "v": b}).encode())


def _same_plan(a: layout.Plan, b: layout.Plan) -> bool:
    return (
        a.tree == b.tree
        and a.leaves == b.leaves
        and a.nbytes == b.nbytes
        and a.values == b.values
        and len(a.sources) == len(b.sources)
        and all(
            type(s) is type(t)
            and same(s, t)
            and getattr(s, "requires_grad", False) == getattr(t, "requires_grad", False)
            for s, t in zip(a.sources, b.sources, strict=True)
        )
    )


class _Point(tuple):
    """A tuple subclass (a namedtuple-like batch)."""


def _followers(x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    """Batches to plan after ``(x, y)``: some laid out as it, most differing in one way."""
    grad = x.clone().requires_grad_()
    return [
        (x + 1, y + 1),  # the same layout
        [x, y],  # a list
        _Point((x, y)),  # a tuple subclass
        (x, y, y),  # one more leaf
        (x.double(), y),  # another dtype
        (torch.zeros(5, 3), y),  # another shape
        (x.t(), y),  # not contiguous
        (grad, y),  # requires grad: detached
        (torch.zeros(4, 3, dtype=torch.complex64).conj(), y),  # conjugated
        (x.numpy(), y),  # a NumPy leaf
        (x, 7),  # a plain value
        ((x,), y),  # nested
        {"x": x, "y": y},
        {"x": x + 2, "y": y},  # the dict again
        {"y": y, "x": x},  # its keys in another order
        {"x": x, "z": y},  # another key
        {1: x, "y": y},  # an int key
        {True: x, "y": y},  # a bool key (refused)
        {"x": x, "y": y, "z": y},
        (x, y),
    ]


def test_a_batch_laid_out_as_the_last_is_planned_as_layout_plan_plans_it():
    """LastLayout.plan gives what layout.plan gives for every batch, whatever came before it."""
    x, y = torch.rand(4, 3), torch.arange(4)
    for before in [(x, y), [x, y], {"x": x, "y": y}, _Point((x, y)), (x.numpy(), y), {1: x, "y": y}]:
        for after in _followers(x, y):
            last = layout_table.LastLayout()
            last.plan(before)
            try:
                expected = layout.plan(after)
            except TypeError as exc:
                with pytest.raises(TypeError, match=re.escape(str(exc))):
                    last.plan(after)
                continue
            assert _same_plan(last.plan(after), expected), (before, after)


def test_a_repeated_layout_is_not_walked_again():
    """A batch that repeats the last one's layout gets its tree and leaves, the very objects
    (so encode() knows it at once); one that differs in any way is walked."""
    x, y = torch.rand(4, 3), torch.arange(4)
    for first_batch, again_batch in [
        ((x, y), (x + 1, y + 1)),
        ([x, y], [x, y]),
        (_Point((x, y)), _Point((x * 2, y))),
        ({"x": x, "y": y}, {"x": x * 2, "y": y}),
    ]:
        last = layout_table.LastLayout()
        first = last.plan(first_batch)
        again = last.plan(again_batch)
        assert again.tree is first.tree and again.leaves is first.leaves, first_batch
        assert list(again.sources) == list(
            again_batch.values() if isinstance(again_batch, dict) else again_batch
        )
    for after in _followers(x, y)[1:-1]:  # (all but the first and last differ from (x, y))
        last = layout_table.LastLayout()
        first = last.plan((x, y))
        try:
            assert last.plan(after).leaves is not first.leaves, after
        except TypeError:  # (refused, as layout.plan refuses it: the test above)
            pass
    last = layout_table.LastLayout()
    last.plan({1: x, "y": y})  # (an int key: not reused, since 1 == True)
    with pytest.raises(TypeError, match="has key True"):
        last.plan({True: x, "y": y})


def test_a_repeated_layout_still_refuses_what_layout_plan_refuses():
    """A leaf that cannot be shared raises the same TypeError after a batch of that layout."""
    x, y = torch.rand(4, 3), torch.arange(4)
    for bad in [(torch.empty(4, 3, device="meta"), y), (x.to_sparse(), y)]:
        last = layout_table.LastLayout()
        last.plan((x, y))
        with pytest.raises(TypeError, match="dense tensors"):
            last.plan(bad)


def test_a_leaf_that_differs_only_in_how_it_lies_in_memory_is_walked():
    """The same dtype and shape as the last batch's leaf, but not contiguous, a negative or
    conjugate view, needing grad: planned as layout.plan plans it (made contiguous, resolved,
    detached), not taken as it is."""
    x, c, y = torch.rand(4, 3), torch.rand(4, 3, dtype=torch.complex64), torch.arange(4)
    for first, odd in [
        ((x, y), (torch.rand(3, 4).t(), y)),
        ((x, y), (torch._neg_view(torch.rand(4, 3)), y)),
        ((x, y), (torch.rand(4, 3, requires_grad=True), y)),
        ((c, y), (torch.rand(4, 3, dtype=torch.complex64).conj(), y)),
    ]:
        last = layout_table.LastLayout()
        reference = last.plan(first)
        planned = last.plan(odd)
        assert planned.leaves is not reference.leaves
        expected = layout.plan(odd)
        assert _same_plan(planned, expected)
        source = planned.sources[0]
        assert (
            source.is_contiguous()
            and not source.is_neg()
            and not source.is_conj()
            and not source.requires_grad
        )
