"""Wire messages: their kinds, msgpack encoding and strict validation. No pickle anywhere.

Every message is one frame holding a msgpack map ``{"k": kind, ...fields}``, except the two
sent for every batch, BATCH and RELEASE, which :func:`encode_batch` and :func:`encode_release`
pack into a fixed binary form (see :data:`COMPACT`): decoding a BATCH map took 2.9 us of a
consumer's ~60 us per batch, the compact form 1.1 us (``benchmarks.step_costs``). Decoding
checks the kind, every field's type and range and the total size, so a malformed or hostile
frame raises :class:`ProtocolError` and can never reach the state machine. The handshake
(HELLO) carries :data:`VERSION`; a peer speaking another version is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import Enum
from typing import Any

import msgpack

from .errors import ProtocolError
from .options import STRAGGLERS

VERSION = 15  # 15: PLACED (a group rank rejoining an epoch started again skips what it had more)
#: Largest frame a consumer may send; the producer also sets ZMQ_MAXMSGSIZE to this.
MAX_REQUEST_BYTES = 64 * 1024
#: Largest frame a producer may send (a BATCH whose layout has very many leaves).
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Most seqs one RELEASE may carry; a consumer sends more in several messages.
MAX_RELEASE_SEQS = 4096
_MAX_INT = 2**63 - 1
#: First byte of a compact frame: 0xc1 is the one byte msgpack never uses, so no msgpack
#: message starts with it. Then a kind byte and fixed little-endian fields:
#: BATCH: seq, epoch, index (u64), place, layout number (u32), fingerprint (u64), has one (u8);
#: RELEASE: its seqs (u64 each).
COMPACT = 0xC1
_BATCH_TAG, _RELEASE_TAG = 1, 2
_BATCH = struct.Struct("<BBQQQIIQB")
#: How a compact BATCH frame begins, and its fields in the order :func:`decode_batch` gives them
BATCH_HEAD = bytes([COMPACT, _BATCH_TAG])
BATCH_FIELDS = ("seq", "epoch", "index", "place", "layout", "fingerprint")
_RELEASE_HEAD = bytes([COMPACT, _RELEASE_TAG])
_MAX_PLACE = 1 << 16
#: A consumer's late-join policies (tensorsocket.flow.LateJoin values).
LATE_JOIN = ("replay", "next_epoch", "now")
#: Where batches live: host shared memory or GPU memory shared by CUDA IPC.
TRANSPORTS = ("shm", "cuda")
#: What a group does with an epoch's short last round (tensorsocket.flow.Tail values).
TAILS = ("pad", "drop")


class Kind(str, Enum):
    """Message kinds. Consumer to producer: HELLO, READY, RELEASE, HEARTBEAT, STATS, BYE,
    MODIFIED, STATUS (READY: a group member began iterating, from a restored position or not).
    Producer to consumer: WELCOME, ARENA, LAYOUT, BATCH, SKIPPED, EPOCH_END, END, HEARTBEAT,
    EVICTED, ERROR, STATUS, GROUP_BROKEN, PLACED. LAYOUT numbers a layout that BATCH messages then name
    by number (tensorsocket.layout_table); END carries a reason when the producer stopped on an
    error; SKIPPED says how many batches a straggler was moved past, where the gap is;
    GROUP_BROKEN that another member of this consumer's group left (nothing more comes); PLACED
    where a group rank rejoining a producer that starts its epoch again goes on in it; BYE
    says whether the consumer left at an epoch's end (its group's others may finish that epoch).
    SESSION (consumer, on its session connection), SWITCHED and LARGE (producer) move a
    consumer's messages to a connection of its own (tensorsocket.session)."""

    HELLO = "hello"
    WELCOME = "welcome"
    ARENA = "arena"
    LAYOUT = "layout"
    BATCH = "batch"
    EPOCH_END = "epoch_end"
    END = "end"
    SKIPPED = "skipped"
    RELEASE = "release"
    HEARTBEAT = "heartbeat"
    STATS = "stats"
    BYE = "bye"
    MODIFIED = "modified"
    STATUS = "status"
    EVICTED = "evicted"
    ERROR = "error"
    GROUP_BROKEN = "group_broken"
    PLACED = "placed"
    READY = "ready"
    SESSION = "session"
    SWITCHED = "switched"
    LARGE = "large"


