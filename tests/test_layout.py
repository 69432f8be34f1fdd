"""Tests for tensorsocket.layout: plan / write / check / build round trips, hostile layouts,
lifetimes of the views it builds, and the sampled fingerprint."""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorsocket import fingerprints, layout
from tensorsocket.errors import ProtocolError

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TORCH_NAMES = sorted(layout.TORCH_DTYPES)


# ---------------------------------------------------------------------------- helpers


def _wire(obj: Any) -> Any:
    """What the peer sees: the layout after a msgpack round trip."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


def _roundtrip(batch: Any, *, copy: bool = False) -> tuple[Any, Any, torch.Tensor]:
    """plan -> write -> msgpack -> check -> build; returns (rebuilt, plan, arena)."""
    p = layout.plan(batch)
    arena = torch.zeros(p.nbytes, dtype=torch.uint8)
    layout.write(p, arena)
    tree, leaves = layout.check(_wire(p.encode()), arena.numel())
    _assert_aligned(leaves, p.nbytes)
    return layout.build(tree, leaves, arena.numpy(), copy=copy), p, arena


def _assert_aligned(leaves: list[layout.Leaf], nbytes: int) -> None:
    assert nbytes % layout.ALIGN == 0
    end = 0
    for leaf in leaves:
        assert leaf.offset % layout.ALIGN == 0
        assert leaf.offset >= end  # no overlap, in order
        end = leaf.offset + leaf.nbytes
    assert end <= nbytes


def _tbytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor in C order, conj / neg bits resolved."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:  # an empty tensor may keep odd strides that view(dtype) refuses
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        t = torch.empty(shape, dtype=dtype)
    raw = t.reshape(-1).view(torch.uint8)
    hi = 2 if dtype == torch.bool else 256  # a bool byte other than 0 / 1 is not a bool
    raw.copy_(torch.randint(0, hi, raw.shape, dtype=torch.uint8, generator=g))
    return t


def _random_array(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    hi = 2 if dt.kind == "b" else 256
    raw = rng.integers(0, hi, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Structure, container types, dict key order and leaf bytes all match."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert got.is_contiguous(), path
        assert not got.is_conj() and not got.is_neg(), path
        assert torch.equal(_tbytes(got), _tbytes(want)), path
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), path
    elif isinstance(want, np.generic):
        assert type(got) is type(want), path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, dict):
        assert type(got) is dict, path
        assert list(got) == list(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want), path
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert type(got) is float and math.isnan(got), path
    else:
        assert type(got) is type(want), path
        assert got == want, path


@contextmanager
def _no_gc() -> Iterator[None]:
    """Lifetimes must follow reference counts alone: no cyclic collector to hide a cycle."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _valid_layout() -> tuple[list[Any], int]:
    batch = {
        "x": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "a": (np.arange(5, dtype=np.int16), np.float64(2.5)),
        "v": [None, True, 3, 1.5, "s", b"b"],
    }
    p = layout.plan(batch)
    return _wire(p.encode()), p.nbytes


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_every_torch_dtype_roundtrips_bit_exact(name: str) -> None:
    dtype = layout.TORCH_DTYPES[name]
    base = _random_tensor((4, 6), dtype, seed=1)
    batch = [
        base,
        _random_tensor((), dtype, seed=2),  # 0-d
        _random_tensor((0,), dtype),  # empty
        _random_tensor((3, 0, 2), dtype),  # empty with shape
        _random_tensor((7,), dtype, seed=3),
        base.t(),  # transposed
        base[:, 1::3],  # strided
        base[1:, :].unsqueeze(1).expand(3, 2, 6),  # zero stride
        base.permute(1, 0)[::2],
    ]
    out, _, _ = _roundtrip(batch)
    _assert_same(out, batch)
    assert out[1].dim() == 0
    out_copy, _, _ = _roundtrip(batch, copy=True)
    _assert_same(out_copy, batch)


