"""Tests for tensorsocket.protocol: round trips of every kind, strict validation of every
field, and hostile frames (random bytes, wrong shapes, oversize or lying length headers)."""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorsocket import layout, protocol
from tensorsocket.errors import ProtocolError
from tensorsocket.protocol import SCHEMA, Kind

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layout() -> list[Any]:
    return layout.plan({"x": [1, 2.5, None], "y": b"raw"}).encode()


# One valid value per field name, and more valid values that sit on the edges of the ranges.
VALID: dict[str, Any] = {
    "version": protocol.VERSION,
    "pid": 4242,
    "boot_id": "0b6f3c1e-5d2a-4b8f-9e7a-1c2d3e4f5a6b",
    "pidns": 4026531836,
    "label": "trainer-0",
    "prefetch": 4,
    "timeout": 30.0,
    "batches": 100,
    "slots": 8,
    "stragglers": "skip",
    "arenas": [["shm", 0, "/tensorsocket-abc-0", 1 << 20], ["cuda", 1, b"h" * 64, 1 << 21, "GPU-1"]],
    "transport": "cuda",
    "gpu": "GPU-8f2c3a4e-0000-4000-8000-000000000000",
    "heartbeat": 1.0,
    "arena": ["shm", 2, "/tensorsocket-abc-2", 1 << 30],
    "seq": 7,
    "epoch": 2,
    "index": 3,
    "place": 1,
    "layout": _layout(),
    "layouts": [[0, _layout()], [1, _layout()]],
    "check_writes": True,
    "number": 3,
    "fingerprint": 123456789,
    "seqs": [1, 2, 3],
    "status": {"consumers": [{"label": "a", "held": 2}], "epoch": 1},
    "reason": "producer stopped",
    "late_join": "now",
    "batch_size": 48,
    "device": "cuda:1",
    "samples": 50000,
    "count": 3,
    "skipped": 2,
    "taken_batches": 12,
    "taken_samples": 384,
    "waiting": 1.25,
    "group": ["job-a", 1, 4, "pad"],
    "until": 4,
    "epoch_done": 7,
    "resume": ["0123abcd", 3, 17, False],
    "stream": "0123abcd",
    "restarted": ["0123abcd", 2],
    "session": ["tensorsocket-4242-0123456789abcdef", "f" * 32],
    "starts_with": 3,
    "token": "f" * 32,
}
EDGES: dict[str, list[Any]] = {
    "version": [protocol.VERSION],  # any other is refused: test_other_protocol_versions_are_refused
    "pid": [1, (1 << 31) - 1],
    "boot_id": ["", "b" * 64],
    "pidns": [0, 2**63 - 1],
    "label": ["", "é" * 128],
    "prefetch": [1, 1 << 16],
    "timeout": [0.05, 86400.0, 1, 86400],
    "batches": [None, 0, 2**63 - 1],
    "slots": [1, 1 << 16],
    "stragglers": ["stall", "skip"],
    "arenas": [[], [["shm", 1 << 16, "n" * 255, 1 << 48]], [["shm", 0, "", 0]], [["cuda", 0] + [0] * 6]],
    "transport": ["shm", "cuda"],
    "gpu": [None, "", "g" * 96],
    "heartbeat": [0.001, 3600.0, 5],
    "arena": [["shm", 0, "", 0], ["cuda", 1 << 16, b"x" * 64, 1 << 48, "GPU-x"], ["shm", 0]],
    "seq": [0, 2**63 - 1],
    "epoch": [0, 2**63 - 1],
    "index": [0, 2**63 - 1],
    "place": [0, 1 << 16],
    "layout": [None, [], {"any": "thing"}, 5],
    "layouts": [[], [[0, None]], [[1 << 16, {"any": "thing"}]]],
    "check_writes": [False, True],
    "number": [0, 1 << 16],
    "fingerprint": [None, 0, 2**64 - 1],
    "seqs": [[], list(range(4096)), [2**63 - 1]],
    "status": [None, {}],
    "reason": ["", "r" * 4096],
    "late_join": ["replay", "next_epoch", "now"],
    "batch_size": [None, 1, 1 << 31],
    "device": ["", "d" * 64],
    "samples": [None, 0, 2**63 - 1],
    "count": [1, 2**63 - 1],
    "skipped": [1, 2**63 - 1],
    "taken_batches": [0, 2**63 - 1],
    "taken_samples": [0, 2**63 - 1],
    "waiting": [0, 0.0, 1e12],
    "group": [None, ["j" * 128, 0, 1, "drop"], ["é", 1 << 16, 1 << 16, "pad"]],
    "until": [None, 0, 2**63 - 1],
    "epoch_done": [None, 0, 2**63 - 1],
    "resume": [None, ["", 0, 0, False], ["s" * 64, 2**63 - 1, 2**63 - 1, True]],
    "stream": ["", "s" * 64],
    "restarted": [None, ["", 0], ["s" * 64, 2**63 - 1]],
    "session": [None, ["", ""], ["a" * 96, "t" * 64]],
    "starts_with": [None, 1, 1 << 31],
    "token": ["", "t" * 64],
}
# Values no kind may accept for that field: wrong type, bool for int, out of range, too long.
BAD: dict[str, list[Any]] = {
    "version": [True, -1, 2**63, 1.0, "1", None, [1]],
    "pid": [False, 0, -1, 1 << 31, 1.5, "4242", None],
    "boot_id": [5, b"boot", "b" * 65, None, ["b"]],
    "pidns": [-1, True, "1", None, 2**64 - 1],
    "label": ["x" * 129, 3, b"label", None],
    "prefetch": [0, (1 << 16) + 1, True, 2.0, None, -1],
    "timeout": [0.0, 0.04, 86400.5, -1.0, float("nan"), float("inf"), "30", None, True],
    "batches": [-1, 1.5, True, "1", [1]],
    "slots": [0, (1 << 16) + 1, None, True, 1.0],
    "stragglers": ["", "Stall", None, 0, ["skip"]],
    "arenas": [
        None,
        "arena",
        {},
        [None],
        [["shm"]],
        [[0, "a", 1]],
        [["nfs", 0, "a", 1]],
        [["shm", -1, "a", 1]],
        [["shm", (1 << 16) + 1, "a", 1]],
        [["shm", True, "a", 1]],
        [["shm", 0.0, "a", 1]],
        [["shm", 0] + [1] * 7],
        [["shm", 0, "a", 1], ["shm"]],
    ],
    "transport": ["nfs", "", None, 1, ["shm"]],
    "gpu": ["g" * 97, 1, b"GPU-1", ["GPU-1"]],
    "heartbeat": [0.0, 0.0005, 3600.5, -1.0, float("nan"), None, False, "1"],
    "arena": [None, [], ["shm"], [0, "a", 1], ["shm", -1, "a", 1], ["tcp", 0, "a", 1], {"a": 1}],
    "seq": [-1, True, 2**63, 1.5, None, "7"],
    "epoch": [-1, False, 2**63, 2.0, None],
    "index": [-1, True, 2**63, 0.5, None],
    "place": [-1, (1 << 16) + 1, None, True, 1.0],
    "layout": [],  # anything goes here: layout.check validates it
    "layouts": [None, "x", [[0]], [[-1, []]], [["0", []]], [[True, []]], [[0, [], 1]], [[(1 << 16) + 1, []]]],
    "number": [-1, True, None, 1.5, "0", (1 << 16) + 1],
    "check_writes": [None, 0, 1, "yes"],
    "fingerprint": [-1, 1.5, True, "1", [1]],
    "seqs": [None, [1, -1], [True], [1.5], ["1"], "1", list(range(4097)), [2**63], {"a": 1}],
    "status": [[], "ok", 1, True, [["k", 1]]],
    "reason": ["r" * 4097, 5, b"reason", ["r"], True],
    "late_join": ["later", "", None, 1, ["now"]],
    "batch_size": [0, -1, True, 1.5, "8", (1 << 31) + 1],
    "device": ["d" * 65, 0, None, b"cpu"],
    "samples": [-1, 1.5, True, "1"],
    "count": [0, -1, True, None, 1.0],
    "skipped": [0, -1, True, None, 1.0],
    "taken_batches": [-1, None, True, 1.5],
    "taken_samples": [-1, None, False, "3"],
    "waiting": [-0.5, None, float("nan"), float("inf"), True, "1"],
    "group": [
        "job",
        [],
        ["job", 0, 2],
        ["", 0, 2, "pad"],
        ["j" * 129, 0, 2, "pad"],
        ["job", -1, 2, "pad"],
        ["job", 0, 0, "pad"],
        ["job", True, 2, "pad"],
        ["job", 0, 2.0, "pad"],
        ["job", 0, 2, "even"],
        ["job", 0, 2, "pad", 1],
        {"name": "job"},
    ],
    "until": [-1, 1.0, True, "3", 2**63],
    "epoch_done": [-1, 1.0, True, "3", [1]],
    "resume": [
        "s",
        [],
        ["s", 0, 0],
        ["s" * 65, 0, 0, False],
        ["s", -1, 0, False],
        ["s", 0, True, False],
        [1, 0, 0, False],
        ["s", 0, 0, 0],
        ["s", 0, 0, False, 0],
    ],
    "stream": [None, 1, "s" * 65, b"s"],
    "restarted": ["s", [], ["s"], ["s", -1], ["s", True], [1, 0], ["s" * 65, 0], ["s", 0, 0]],
    "session": ["s", [], ["s"], ["a" * 97, "t"], ["a", "t" * 65], [1, "t"], ["a", None], ["a", "t", "x"]],
    "starts_with": [0, -1, (1 << 31) + 1, 2.0, True, "2"],
    "token": [None, 1, "t" * 65, b"t", ["t"]],
}