def _int(lo: int = 0, hi: int = _MAX_INT) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _num(lo: float = 0.0, hi: float = 1e9) -> Callable[[Any], bool]:
    return lambda v: type(v) in (int, float) and lo <= v <= hi


def _str(max_len: int = 256) -> Callable[[Any], bool]:
    return lambda v: type(v) is str and len(v) <= max_len


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _ints(max_len: int) -> Callable[[Any], bool]:
    one = _int()
    return lambda v: type(v) is list and len(v) <= max_len and all(one(x) for x in v)


def _group(v: Any) -> bool:
    # [name, rank, world size, tail]; the flow checks rank < size and the members agree.
    return (
        type(v) is list
        and len(v) == 4
        and _str(128)(v[0])
        and len(v[0]) > 0
        and _int(0, 1 << 16)(v[1])
        and _int(1, 1 << 16)(v[2])
        and v[3] in TAILS
    )


def _resume(v: Any) -> bool:
    # [stream, epoch, index, rejoined]: a restored consumer's position (Consumer.load_state_dict),
    # or (rejoined) the batch after the last one it received from a producer that died
    return (
        type(v) is list
        and len(v) == 4
        and _str(64)(v[0])
        and _int()(v[1])
        and _int()(v[2])
        and type(v[3]) is bool
    )


# Streams a restarted one names besides the one it replaced (see replaced_streams)
MAX_EARLIER_STREAMS = 16


def _restarted(v: Any) -> bool:
    # [stream, epoch, *earlier]: see replaced_streams
    return (
        type(v) is list
        and 2 <= len(v) <= 2 + MAX_EARLIER_STREAMS
        and _str(64)(v[0])
        and _int()(v[1])
        and all(map(_str(64), v[2:]))
    )


def replaced_streams(restarted: list[Any] | None) -> list[str]:
    """The streams whose consumers rejoin a stream that started an epoch again (its WELCOME's
    and state file's ``restarted``: [stream, epoch, *earlier]): the stream it replaced, whose
    ``epoch`` it publishes again from its start, and the streams that one had replaced in turn
    (a successor killed after it published: its consumers' predecessors' consumers, stopped
    meanwhile, may rejoin still). Each rejoins at its own epoch's start, that epoch or a later."""
    return [] if restarted is None else [restarted[0], *restarted[2:]]


def restarting(stream: str, epoch: int, restarted: list[Any] | None) -> list[Any]:
    """The ``restarted`` of a stream that starts ``epoch`` of ``stream`` again, which itself
    had ``restarted`` (the earliest streams dropped past MAX_EARLIER_STREAMS)."""
    return [stream, epoch, *replaced_streams(restarted)[:MAX_EARLIER_STREAMS]]


def _any(v: Any) -> bool:
    return True


def _layouts(v: Any) -> bool:
    # [[number, layout], ...]: the layouts numbered so far (layout_table checks each layout)
    return (
        type(v) is list
        and len(v) <= 1 << 10
        and all(type(e) is list and len(e) == 2 and _int(0, 1 << 16)(e[0]) for e in v)
    )


def _session(v: Any) -> bool:
    return type(v) is list and len(v) == 2 and _str(96)(v[0]) and _str(64)(v[1])


def _arena(v: Any) -> bool:
    # [transport, place, ...]: the rest is decoded, strictly, by that transport's reader.
    return type(v) is list and 2 <= len(v) <= 8 and v[0] in TRANSPORTS and _int(0, 1 << 16)(v[1])