def test_conj_and_neg_bit_tensors_are_resolved() -> None:
    z = torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    conj = z.conj()
    neg = z.conj().imag  # a real view carrying the neg bit
    both = z.t().conj()
    assert conj.is_conj() and neg.is_neg() and both.is_conj()
    out, _, _ = _roundtrip({"conj": conj, "neg": neg, "both": both, "negview": torch._neg_view(z)})
    assert torch.equal(out["conj"], torch.conj_physical(z))
    assert torch.equal(out["neg"], -z.imag)
    assert torch.equal(out["both"], torch.conj_physical(z.t()))
    assert torch.equal(out["negview"], -z)
    for t in out.values():
        assert not t.is_conj() and not t.is_neg()


def test_tensor_requiring_grad_is_detached() -> None:
    x = torch.randn(5, requires_grad=True)
    out, _, _ = _roundtrip((x * 2,))
    assert not out[0].requires_grad
    assert torch.equal(out[0], (x * 2).detach())


NUMPY_DTYPES = [
    "?",
    "i1",
    "u1",
    "<i2",
    ">i2",
    "<u4",
    "<i8",
    ">u8",
    "<f2",
    "<f4",
    ">f8",
    "<c8",
    ">c16",
    "g",
    "G",
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_roundtrip_bit_exact(dtype: str) -> None:
    a = _random_array((4, 6), dtype, seed=5)
    batch = {
        "plain": a,
        "0d": _random_array((), dtype, seed=6),
        "empty": _random_array((0,), dtype),
        "empty2": _random_array((2, 0, 3), dtype),
        "T": a.T,
        "strided": a[:, ::2],
        "reversed": a[::-1, ::-3],
        "fortran": np.asfortranarray(a),
        "broadcast": np.broadcast_to(a[0], (3, 6)),
    }
    out, _, _ = _roundtrip(batch)
    _assert_same(out, batch)
    assert out["0d"].ndim == 0
    out_copy, _, _ = _roundtrip(batch, copy=True)
    _assert_same(out_copy, batch)


@pytest.mark.parametrize(
    "scalar",
    [
        np.float32(1.5),
        np.float64("nan"),
        np.float16(-0.0),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.bool_(True),
        np.complex64(1 - 2j),
        np.complex128(3j),
        np.longdouble(1) / 3,
        np.uint16(7),
    ],
    ids=repr,
)
def test_numpy_scalars_roundtrip(scalar: np.generic) -> None:
    for copy in (False, True):
        out, p, _ = _roundtrip({"s": scalar}, copy=copy)
        assert p.tree[1][0][1][0] == layout.NPSCALAR
        _assert_same(out, {"s": scalar})


def test_nested_structures_and_plain_values() -> None:
    batch = {
        "img": torch.randn(2, 3),
        3: [
            None,
            True,
            False,
            0,
            -(2**63),
            2**64 - 1,
            1.5,
            float("inf"),
            float("nan"),
            "text",
            "",
            b"\x00bytes",
            (np.arange(4),),
        ],
        -7: (),
        "nested": ({"a": [(), [], {}], 0: ({"deep": (torch.ones(1, dtype=torch.int8),)},)},),
        "": [np.float32(2.0), {"k": None}],
    }
    out, _, _ = _roundtrip(batch)
    _assert_same(out, batch)
    assert list(out) == ["img", 3, -7, "nested", ""]
    # Also straight from p.encode() without msgpack in between, and with a bigger arena.
    p = layout.plan(batch)
    arena = torch.zeros(p.nbytes + 1000, dtype=torch.uint8)
    layout.write(p, arena)
    tree, leaves = layout.check(p.encode(), arena.numel())
    _assert_same(layout.build(tree, leaves, arena.numpy()), batch)


def test_top_level_leaf_and_value_batches() -> None:
    for batch in (torch.arange(3), np.arange(3), np.int32(4), None, 7, "s", b"b", [], {}, ()):
        out, p, _ = _roundtrip(batch)
        _assert_same(out, batch)
        if not isinstance(batch, (torch.Tensor, np.ndarray, np.generic)):
            assert p.nbytes == 0 and p.leaves == ()


def test_numpy_str_scalar_becomes_str_value() -> None:
    out, p, _ = _roundtrip([np.str_("hi")])
    assert p.leaves == ()
    assert out == ["hi"] and type(out[0]) is str


def test_offsets_are_aligned_for_many_odd_leaves() -> None:
    batch = [torch.ones(n, dtype=torch.uint8) for n in (1, 255, 256, 257, 0, 3, 511)]
    batch += [np.ones(n, dtype=np.float64) for n in (1, 31, 33)]
    out, p, _ = _roundtrip(batch)
    _assert_same(out, batch)
    for leaf in p.leaves:
        assert leaf.offset % 256 == 0
    assert [leaf.nbytes for leaf in p.leaves] == [1, 255, 256, 257, 0, 3, 511, 8, 248, 264]


@FAST
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["?", "u1", "<i2", "<f4", ">f8", "<c8"]),
            st.lists(st.integers(0, 5), max_size=3),
            st.booleans(),
        ),
        max_size=8,
    )
)
def test_random_arrays_and_tensors_roundtrip(specs: list[tuple[str, list[int], bool]]) -> None:
    batch = []
    for i, (dtype, shape, as_tensor) in enumerate(specs):
        a = _random_array(tuple(shape), dtype, seed=i)
        batch.append(torch.from_numpy(a.astype(a.dtype.newbyteorder("="))) if as_tensor else a)
    out, p, _ = _roundtrip(batch)
    _assert_same(out, batch)
    _assert_aligned(list(p.leaves), p.nbytes)