def _fields(kind: Kind) -> dict[str, Any]:
    missing = set(SCHEMA[kind]) - set(VALID)
    assert not missing, f"test table lacks valid values for {sorted(missing)}"
    return {name: VALID[name] for name in SCHEMA[kind]}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _decode_or_protocol_error(frame: bytes, max_bytes: int = protocol.MAX_REQUEST_BYTES) -> None:
    """decode returns a valid message or raises ProtocolError, never anything else."""
    try:
        kind, msg = protocol.decode(frame, max_bytes)
    except ProtocolError:
        return
    assert isinstance(kind, Kind)
    assert set(msg) == set(SCHEMA[kind])
    for name, check in SCHEMA[kind].items():
        assert check(msg[name])


ALL_KINDS = list(Kind)
FIELD_CASES = [(k, f) for k in ALL_KINDS for f in SCHEMA[k]]
FIELD_IDS = [f"{k.value}.{f}" for k, f in FIELD_CASES]


# ---------------------------------------------------------------------------- round trips


def test_schema_covers_every_kind() -> None:
    assert set(SCHEMA) == set(Kind)


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda k: k.value)
def test_roundtrip_every_kind(kind: Kind) -> None:
    fields = _fields(kind)
    frame = protocol.encode(kind, **fields)
    assert isinstance(frame, bytes)
    got_kind, got = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
    assert got_kind is kind
    assert got == fields
    assert "k" not in got


