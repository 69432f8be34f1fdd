"""Tests for tensorsocket.rebatch: samples in order exactly once, sizes and counts, batch-level
values carried, zero-copy views vs assembled joins, error messages, and that no input batch is
kept alive longer than the pending samples need it."""

from __future__ import annotations

import copy
import re
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorsocket.rebatch import Rebatcher, batch_length, batches_per_epoch

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- helpers


def make_batch(start: int, n: int, index: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """Producer batch of samples ``start:start+n``; every sample's values are distinct. ``meta``
    and ``scalar`` are batch-level and tell which producer batch (``index``) they came from.
    Leaves are fresh (no ``_base`` / ``.base``) so a weakref to them tracks what slices pin."""
    images = torch.arange(start * 12, (start + n) * 12, dtype=torch.float32).reshape(n, 3, 2, 2).clone()
    return (
        images,
        {
            "label": torch.arange(start, start + n, dtype=torch.int64),
            "np": np.arange(2 * start, 2 * (start + n), dtype=np.int32).reshape(n, 2).copy(),
            "path": [f"s{i}" for i in range(start, start + n)],
            "meta": 7 + index,
            "scalar": torch.tensor(1.5 + index),
        },
    )


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def owned(batch: Any) -> Any:
    """A copy of an output batch that shares no memory with anything."""
    images, d = batch
    return images.clone(), {
        k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in d.items()
    }


def joined(batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, list[str]]:
    return (
        torch.cat([b[0] for b in batches]) if batches else torch.empty(0, 3, 2, 2),
        torch.cat([b[1]["label"] for b in batches]) if batches else torch.empty(0, dtype=torch.int64),
        np.concatenate([b[1]["np"] for b in batches]) if batches else np.empty((0, 2), np.int32),
        [p for b in batches for p in b[1]["path"]],
    )


def run_epoch(rb: Rebatcher, lengths: list[int], start: int = 0) -> list[Any]:
    out, offset = [], start
    for i, n in enumerate(lengths):
        out += rb.push(make_batch(offset, n, i))
        offset += n
    last = rb.flush()
    return out if last is None else [*out, last]


def expected_sizes(total: int, batch_size: int, drop_last: bool) -> list[int]:
    sizes = [batch_size] * (total // batch_size)
    return sizes + [total % batch_size] if total % batch_size and not drop_last else sizes


@st.composite
def producer_lengths(draw: st.DrawFn) -> list[int]:
    """Full producer batches, a ragged last one, and 0-length ones anywhere."""
    size = draw(st.integers(1, 100))
    lengths = [size] * draw(st.integers(0, 6)) + [draw(st.integers(0, size))]
    for _ in range(draw(st.integers(0, 3))):
        lengths.insert(draw(st.integers(0, len(lengths))), 0)
    return lengths


# ---------------------------------------------------------------------------- properties


@FAST
@given(
    lengths=st.one_of(producer_lengths(), st.lists(st.integers(0, 120), max_size=8)),
    batch_size=st.integers(1, 150),
    drop_last=st.booleans(),
)
def test_samples_in_order_exactly_once(lengths: list[int], batch_size: int, drop_last: bool) -> None:
    rb = Rebatcher(batch_size, drop_last)
    total = sum(lengths)
    # Where each producer batch starts, and its images' storage, to check views and carried values.
    starts = np.cumsum([0, *lengths])
    ptrs: dict[int, int] = {}
    refs: list[list[weakref.ref]] = []
    outputs: list[Any] = []
    holder = -1  # the last non-empty producer batch: the only one pending samples may still view

    def check(out: Any) -> None:
        k = len(outputs)
        images, d = out
        first = k * batch_size
        source = max(i for i, n in enumerate(lengths) if n and starts[i] <= first)  # it draws from it first
        assert d["meta"] == 7 + source and d["scalar"].ndim == 0 and d["scalar"].item() == 1.5 + source
        assert images.dtype == torch.float32 and d["label"].dtype == torch.int64 and d["np"].dtype == np.int32
        assert type(d["path"]) is list
        inside = first + len(images) <= starts[source + 1]
        if inside:  # lies inside one producer batch: a view of it
            assert ptr(images) == ptrs[source]
        else:  # spans producer batches: assembled into new memory (earlier inputs' may be reused)
            assert ptr(images) != ptrs[holder] and images._base is None and images.is_contiguous()
            assert d["label"]._base is None and d["np"].base is None and d["label"].is_contiguous()
        outputs.append(owned(out))

    for i, n in enumerate(lengths):
        batch = make_batch(int(starts[i]), n, i)
        ptrs[i] = ptr(batch[0])
        refs.append([weakref.ref(batch[0]), weakref.ref(batch[1]["label"]), weakref.ref(batch[1]["scalar"])])
        holder, out = (i if n else holder), None
        for out in rb.push(batch):
            check(out)
        del batch, out
        assert all(r() is None for group in refs[:holder] for r in group), "an earlier input is still alive"
    last = rb.flush()
    if last is not None:
        check(last)
    del last
    assert rb.pending == 0
    assert all(r() is None for group in refs for r in group)

    sizes = [len(b[0]) for b in outputs]
    assert sizes == expected_sizes(total, batch_size, drop_last)
    assert len(outputs) == batches_per_epoch(total, batch_size, drop_last)
    kept = len(outputs) * batch_size if drop_last else total
    images, labels, arrays, paths = joined(outputs)
    want = make_batch(0, kept)
    assert torch.equal(images.view(torch.int32), want[0].view(torch.int32))  # bit for bit
    assert torch.equal(labels, want[1]["label"])
    assert np.array_equal(arrays, want[1]["np"])
    assert paths == want[1]["path"]


# ---------------------------------------------------------------------------- examples


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [16, 48, 64, 96, 100, 128])
def test_producer_64_matrix_over_two_epochs(batch_size: int, drop_last: bool) -> None:
    lengths = [64] * 5 + [37]  # 357 samples, ragged final producer batch
    total = sum(lengths)
    rb = Rebatcher(batch_size, drop_last=drop_last)
    for _ in range(2):  # flush resets: the second epoch comes out exactly like the first
        outputs = run_epoch(rb, lengths)
        assert rb.pending == 0
        assert [len(b[0]) for b in outputs] == expected_sizes(total, batch_size, drop_last)
        assert len(outputs) == batches_per_epoch(total, batch_size, drop_last)
        kept = sum(len(b[0]) for b in outputs)
        assert kept == (total // batch_size * batch_size if drop_last else total)
        images, labels, arrays, paths = joined(outputs)
        want = make_batch(0, kept)
        assert torch.equal(images, want[0]) and torch.equal(labels, want[1]["label"])
        assert np.array_equal(arrays, want[1]["np"]) and paths == want[1]["path"]


def test_expected_counts() -> None:
    assert batches_per_epoch(357, 100, False) == 4 and batches_per_epoch(357, 100, True) == 3
    assert batches_per_epoch(300, 100, False) == 3 == batches_per_epoch(300, 100, True)
    assert batches_per_epoch(0, 8, False) == 0
    with pytest.raises(ValueError, match="samples"):
        batches_per_epoch(-1, 8, False)


@pytest.mark.parametrize("batch_size", [8, 16, 32, 64])
def test_divisor_batch_size_is_zero_copy(batch_size: int) -> None:
    inputs = [make_batch(64 * i, 64, i) for i in range(3)] + [make_batch(192, 40, 3)]
    rb = Rebatcher(batch_size)
    outputs = [out for b in inputs for out in rb.push(b)]
    last = rb.flush()
    outputs += [] if last is None else [last]
    assert sum(len(b[0]) for b in outputs) == 232
    input_ptrs = {ptr(b[0]) for b in inputs}
    label_ptrs = {ptr(b[1]["label"]) for b in inputs}
    for images, d in outputs:
        assert ptr(images) in input_ptrs and ptr(d["label"]) in label_ptrs
        assert images._base is not None  # a view, not a copy
        assert any(np.shares_memory(d["np"], b[1]["np"]) for b in inputs)


def test_spanning_batches_are_assembled_and_the_rest_are_views() -> None:
    a, b = make_batch(0, 64, 0), make_batch(64, 64, 1)
    rb = Rebatcher(48)
    first = rb.push(a)
    second = rb.push(b)
    assert len(first) == 1 and len(second) == 1
    assert ptr(first[0][0]) == ptr(a[0])  # samples 0..47 lie inside a
    spanning = second[0]  # samples 48..95 span a and b
    assert ptr(spanning[0]) not in (ptr(a[0]), ptr(b[0])) and spanning[0].is_contiguous()
    assert not np.shares_memory(spanning[1]["np"], a[1]["np"]) and not np.shares_memory(
        spanning[1]["np"], b[1]["np"]
    )
    assert spanning[1]["meta"] == 7 and spanning[1]["scalar"].item() == 1.5  # from a, the first it draws from
    assert spanning[1]["path"] == [f"s{i}" for i in range(48, 96)]
    remainder = rb.flush()  # samples 96..127 lie inside b
    assert ptr(remainder[0]) == ptr(b[0]) and remainder[1]["meta"] == 8
    assert torch.equal(remainder[0], b[0][32:])


def test_scalar_lists_tuples_and_batch_level_values() -> None:
    def batch(start: int, n: int, tag: str) -> dict[str, Any]:
        return {
            "x": torch.arange(start, start + n),
            "ids": tuple(range(start, start + n)),  # per-sample, stays a tuple
            "classes": ["cat", "dog", tag],  # batch-level: length 3 != n
            "zero_d": np.array(tag),
            "nested": [{"w": np.arange(start, start + n, dtype=np.float64)}, None],
        }

    rb = Rebatcher(4)
    out = rb.push(batch(0, 6, "a")) + rb.push(batch(6, 5, "b"))
    last = rb.flush()
    assert [o["x"].tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out[1]["ids"] == (4, 5, 6, 7) and out[1]["classes"] == ["cat", "dog", "a"]
    assert out[1]["zero_d"] == "a" and out[1]["nested"][1] is None
    assert out[1]["nested"][0]["w"].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert last["ids"] == (8, 9, 10) and last["classes"][2] == "b" and last["x"].tolist() == [8, 9, 10]


def test_zero_length_batches_contribute_nothing() -> None:
    rb = Rebatcher(3)
    assert rb.push(make_batch(0, 0)) == []
    assert rb.push((torch.empty(0, 5), {"anything": torch.empty(0)})) == []  # not checked: nothing to join
    out = rb.push(make_batch(0, 2)) + rb.push(make_batch(2, 0)) + rb.push(make_batch(2, 2))
    assert [o[1]["label"].tolist() for o in out] == [[0, 1, 2]]
    assert rb.flush()[1]["label"].tolist() == [3]
    assert rb.flush() is None


def test_drop_last_drops_the_remainder() -> None:
    rb = Rebatcher(5, drop_last=True)
    out = rb.push(make_batch(0, 12))
    assert [len(o[0]) for o in out] == [5, 5] and rb.pending == 2
    assert rb.flush() is None and rb.pending == 0


def test_batch_length() -> None:
    assert batch_length({"a": 3, "b": [torch.tensor(1.0), (np.zeros((4, 2)), torch.zeros(7))]}) == 4
    assert batch_length({"b": torch.zeros(2), "a": torch.zeros(9)}) == 2  # dict order, not sorted
    assert batch_length(torch.zeros(5, 0)) == 5
    assert batch_length([["a", "b"], torch.tensor(3), np.float32(2.0)]) is None
    assert batch_length("abc") is None and batch_length(None) is None


# ---------------------------------------------------------------------------- errors


def test_mismatched_dim0_names_the_leaf() -> None:
    rb = Rebatcher(4)
    bad = (torch.zeros(8, 3), {"label": torch.zeros(5)})
    with pytest.raises(
        ValueError, match=r"batch\[1\]\['label'\] has shape \(5,\).* 8 samples.*batch_size unset"
    ):
        rb.push(bad)
    bad_np = {"x": torch.zeros(8), "y": [np.zeros((3, 2))]}
    with pytest.raises(ValueError, match=r"batch\['y'\]\[0\] has shape \(3, 2\)"):
        rb.push(bad_np)
    assert rb.pending == 0  # a rejected batch changes nothing


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda b: b[1].update(extra=1), r"batch\[1\]"),
        (lambda b: b[1].update(label=b[1]["label"].int()), r"batch\[1\]\['label'\].*int64.*int32"),
        (lambda b: b[1].update(np=b[1]["np"][:, :1].copy()), r"batch\[1\]\['np'\]"),
        (lambda b: b[1].update(path=7), r"batch\[1\]\['path'\].*per-sample list.*batch-level"),
        (lambda b: b[1].update(meta=torch.zeros(len(b[0]))), r"batch\[1\]\['meta'\]"),
    ],
)
def test_structure_change_between_joined_batches(change: Any, path: str) -> None:
    rb = Rebatcher(16)
    assert rb.push(make_batch(0, 10)) == []
    changed = make_batch(10, 10, 1)
    change(changed)
    with pytest.raises(ValueError, match=path + r".*batch_size unset"):
        rb.push(changed)
    assert rb.pending == 10  # unchanged: the good batch can still follow
    assert [o[1]["label"].tolist() for o in rb.push(make_batch(10, 10, 1))] == [list(range(16))]