def test_numpy_leaves_are_read_only_views() -> None:
    out, _, arena = _roundtrip({"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
    a = out["a"]
    assert not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 5
    assert np.shares_memory(a, arena.numpy())


def test_views_share_the_arena_and_copies_do_not() -> None:
    batch = {"t": torch.arange(8, dtype=torch.int64), "a": np.arange(8, dtype=np.int64)}
    view, _, arena = _roundtrip(batch)
    copied, _, arena2 = _roundtrip(batch, copy=True)
    lo, hi = arena2.data_ptr(), arena2.data_ptr() + arena2.numel()
    assert not lo <= copied["t"].data_ptr() < hi
    assert not np.shares_memory(copied["a"], arena2.numpy())
    arena.fill_(0)
    arena2.fill_(0)
    assert int(view["t"].abs().sum()) == 0 and int(np.abs(view["a"]).sum()) == 0
    assert torch.equal(copied["t"], batch["t"])
    assert np.array_equal(copied["a"], batch["a"])


# ---------------------------------------------------------------------------- lifetimes


def _layout_and_region() -> tuple[Any, list[layout.Leaf], np.ndarray]:
    batch = {"x": torch.arange(12, dtype=torch.float32).reshape(3, 4), "a": np.arange(5)}
    p = layout.plan(batch)
    arena = torch.zeros(p.nbytes, dtype=torch.uint8)
    layout.write(p, arena)
    tree, leaves = layout.check(p.encode(), p.nbytes)
    return tree, leaves, arena.numpy().copy()  # the region owns its memory


def test_region_lives_until_the_last_derived_tensor_dies() -> None:
    tree, leaves, region = _layout_and_region()
    fired: list[bool] = []
    with _no_gc():
        weakref.finalize(region, fired.append, True)
        out = layout.build(tree, leaves, region)
        del region
        x = out["x"]
        row = x[0]
        flat = x.reshape(-1)
        a = out["a"]
        del out, x
        assert not fired
        del row
        assert not fired
        del flat
        assert not fired
        assert int(a.sum()) == 10
        del a
        assert fired == [True]


def test_a_tensor_region_lives_until_the_last_leaf_dies_and_each_leaf_has_its_own_storage() -> None:
    """A region given as a host tensor (the CUDA stand-in's form): as for a NumPy region,
    each leaf's storage is its own (torch.save refuses leaves sharing one as other dtypes),
    and the region's owner lives until the last leaf dies."""
    tree, leaves, owner = _layout_and_region()
    fired: list[bool] = []
    with _no_gc():
        weakref.finalize(owner, fired.append, True)
        out = layout.build(tree, leaves, torch.from_numpy(owner))
        x = out["x"]
        assert x.untyped_storage().nbytes() == x.nbytes
        assert x.data_ptr() == owner.ctypes.data + leaves[0].offset  # a view, not a copy
        del owner, out
        assert not fired
        del x
        assert fired == [True]


@pytest.mark.gpu
def test_a_gpu_regions_leaves_are_views_with_storages_of_their_own() -> None:
    """On a GPU region each tensor leaf is imported on its own (``__cuda_array_interface__``):
    a view at its offset, a storage of its leaf's size, and the region lives until the last
    leaf dies (the consumer's release signal)."""
    tree, leaves, host = _layout_and_region()
    region = torch.from_numpy(host).cuda()
    fired: list[bool] = []
    with _no_gc():
        weakref.finalize(region, fired.append, True)
        base = region.data_ptr()
        out = layout.build(tree, leaves, region)
        x = out["x"]
        assert x.device == region.device and x.data_ptr() == base + leaves[0].offset
        assert x.untyped_storage().nbytes() == x.nbytes
        assert torch.equal(x.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4))
        assert np.array_equal(out["a"], np.arange(5))  # NumPy leaves are host copies
        del region, out
        assert not fired
        del x
        assert fired == [True]


def test_region_lives_until_numpy_view_dies() -> None:
    tree, leaves, region = _layout_and_region()
    fired: list[bool] = []
    with _no_gc():
        weakref.finalize(region, fired.append, True)
        out = layout.build(tree, leaves, region)
        del region
        a = out["a"][1:]
        del out
        assert not fired
        del a
        assert fired == [True]


def test_copy_drops_the_region_at_once() -> None:
    tree, leaves, region = _layout_and_region()
    fired: list[bool] = []
    with _no_gc():
        weakref.finalize(region, fired.append, True)
        out = layout.build(tree, leaves, region, copy=True)
        del region
        assert fired == [True]
        assert torch.equal(out["x"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
        assert np.array_equal(out["a"], np.arange(5))


# ---------------------------------------------------------------------------- plan errors


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still constructible
        return torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)


def _nested(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.parametrize(
    ("batch", "path"),
    [
        ({"a": {1, 2}}, "batch['a']"),
        ([1, object()], "batch[1]"),
        ((torch.randn(3).to_sparse(),), "batch[0]"),
        ({"q": _quantized()}, "batch['q']"),
        ([torch.empty(3, device="meta")], "batch[0]"),
        ({"o": np.array([object()], dtype=object)}, "batch['o']"),
        ({"s": [np.array(["a", "b"])]}, "batch['s'][0]"),
        ([np.array([b"a"])], "batch[0]"),
        ([np.array(["2020-01-01"], dtype="datetime64[D]")], "batch[0]"),
        ([np.datetime64("2020-01-01")], "batch[0]"),
        ({"n": [2**64]}, "batch['n'][0]"),
        ({"n": [-(2**63) - 1]}, "batch['n'][0]"),
        ({"c": 1j}, "batch['c']"),
        ({"b": bytearray(b"x")}, "batch['b']"),
        ({(1, 2): 3}, "batch"),
        ({"d": {True: 1}}, "batch['d']"),
        ({"d": {1.5: 1}}, "batch['d']"),
        ({"d": {2**64: 1}}, "batch['d']"),
        ({"d": {None: 1}}, "batch['d']"),
        (_nested(layout.MAX_DEPTH + 1), "batch[0]"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_plan_rejects_unshareable_leaves_naming_the_path(batch: Any, path: str) -> None:
    with pytest.raises(TypeError) as info:
        layout.plan(batch)
    assert path in str(info.value)


@pytest.mark.parametrize(
    ("leaf", "kind"),
    [
        (torch.randn(3).to_sparse(), "a torch.sparse_coo tensor"),
        (_quantized(), "a quantized tensor"),
        (torch.empty(3, device="meta"), "a meta tensor"),
    ],
    ids=["sparse", "quantized", "meta"],
)
def test_plan_says_which_kind_of_tensor_it_refuses(leaf: torch.Tensor, kind: str) -> None:
    """A quantized tensor was refused as 'a torch.strided, quantized or meta tensor'."""
    with pytest.raises(TypeError, match="only dense tensors") as info:
        layout.plan([leaf])
    assert f"batch[0] is {kind};" in str(info.value)


def test_plan_depth_boundary() -> None:
    batch = _nested(layout.MAX_DEPTH)
    out, _, _ = _roundtrip(batch)
    assert out == batch
    with pytest.raises(TypeError, match="deeper"):
        layout.plan(_nested(layout.MAX_DEPTH + 1))


def test_plan_value_int_range_boundaries() -> None:
    out, _, _ = _roundtrip({"lo": -(2**63), "hi": 2**64 - 1, 2**64 - 1: 0, -(2**63): 1})
    assert out == {"lo": -(2**63), "hi": 2**64 - 1, 2**64 - 1: 0, -(2**63): 1}


def test_plan_leaf_count_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "MAX_LEAVES", 3)
    layout.plan([np.int8(1)] * 3)
    with pytest.raises(TypeError, match="at most 3"):
        layout.plan([np.int8(1)] * 4)


# ---------------------------------------------------------------------------- check rejects


def _leaf_layout(leaf: Any, tag: str = "t", nbytes: int = 512) -> list[Any]:
    return [[tag, 0], [leaf], nbytes]


HOSTILE = {
    "none": None,
    "str": "layout",
    "dict": {"tree": 1},
    "tuple": (["v", 1], [], 0),
    "too short": [["v", 1], []],
    "too long": [["v", 1], [], 0, 0],
    "leaves not list": [["v", 1], {}, 0],
    "nbytes float": [["v", 1], [], 0.0],
    "nbytes bool": [["v", 1], [], True],
    "nbytes negative": [["v", 1], [], -1],
    "nbytes too big": [["v", 1], [], 513],
    "node not list": ["v", [], 0],
    "node short": [["v"], [], 0],
    "node long": [["v", 1, 2], [], 0],
    "unknown tag": [["x", 1], [], 0],
    "tag int": [[5, 1], [], 0],
    "tag none": [[None, None], [], 0],
    "value list": [["v", [1]], [], 0],
    "value dict": [["v", {"a": 1}], [], 0],
    "seq payload": [["L", 5], [], 0],
    "tuple payload": [["T", "ab"], [], 0],
    "dict payload": [["D", {"a": ["v", 1]}], [], 0],
    "dict item short": [["D", [["a"]]], [], 0],
    "dict item key float": [["D", [[1.5, ["v", 1]]]], [], 0],
    "dict item key none": [["D", [[None, ["v", 1]]]], [], 0],
    "dict bad child": [["D", [["a", ["?", 1]]]], [], 0],
    "leaf index out of range": [["t", 1], [["uint8", [1], 0, 1]], 256],
    "leaf index no leaves": [["a", 0], [], 0],
    "leaf index negative": [["t", -1], [["uint8", [1], 0, 1]], 256],
    "leaf index bool": [["t", True], [["uint8", [1], 0, 1]], 256],
    "leaf index float": [["t", 0.0], [["uint8", [1], 0, 1]], 256],
    "leaf index str": [["s", "0"], [["<f4", [], 0, 4]], 256],
    "leaf tag conflict": [["L", [["t", 0], ["a", 0]]], [["<f4", [1], 0, 4]], 256],
    "leaf tag conflict 2": [["L", [["a", 0], ["t", 0]]], [["float32", [1], 0, 4]], 256],
    "leaf not list": [["t", 0], ["uint8"], 256],
    "leaf short": [["t", 0], [["uint8", [1], 0]], 256],
    "leaf long": [["t", 0], [["uint8", [1], 0, 1, 1]], 256],
    "unreferenced bad leaf": [["v", 1], [["nope", [1], 0, 1]], 256],
    "too many leaves": [["v", 1], [["uint8", [0], 0, 0]] * (layout.MAX_LEAVES + 1), 256],
}
for _name in [
    "float128",
    "qint8",
    "quint8",
    "int4",
    "uint3",
    "torch.float32",
    "<f4",
    "f4",
    "Float",
    "",
    "object",
]:
    HOSTILE[f"torch dtype {_name!r}"] = _leaf_layout([_name, [1], 0, 1])
for _name in [5, None, 1.5, [1], b"float32"]:
    HOSTILE[f"torch dtype {_name!r}"] = _leaf_layout([_name, [1], 0, 1])
for _name in [
    "O",
    "object",
    "U8",
    "<U1",
    "S4",
    "V4",
    "M8[ns]",
    "m8[s]",
    "f4,f4",
    "(2,)f4",
    "bfloat16",
    "float8_e4m3fn",
    "nope",
    "",
    5,
    1.5,
    [["a", "<f4"]],
    {"names": ["a"], "formats": ["<f4"]},
]:
    for _tag in ("a", "s"):
        HOSTILE[f"numpy {_tag} dtype {_name!r}"] = _leaf_layout([_name, [1], 0, 4], _tag)
HOSTILE.update(
    {
        "offset negative": _leaf_layout(["uint8", [1], -256, 1]),
        "offset unaligned 1": _leaf_layout(["uint8", [1], 1, 1]),
        "offset unaligned 255": _leaf_layout(["uint8", [1], 255, 1]),
        "offset unaligned 384": _leaf_layout(["uint8", [1], 384, 1]),
        "offset float": _leaf_layout(["uint8", [1], 0.0, 1]),
        "offset bool": _leaf_layout(["uint8", [1], False, 1]),
        "offset none": _leaf_layout(["uint8", [1], None, 1]),
        "size float": _leaf_layout(["uint8", [1], 0, 1.0]),
        "size negative": _leaf_layout(["uint8", [1], 0, -1]),
        "past nbytes": _leaf_layout(["uint8", [2], 256, 2], nbytes=257),
        "past nbytes exactly": _leaf_layout(["float32", [65], 256, 260]),
        "past nbytes zero": _leaf_layout(["uint8", [1], 0, 1], nbytes=0),
        "huge offset": _leaf_layout(["uint8", [1], 2**64, 1]),
        "shape mismatch": _leaf_layout(["float32", [2], 0, 4]),
        "shape mismatch numpy": _leaf_layout(["<f8", [2, 2], 0, 16], "a"),
        "shape mismatch scalar": _leaf_layout(["<f8", [], 0, 4], "s"),
        "shape not list": _leaf_layout(["uint8", 1, 0, 1]),
        "shape tuple": _leaf_layout(["uint8", (1,), 0, 1]),
        "shape negative": _leaf_layout(["uint8", [-1], 0, 0]),
        "shape negative pair": _leaf_layout(["uint8", [-1, -1], 0, 1]),
        "shape float": _leaf_layout(["uint8", [1.0], 0, 1]),
        "shape bool": _leaf_layout(["uint8", [True], 0, 1]),
        "shape str": _leaf_layout(["uint8", ["1"], 0, 1]),
        "shape huge dim": _leaf_layout(["uint8", [2**48], 0, 2**48], nbytes=2**48),
        "shape huge dim zero": _leaf_layout(["uint8", [2**48, 0], 0, 0]),
        "shape huge product": _leaf_layout(["uint8", [2**40, 2**40], 0, 2**80], nbytes=2**80),
        "shape overflowing empty": _leaf_layout(["float32", [2**47] * 20 + [0], 0, 0]),
        "shape overflowing empty numpy": _leaf_layout(["<f4", [0] + [2**48 - 1] * 63, 0, 0], "a"),
        "shape too many dims": _leaf_layout(["uint8", [1] * 65, 0, 1]),
    }
)
_deep: Any = ["v", 1]
for _ in range(layout.MAX_DEPTH + 1):
    _deep = ["L", [_deep]]
HOSTILE["tree too deep"] = [_deep, [], 0]
_very_deep: Any = ["v", 1]
for _ in range(5000):
    _very_deep = ["T", [_very_deep]]
HOSTILE["tree very deep"] = [_very_deep, [], 0]
_deep_dict: Any = ["v", 1]
for _ in range(layout.MAX_DEPTH + 1):
    _deep_dict = ["D", [["k", _deep_dict]]]
HOSTILE["dict too deep"] = [_deep_dict, [], 0]


@pytest.mark.parametrize("bad", list(HOSTILE.values()), ids=list(HOSTILE))
def test_check_rejects_hostile_layouts(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        layout.check(bad, 512)


def test_check_rejects_nbytes_larger_than_arena() -> None:
    good, nbytes = _valid_layout()
    layout.check(good, nbytes)
    with pytest.raises(ProtocolError):
        layout.check(good, nbytes - 1)
    with pytest.raises(ProtocolError):
        layout.check(good, 0)


def test_check_accepts_boundaries() -> None:
    """Not every odd-looking layout is hostile: these must pass and build."""
    region = np.zeros(512, np.uint8)
    ok = [
        _leaf_layout(["uint8", [256], 256, 256]),  # ends exactly at nbytes
        _leaf_layout(["float32", [0, 2**47 - 1], 256, 0]),  # empty at any aligned offset
        _leaf_layout(["uint8", [1] * 64, 0, 1]),  # 64 dims
        _leaf_layout(["<f8", [], 0, 8], "s"),
        _leaf_layout([">c16", [2], 0, 32], "a"),
        [["L", [["t", 0], ["t", 0]]], [["int32", [2], 0, 8]], 256],  # one leaf read twice
        [["v", 1], [["int8", [1], 0, 1]], 256],  # an unreferenced leaf
    ]
    depth_ok: Any = ["v", 1]
    for _ in range(layout.MAX_DEPTH):
        depth_ok = ["L", [depth_ok]]
    ok.append([depth_ok, [], 0])
    for good in ok:
        tree, leaves = layout.check(good, 512)
        layout.build(tree, leaves, region)
        layout.build(tree, leaves, region, copy=True)


def test_check_leaf_count_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "MAX_LEAVES", 2)
    leaf = ["uint8", [0], 0, 0]
    layout.check([["v", 1], [leaf] * 2, 0], 0)
    with pytest.raises(ProtocolError):
        layout.check([["v", 1], [leaf] * 3, 0], 0)


# ---------------------------------------------------------------------------- fuzzing check

_TAGS = [
    layout.TUPLE,
    layout.LIST,
    layout.DICT,
    layout.TENSOR,
    layout.ARRAY,
    layout.NPSCALAR,
    layout.VALUE,
    "x",
    "",
]
_DTYPES = [*TORCH_NAMES[:6], "float32", "<f4", "|b1", ">c16", "O", "U4", "qint8", "f4,f4"]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from([0, 1, 4, 255, 256, 512, -256, 2**47, 2**48, 2**62])
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.sampled_from(_TAGS + _DTYPES)
)
_packable = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=25,
)
_leaf_refs = st.tuples(st.sampled_from(["t", "a", "s"]), st.integers(-1, 3)).map(list)
_mutant = (
    _leaf_refs
    | st.sampled_from(
        [
            0,
            1,
            2,
            3,
            4,
            8,
            48,
            256,
            512,
            768,
            2**47,
            -1,
            None,
            True,
            1.5,
            "float32",
            "<f4",
            "<i2",
            "bool",
            "O",
            *_TAGS,
        ]
    )
    | _packable
)


def _check_then_build(obj: Any, arena_size: int) -> None:
    """check() returns or raises ProtocolError; what it accepts, build() must handle."""
    try:
        tree, leaves = layout.check(obj, arena_size)
    except ProtocolError:
        return
    region = np.zeros(arena_size, np.uint8)
    layout.build(tree, leaves, region)
    layout.build(tree, leaves, region, copy=True)


@FAST
@given(_packable, st.sampled_from([0, 256, 512, 4096]))
def test_check_fuzz_random_structures(obj: Any, arena_size: int) -> None:
    _check_then_build(obj, arena_size)
    _check_then_build([obj, [], 0], arena_size)


@FAST
@given(_packable, _packable, st.integers(0, 1024))
def test_check_fuzz_random_triples(tree: Any, leaves: Any, nbytes: int) -> None:
    _check_then_build([tree, leaves, nbytes], 1024)
    if isinstance(leaves, list):
        _check_then_build([tree, [leaves], nbytes], 1024)


def _containers(obj: Any, out: list[Any]) -> list[Any]:
    if isinstance(obj, list):
        out.append(obj)
        for c in obj:
            _containers(c, out)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_check_fuzz_mutated_valid_layout(data: st.DataObject) -> None:
    good, nbytes = _valid_layout()
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(_containers(good, [])[::-1]))  # innermost first
        action = data.draw(st.sampled_from(["replace", "insert", "delete", "duplicate"]))
        if action == "replace" and target:
            target[data.draw(st.integers(0, len(target) - 1))] = data.draw(_mutant)
        elif action == "insert":
            target.insert(data.draw(st.integers(0, len(target))), data.draw(_mutant))
        elif action == "delete" and target:
            del target[data.draw(st.integers(0, len(target) - 1))]
        elif target:
            target.append(target[data.draw(st.integers(0, len(target) - 1))])
    arena_size = data.draw(st.sampled_from([nbytes, nbytes + 256, nbytes - 1, 0]))
    _check_then_build(good, arena_size)


# ---------------------------------------------------------------------------- fingerprint


def test_fingerprint_equal_for_equal_bytes() -> None:
    a = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    b = a.copy()
    assert fingerprints.of(a) == fingerprints.of(b)
    assert fingerprints.of(np.zeros(0, np.uint8)) == fingerprints.of(np.zeros(0, np.uint8))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sub_(0.5),
        lambda t: t.mul_(2),
        lambda t: t.div_(255),
        lambda t: t.add_(1),
        lambda t: t.neg_(),
        lambda t: t.sub_(t.mean()).div_(t.std()),
    ],
    ids=["sub", "mul", "div", "add", "neg", "normalise"],
)
@pytest.mark.parametrize("shape", [(4, 3, 32, 32), (7,), (3, 5)])
def test_fingerprint_sees_whole_tensor_in_place_ops(op: Any, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    batch = {
        "labels": torch.arange(8),
        "x": torch.rand(shape, generator=g) + 0.25,
        "meta": np.arange(3, dtype=np.float32),
    }
    out, _, arena = _roundtrip(batch)
    region = arena.numpy()
    before = fingerprints.of(region)
    op(out["x"])
    assert fingerprints.of(region) != before


@FAST
@given(st.binary(max_size=5000))
def test_fingerprint_is_a_deterministic_u64(raw: bytes) -> None:
    region = np.frombuffer(raw, dtype=np.uint8)
    fp = fingerprints.of(region)
    assert type(fp) is int
    assert 0 <= fp < 2**64
    assert fp == fingerprints.of(region.copy())


def test_fingerprint_depends_on_length() -> None:
    assert fingerprints.of(np.zeros(10, np.uint8)) != fingerprints.of(np.zeros(11, np.uint8))


def test_a_plan_leaves_no_reference_cycle_behind() -> None:
    """A producer drops each loader batch (a DataLoader's shared-memory tensors) as soon as
    it is written, not when the cyclic GC happens to run: planning makes no cycle."""
    array = np.zeros(4)
    alive = weakref.ref(array)
    enabled = gc.isenabled()
    gc.disable()
    try:
        p = layout.plan({"x": [array, torch.ones(2)]})
        del p, array
        assert alive() is None, "the plan's sources outlived it"
    finally:
        if enabled:
            gc.enable()