@pytest.mark.parametrize(("kind", "field"), FIELD_CASES, ids=FIELD_IDS)
def test_roundtrip_edge_values(kind: Kind, field: str) -> None:
    for value in EDGES[field]:
        fields = {**_fields(kind), field: value}
        got_kind, got = protocol.decode(protocol.encode(kind, **fields), protocol.MAX_REPLY_BYTES)
        assert got_kind is kind
        assert got == fields


def test_roundtrip_preserves_types() -> None:
    fields = {**_fields(Kind.BATCH), "layout": [b"\x00\xff", "s", 1.5, None, True, [2**64 - 1]]}
    _, got = protocol.decode(protocol.encode(Kind.BATCH, **fields))
    assert got["layout"] == fields["layout"]
    assert type(got["layout"][0]) is bytes and type(got["layout"][1]) is str
    assert type(got["layout"][5]) is list


def test_batch_layout_survives_the_wire() -> None:
    batch = {"x": list(range(5)), "t": np.arange(6).reshape(2, 3)}
    p = layout.plan(batch)
    frame = protocol.encode(Kind.BATCH, **{**_fields(Kind.BATCH), "layout": p.encode()})
    _, msg = protocol.decode(frame)
    tree, leaves = layout.check(msg["layout"], p.nbytes)
    assert tree == p.tree
    assert leaves == list(p.leaves)