# Required fields per kind and the check each value must pass. Layout trees and status
# payloads are checked by their own readers (layout.unpack bounds-checks every leaf).
SCHEMA: dict[Kind, dict[str, Callable[[Any], bool]]] = {
    Kind.HELLO: {
        "version": _int(),
        "pid": _int(1, (1 << 31) - 1),
        "boot_id": _str(64),
        "pidns": _int(),
        "label": _str(128),
        "prefetch": _int(1, 1 << 16),
        "timeout": _num(0.05, 86400.0),
        "late_join": lambda v: v in LATE_JOIN,
        "batch_size": _opt(_int(1, 1 << 31)),
        "device": _str(64),
        "group": _opt(_group),
        "resume": _opt(_resume),
        "check_writes": lambda v: type(v) is bool,  # it checks fingerprints: send them
    },
    Kind.WELCOME: {
        "pid": _int(1, (1 << 31) - 1),
        "boot_id": _str(64),
        "pidns": _int(),
        "batches": _opt(_int()),
        "samples": _opt(_int()),
        "slots": _int(1, 1 << 16),
        "stragglers": lambda v: v in STRAGGLERS,  # "stall": a consumer that takes nothing stops the others
        "transport": lambda v: v in TRANSPORTS,
        "gpu": _opt(_str(96)),
        "arenas": lambda v: type(v) is list and len(v) <= 1 << 16 and all(map(_arena, v)),
        "heartbeat": _num(0.001, 3600.0),
        "stream": _str(64),  # this stream's id: a consumer's saved position is only good on it
        "restarted": _opt(_restarted),
        "layouts": _layouts,
        "session": _opt(_session),  # [address, token] of a connection of this consumer's own
        "starts_with": _opt(_int(1, 1 << 31)),  # before its first batch: consumers it waits for
    },
    Kind.ARENA: {"arena": _arena},
    Kind.LAYOUT: {"number": _int(0, 1 << 16), "layout": _any},
    Kind.BATCH: {
        "seq": _int(),
        "epoch": _int(),
        "index": _int(),
        "place": _int(0, 1 << 16),
        "layout": _any,  # a layout's number (see LAYOUT), or the layout itself
        "fingerprint": _opt(_int(0, 2**64 - 1)),
    },
    Kind.SKIPPED: {"count": _int(1)},
    Kind.EPOCH_END: {"seq": _int(), "epoch": _int()},
    Kind.END: {"seq": _int(), "epoch": _int(), "reason": _opt(_str(4096))},  # epoch: the next, never begun
    Kind.RELEASE: {"seqs": _ints(MAX_RELEASE_SEQS)},
    Kind.HEARTBEAT: {},
    Kind.STATS: {"taken_batches": _int(), "taken_samples": _int(), "waiting": _num(0.0, 1e12)},
    Kind.BYE: {"epoch_done": _opt(_int())},  # the epoch whose end its trainer took, nothing taken since
    Kind.MODIFIED: {"seq": _int(), "epoch": _int(), "index": _int()},
    Kind.STATUS: {"status": _opt(lambda v: type(v) is dict)},
    Kind.EVICTED: {"reason": _str(4096)},
    Kind.ERROR: {"reason": _str(4096)},
    Kind.GROUP_BROKEN: {"reason": _str(4096), "until": _opt(_int())},  # None: mid-epoch
    Kind.PLACED: {"epoch": _int(), "index": _int(), "skipped": _int(1)},
    Kind.READY: {"resume": _opt(_resume)},
    Kind.SESSION: {"token": _str(64)},
    Kind.SWITCHED: {},
    Kind.LARGE: {},
}


_FIELDS = {kind: frozenset(schema) for kind, schema in SCHEMA.items()}
_KINDS = {kind.value: kind for kind in Kind}


def encode(kind: Kind, **fields: Any) -> bytes:
    """Encode one message. Fields are not validated here: the sender is our own code."""
    fields["k"] = kind.value
    return msgpack.packb(fields, use_bin_type=True)


def encode_batch(seq: int, epoch: int, index: int, place: int, layout: Any, fingerprint: int | None) -> bytes:
    """A BATCH message: compact when its layout is a number (the usual case: a layout that
    repeats is announced once, then named), else a msgpack map carrying the layout itself."""
    if type(layout) is not int:
        return encode(
            Kind.BATCH, seq=seq, epoch=epoch, index=index, place=place, layout=layout, fingerprint=fingerprint
        )
    has = fingerprint is not None
    return _BATCH.pack(COMPACT, _BATCH_TAG, seq, epoch, index, place, layout, fingerprint if has else 0, has)