def test_structure_change_without_a_join_is_fine() -> None:
    rb = Rebatcher(8)
    assert len(rb.push(make_batch(0, 16))) == 2
    out = rb.push({"other": torch.arange(8)})
    assert out[0]["other"].tolist() == list(range(8))


def test_no_per_sample_leaf() -> None:
    with pytest.raises(ValueError, match="cannot be rebatched"):
        Rebatcher(4).push({"a": 1, "b": torch.tensor(2.0), "c": ["x", "y"]})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None])
def test_bad_batch_size(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"batch_size must be a positive int, got {re.escape(repr(value))}"):
        Rebatcher(value)
    with pytest.raises(ValueError, match="batch_size"):
        batches_per_epoch(10, value, False)


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_bad_drop_last(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"drop_last must be a bool, got {re.escape(repr(value))}"):
        Rebatcher(4, value)


# ---------------------------------------------------------------------------- lifetimes


@pytest.mark.parametrize(("producer", "consumer"), [(16, 48), (64, 48), (64, 100), (64, 64), (7, 3)])
def test_inputs_are_released_once_nothing_pending_slices_them(producer: int, consumer: int) -> None:
    rb = Rebatcher(consumer)
    refs = []
    for i in range(6):
        batch = make_batch(producer * i, producer, i)
        refs.append((weakref.ref(batch[0]), weakref.ref(batch[1]["scalar"]), weakref.ref(batch[1]["np"])))
        results = rb.push(batch)
        del batch, results  # outputs dropped straight away
        alive = [i for i, group in enumerate(refs) if any(r() is not None for r in group)]
        # Without the cyclic GC: only the last input may be held, and only while it has pending samples.
        assert alive == ([i] if rb.pending else [])
    rb.flush()
    assert all(r() is None for group in refs for r in group)


def test_own_pending_copies_the_samples_held_for_the_next_batch_and_lets_their_input_go() -> None:
    rb = Rebatcher(7)
    batch = (torch.arange(4),)
    ref = weakref.ref(batch[0])
    assert rb.push(batch) == [] and rb.pending == 4
    del batch
    assert ref() is not None  # the pending samples are views of it
    assert rb.own_pending() and ref() is None
    assert not rb.own_pending()  # copied once
    (out,) = rb.push((torch.arange(4, 8),))
    assert out[0].tolist() == list(range(7))
    assert not Rebatcher(3).own_pending()  # nothing pending