def test_encode_does_not_validate_but_decode_does() -> None:
    frame = protocol.encode(Kind.END, seq=-5, epoch=0, reason=None)
    with pytest.raises(ProtocolError, match="seq"):
        protocol.decode(frame)


# ---------------------------------------------------------------------------- bad fields


@pytest.mark.parametrize(("kind", "field"), FIELD_CASES, ids=FIELD_IDS)
def test_missing_field_is_rejected(kind: Kind, field: str) -> None:
    fields = _fields(kind)
    del fields[field]
    with pytest.raises(ProtocolError, match=field):
        protocol.decode(protocol.encode(kind, **fields), protocol.MAX_REPLY_BYTES)


@pytest.mark.parametrize(("kind", "field"), FIELD_CASES, ids=FIELD_IDS)
def test_bad_field_values_are_rejected(kind: Kind, field: str) -> None:
    for value in BAD[field]:
        fields = {**_fields(kind), field: value}
        with pytest.raises(ProtocolError, match=field):
            protocol.decode(protocol.encode(kind, **fields), protocol.MAX_REPLY_BYTES)


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("extra", ["zzz", "K", "kind", "", "seqs2"])
def test_unknown_extra_field_is_rejected(kind: Kind, extra: str) -> None:
    frame = _pack({**_fields(kind), extra: 1, "k": kind.value})
    with pytest.raises(ProtocolError, match="unknown fields"):
        protocol.decode(frame, protocol.MAX_REPLY_BYTES)


def test_bytes_key_is_an_unknown_field() -> None:
    frame = _pack({"k": "heartbeat", b"k": "heartbeat"})
    with pytest.raises(ProtocolError, match="unknown fields"):
        protocol.decode(frame)


# ---------------------------------------------------------------------------- bad frames


@pytest.mark.parametrize(
    "obj",
    [None, 5, -1, 1.5, True, "hello", b"hello", [], ["k", "bye"], [{"k": "bye"}]],
    ids=repr,
)
def test_non_map_messages_are_rejected(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        protocol.decode(_pack(obj))


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"seq": 1},
        {"k": None},
        {"k": "nope"},
        {"k": "HELLO"},
        {"k": "Bye"},
        {"k": " bye"},
        {"k": "closed!"},
        {"k": ""},
        {"k": 5},
        {"k": 1.5},
        {"k": True},
        {"k": b"bye"},
        {"k": ["bye"]},
        {"k": {"bye": 1}},
        {"K": "bye"},
    ],
    ids=repr,
)
def test_unknown_kinds_are_rejected(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="unknown message kind"):
        protocol.decode(_pack(obj))


def test_unknown_kind_error_names_the_kind() -> None:
    with pytest.raises(ProtocolError, match="'nope'"):
        protocol.decode(_pack({"k": "nope"}))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never used
        b"\x81",  # map of one, nothing follows
        b"\x81\xa1k",  # key, no value
        b"\x81\xa1k\xa3by",  # truncated str
        _pack({"k": "bye"}) + b"\x00",  # trailing data
        _pack({"k": "bye"}) * 2,
        _pack({1: 2}),  # int key
        _pack({"k": "status", "status": {1: 2}}),  # nested int key
        _pack({(1, 2): 3}),  # array key
        b"\x81\xa1k\xa3\xff\xfe\xfd",  # invalid UTF-8
        b"\x81\xa1k\xc7\x01\xff\x00",  # ext type
    ],
    ids=repr,
)
def test_undecodable_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(frame)