def encode_release(seqs: list[int]) -> bytes:
    """A RELEASE message (compact) for at most :data:`MAX_RELEASE_SEQS` seqs."""
    return _RELEASE_HEAD + struct.pack(f"<{len(seqs)}Q", *seqs)


def decode_batch(frame: bytes) -> tuple[int, int, int, int, int, int | None]:
    """A compact BATCH frame's fields, checked: (seq, epoch, index, place, layout number,
    fingerprint or None). A consumer reads its batches through this, not :func:`decode`: a
    tuple instead of a map, and one call instead of three (each call on the per-batch path
    costs a few us from cold caches; see :mod:`tensorsocket.consumer.inbox`)."""
    n = len(frame)
    if n != _BATCH.size or frame[:2] != BATCH_HEAD:
        raise ProtocolError(f"compact batch message of {n} bytes, expected {_BATCH.size}")
    _, _, seq, epoch, index, place, layout, fingerprint, has = _BATCH.unpack(frame)
    if seq > _MAX_INT or epoch > _MAX_INT or index > _MAX_INT or place > _MAX_PLACE or has > 1:
        raise ProtocolError(
            f"batch message has a bad field: seq {seq}, epoch {epoch}, index {index}, place {place}, "
            f"fingerprint flag {has}"
        )
    return seq, epoch, index, place, layout, fingerprint if has else None


def _decode_compact(frame: bytes) -> tuple[Kind, dict[str, Any]]:
    n = len(frame)
    if frame[:2] == BATCH_HEAD:
        return Kind.BATCH, dict(zip(BATCH_FIELDS, decode_batch(frame), strict=True))
    if frame[:2] == _RELEASE_HEAD:
        count, rest = divmod(n - 2, 8)
        if rest or count > MAX_RELEASE_SEQS:
            raise ProtocolError(
                f"compact release message of {n} bytes: not 2 + 8 per seq, or more than {MAX_RELEASE_SEQS} seqs"
            )
        seqs = list(struct.unpack_from(f"<{count}Q", frame, 2))
        if seqs and max(seqs) > _MAX_INT:
            raise ProtocolError(f"release message has a bad seq: {max(seqs)}")
        return Kind.RELEASE, {"seqs": seqs}
    raise ProtocolError(f"unknown compact message kind {frame[1:2]!r}")


def decode(frame: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> tuple[Kind, dict[str, Any]]:
    """Decode and validate one frame; raise ProtocolError naming what was wrong."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    if frame[:1] == b"\xc1":
        return _decode_compact(frame)
    n = len(frame)  # no string, container or ext in a frame can be longer than the frame
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=n,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None
    if type(msg) is not dict:
        raise ProtocolError(f"message is a {type(msg).__name__}, not a map")
    k = msg.pop("k", None)
    kind = _KINDS.get(k) if type(k) is str else None
    if kind is None:
        raise ProtocolError(f"unknown message kind {k!r:.40}")
    if kind is Kind.HELLO and msg.get("version") != VERSION:
        # Before the fields: another version may have other fields, and this is what to say.
        raise ProtocolError(
            f"consumer speaks protocol {msg.get('version')!r:.20}, this producer speaks {VERSION}: "
            "install the same tensorsocket version on both sides"
        )
    schema = SCHEMA[kind]
    if msg.keys() != _FIELDS[kind]:
        missing = [f for f in schema if f not in msg]
        if missing:
            raise ProtocolError(f"{kind.value} message lacks field {missing[0]!r}")
        raise ProtocolError(
            f"{kind.value} message has unknown fields {sorted(map(str, msg.keys() - schema.keys()))}"
        )
    for field, check in schema.items():
        if not check(msg[field]):
            raise ProtocolError(f"{kind.value} message has a bad {field!r}: {msg[field]!r:.80}")
    return kind, msg