def test_frames_larger_than_the_limit_are_rejected() -> None:
    limit = protocol.MAX_REQUEST_BYTES
    reason = "r" * 4000
    frame = protocol.encode(Kind.ERROR, reason=reason)
    protocol.decode(frame)
    big = _pack({"k": "heartbeat", "pad": "x" * limit})
    assert len(big) > limit
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(big)
    # A frame exactly at the limit gets past the size check (and fails on its extra field).
    pad = "x" * (limit - len(_pack({"k": "heartbeat", "pad": ""})) - 2)
    exact = _pack({"k": "heartbeat", "pad": pad})
    assert len(exact) == limit
    with pytest.raises(ProtocolError, match="unknown fields"):
        protocol.decode(exact)
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(exact + b"\x00")


def test_max_bytes_argument_sets_the_limit() -> None:
    p = layout.plan([list(range(20_000))])
    frame = protocol.encode(Kind.BATCH, **{**_fields(Kind.BATCH), "layout": p.encode()})
    assert protocol.MAX_REQUEST_BYTES < len(frame) < protocol.MAX_REPLY_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(frame)
    kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
    assert kind is Kind.BATCH and msg["layout"] == p.encode()
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(protocol.encode(Kind.BYE), max_bytes=3)


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


LYING_HEADERS = {
    "bin32": b"\x81\xa1k\xc6\xff\xff\xff\xff",
    "bin32 some data": b"\x81\xa1k\xc6\xff\xff\xff\xff" + b"x" * 100,
    "str32": b"\x81\xa1k\xdb\xff\xff\xff\xff",
    "str16": b"\x81\xa1k\xda\xff\xff",
    "array32": b"\x81\xa1k\xdd\xff\xff\xff\xff",
    "array16": b"\x81\xa1k\xdc\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "map32 value": b"\x81\xa1k\xdf\xff\xff\xff\xff",
    "ext32": b"\x81\xa1k\xc9\xff\xff\xff\xff\x01",
    "bin at limit": b"\x81\xa1k\xc6" + _u32(protocol.MAX_REQUEST_BYTES),
    "array at limit": b"\x81\xa1k\xdd" + _u32(protocol.MAX_REQUEST_BYTES),
    "nested arrays": b"\x81\xa1k" + (b"\xdd" + _u32(protocol.MAX_REQUEST_BYTES)) * 2000,
    "nested maps": b"\x81\xa1k" + (b"\xdf" + _u32(protocol.MAX_REQUEST_BYTES) + b"\xa1a") * 1000,
    "deep nesting": b"\x81\xa1k" + b"\x91" * 10_000,
}


@pytest.mark.parametrize("frame", list(LYING_HEADERS.values()), ids=list(LYING_HEADERS))
@pytest.mark.parametrize("max_bytes", [protocol.MAX_REQUEST_BYTES, protocol.MAX_REPLY_BYTES])
def test_lying_length_headers_fail_fast(frame: bytes, max_bytes: int) -> None:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with pytest.raises(ProtocolError):
            protocol.decode(frame, max_bytes)
        best = min(best, time.perf_counter() - start)
    assert best < 0.05, f"decode of a {len(frame)}-byte frame took {best:.3f}s"


# ---------------------------------------------------------------------------- fuzzing


@FAST
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_other_errors(frame: bytes) -> None:
    _decode_or_protocol_error(frame)


@FAST
@given(st.binary(min_size=1, max_size=64))
def test_random_bytes_after_a_map_header(tail: bytes) -> None:
    _decode_or_protocol_error(b"\x81\xa1k" + tail)
    _decode_or_protocol_error(b"\x82\xa1k\xa5batch" + tail)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
    max_leaves=12,
)


@FAST
@given(_values)
def test_random_msgpack_objects(obj: Any) -> None:
    _decode_or_protocol_error(_pack(obj))


@FAST
@given(
    st.sampled_from([k.value for k in Kind] + ["nope"]),
    st.dictionaries(st.sampled_from(sorted(set(VALID)) + ["extra"]), _values, max_size=8),
)
def test_random_messages_of_known_kinds(kind: str, fields: dict[str, Any]) -> None:
    _decode_or_protocol_error(_pack({**fields, "k": kind}))


@FAST
@given(st.data())
def test_valid_messages_with_one_field_replaced(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from([k for k in ALL_KINDS if SCHEMA[k]]))
    fields = _fields(kind)
    field = data.draw(st.sampled_from(sorted(fields)))
    fields[field] = data.draw(_values)
    frame = protocol.encode(kind, **fields)
    _decode_or_protocol_error(frame, protocol.MAX_REPLY_BYTES)
    if not SCHEMA[kind][field](fields[field]):
        with pytest.raises(ProtocolError, match=field):
            protocol.decode(frame, protocol.MAX_REPLY_BYTES)


@FAST
@given(st.data())
def test_truncated_and_flipped_valid_frames(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(ALL_KINDS))
    frame = bytearray(protocol.encode(kind, **_fields(kind)))
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ProtocolError):
        protocol.decode(bytes(frame[:cut]), protocol.MAX_REPLY_BYTES)
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(frame), protocol.MAX_REPLY_BYTES)


@pytest.mark.parametrize("version", [0, 1, protocol.VERSION + 1, 2**63 - 1, None, "2"])
def test_other_protocol_versions_are_refused_before_their_fields_are_read(version):
    """A consumer of another version may send other HELLO fields; it is told the versions."""
    frame = msgpack.packb({"k": "hello", "version": version, "future": True})
    with pytest.raises(ProtocolError, match=f"speaks protocol .*this producer speaks {protocol.VERSION}"):
        protocol.decode(frame)


# What the protocol leaves to the transport: the shm reader decodes its descriptors strictly.
BAD_SHM_DESCRIPTORS = [
    ["shm", 0, "a"],
    ["shm", 0, "a", 1, 2],
    ["shm", 0, "a", -1],
    ["shm", 0, "a" * 256, 1],
    ["shm", 0, 5, 1],
    ["shm", 0, b"a", 1],
    ["shm", 0, "a", (1 << 48) + 1],
    ["shm", 0, "a", 1.0],
    ["shm", 0, "a", True],
]


@pytest.mark.parametrize("descriptor", BAD_SHM_DESCRIPTORS)
def test_shm_descriptors_are_decoded_strictly(descriptor):
    from tensorsocket.transport.shm import ArenaInfo

    protocol.decode(protocol.encode(Kind.ARENA, arena=descriptor), protocol.MAX_REPLY_BYTES)
    with pytest.raises(ProtocolError, match="shm arena descriptor"):
        ArenaInfo.decode(descriptor)


# ---------------------------------------------------------------------------- compact BATCH and RELEASE

U64 = 2**64 - 1
COMPACT_BATCHES = [
    (0, 0, 0, 0, 0, None),
    (7, 2, 3, 1, 3, 123456789),
    (2**63 - 1, 2**63 - 1, 2**63 - 1, 1 << 16, 2**32 - 1, U64),
    (5, 0, 4, 2, 1, 0),  # a fingerprint of 0 is still one
]


@pytest.mark.parametrize("fields", COMPACT_BATCHES)
def test_compact_batch_decodes_as_its_map_form(fields: tuple[Any, ...]) -> None:
    """The compact BATCH means exactly what the msgpack map with the same fields means."""
    frame = protocol.encode_batch(*fields)
    assert frame[0] == protocol.COMPACT and len(frame) < len(protocol.encode(Kind.BATCH, **_batch(fields)))
    assert protocol.decode(frame) == protocol.decode(protocol.encode(Kind.BATCH, **_batch(fields)))
    _decode_or_protocol_error(frame)
    assert protocol.decode_batch(frame) == fields  # (the consumer's way: a tuple, in BATCH_FIELDS order)


def _batch(fields: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(("seq", "epoch", "index", "place", "layout", "fingerprint"), fields, strict=True))


def test_a_batch_carrying_its_layout_travels_as_a_map() -> None:
    frame = protocol.encode_batch(7, 2, 3, 1, _layout(), None)
    assert frame[0] != protocol.COMPACT
    assert protocol.decode(frame) == (Kind.BATCH, _batch((7, 2, 3, 1, _layout(), None)))


@pytest.mark.parametrize("seqs", [[], [0], [1, 2, 3], [2**63 - 1], list(range(protocol.MAX_RELEASE_SEQS))])
def test_compact_release_decodes_as_its_map_form(seqs: list[int]) -> None:
    frame = protocol.encode_release(seqs)
    assert frame[0] == protocol.COMPACT
    assert (
        protocol.decode(frame)
        == protocol.decode(protocol.encode(Kind.RELEASE, seqs=seqs))
        == (
            Kind.RELEASE,
            {"seqs": seqs},
        )
    )


_GOOD_BATCH = protocol.encode_batch(7, 2, 3, 1, 3, 99)
BAD_COMPACT = {
    "empty after the mark": b"\xc1",
    "unknown compact kind": b"\xc1\x09" + bytes(41),
    "batch one byte short": _GOOD_BATCH[:-1],
    "batch one byte long": _GOOD_BATCH + b"\x00",
    "batch seq past int64": struct.pack("<BBQQQIIQB", 0xC1, 1, 2**63, 0, 0, 0, 0, 0, 0),
    "batch epoch past int64": struct.pack("<BBQQQIIQB", 0xC1, 1, 0, U64, 0, 0, 0, 0, 0),
    "batch index past int64": struct.pack("<BBQQQIIQB", 0xC1, 1, 0, 0, 2**63, 0, 0, 0, 0),
    "batch place past the limit": struct.pack("<BBQQQIIQB", 0xC1, 1, 0, 0, 0, (1 << 16) + 1, 0, 0, 0),
    "batch fingerprint flag neither 0 nor 1": struct.pack("<BBQQQIIQB", 0xC1, 1, 0, 0, 0, 0, 0, 5, 2),
    "release not whole seqs": b"\xc1\x02" + bytes(9),
    "release seq past int64": b"\xc1\x02" + struct.pack("<2Q", 1, 2**63),
    "release with too many seqs": protocol.encode_release([1] * (protocol.MAX_RELEASE_SEQS + 1)),
}


@pytest.mark.parametrize("frame", list(BAD_COMPACT.values()), ids=list(BAD_COMPACT))
def test_bad_compact_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="compact|bad"):
        protocol.decode(frame, protocol.MAX_REPLY_BYTES)


@pytest.mark.parametrize(
    "frame",
    [f for k, f in BAD_COMPACT.items() if k.startswith("batch")]
    + [_GOOD_BATCH[:2], protocol.encode_release([1])],
    ids=[k for k in BAD_COMPACT if k.startswith("batch")] + ["only the head", "a release"],
)
def test_decode_batch_rejects_what_decode_rejects_and_anything_but_a_compact_batch(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="compact|bad"):
        protocol.decode_batch(frame)


@FAST
@given(st.sampled_from([b"\xc1", b"\xc1\x01", b"\xc1\x02"]), st.binary(max_size=80))
def test_random_bytes_after_a_compact_mark(head: bytes, tail: bytes) -> None:
    _decode_or_protocol_error(head + tail, protocol.MAX_REPLY_BYTES)


@FAST
@given(st.data())
def test_truncated_and_flipped_compact_frames(data: st.DataObject) -> None:
    seqs = data.draw(st.lists(st.integers(0, 2**63 - 1), max_size=5))
    fields = data.draw(st.sampled_from(COMPACT_BATCHES))
    frame = bytearray(
        data.draw(st.sampled_from([protocol.encode_batch(*fields), protocol.encode_release(seqs)]))
    )
    cut = data.draw(st.integers(0, len(frame) - 1))
    if frame[1] == 1 or cut < 2:  # (a release cut at a seq's boundary is a shorter release)
        with pytest.raises(ProtocolError):
            protocol.decode(bytes(frame[:cut]), protocol.MAX_REPLY_BYTES)
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(frame), protocol.MAX_REPLY_BYTES)
