"""The status a producer reports: its typed records, a consumer's rates, and the bottleneck analysis.

``Producer.status()`` returns a :class:`ProducerStatus` and a STATUS message carries the same
dict (msgpack). Readers index its keys directly, so a renamed key fails loudly (and
``tests/test_status.py`` checks these records against a real producer's answer). Pure
functions only: no clocks, sockets or torch, so ``tensorsocket status`` imports this cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

RATE_WINDOW = 5.0  # seconds of STATS reports a consumer's rate is computed over

# One STATS report as the producer keeps it: (its monotonic time, batches, samples, waiting s)
Report = tuple[float, int, int, float]


class ConsumerRates(TypedDict):
    """A consumer's totals from its STATS reports and, over the last :data:`RATE_WINDOW`
    seconds of them, its rates. The rates are None until its reports span 0.2 s."""

    batches: int  # batches it took from the iterator
    samples: int  # samples in them
    waiting_s: float  # seconds it spent waiting for data
    samples_per_s: float | None
    batches_per_s: float | None
    waiting_share: float | None  # the share of its time it waited for data, 0..1


class ConsumerStatus(ConsumerRates):
    """One joined consumer, as the producer sees it."""

    label: str
    pid: int
    device: str
    batch_size: int | None  # None: it takes the producer's batches as they are
    late_join: str  # a LateJoin value: "replay", "next_epoch" or "now"
    joined_s_ago: float
    cursor: int | None  # the next sequence number it is sent; None while it waits for an epoch
    lag: int  # published batches not yet sent to it (0 while it waits for an epoch)
    catching_up: bool  # a replaying joiner the others wait for
    held: int  # batches it holds (sent, not released)
    received: int  # batches it was sent
    skipped: int  # batches it was moved past (stragglers="skip")
    # MiB of GPU memory it uses on the producer's GPU, as NVML reports it for its pid (any
    # CUDA context of its own included); None unless the transport is "cuda" and
    # nvidia-ml-py works, or when NVML lists no figure for its pid (not using that GPU)
    gpu_mib: float | None
    group: str | None  # the group it is a member of (None: it sees the whole stream)
    rank: int | None  # its rank in that group


class GroupStatus(TypedDict):
    """One group of consumers splitting the stream (the ranks of a distributed job)."""

    name: str
    size: int  # its world size
    tail: str  # "pad" or "drop": what its ranks get of an epoch's short last round
    state: str  # "forming" (waiting for ranks), "running", or "broken" (a rank left)
    ranks: list[int]  # the ranks connected
    received: list[int]  # batches sent to each of those ranks: their shares so far
    lag: int  # the largest lag of its ranks (published batches not yet sent)


class ProducerStatus(TypedDict):
    """What ``Producer.status()`` returns and a STATUS reply carries."""

    endpoint: str
    pid: int
    uptime_s: float
    slots: int  # the window
    places: int  # every arena index: window places and straggler room (groups add some)
    replay_batches: int  # the most batches the replay budget keeps (sized at the first batch; 0 before)
    replay_budget_bytes: int
    starts_with: int | None  # before the first batch: the consumers it waits for; None once started
    preparing: str | None  # a successor bringing its loader to the restart point: how far; else None
    kept_batches: int  # batches kept for replay now, where the loader made them (in a place or not)
    resident_batches: int  # published batches still in a place
    slot_bytes: int  # bytes of arenas allocated
    transport: str  # the store's kind: "shm", "cuda"
    device: str  # where batches are shared: "cpu", "cuda:0"
    # MiB of GPU memory the producer process uses on that GPU (its arenas, its CUDA context),
    # from NVML; None unless the transport is "cuda" and nvidia-ml-py works
    gpu_mib: float | None
    stragglers: str  # "stall" or "skip"
    max_lag: int | None  # None under "stall"
    epoch: int
    next_seq: int
    ended: bool
    batches_per_epoch: int | None  # None: the loader has no len()
    samples_per_epoch: int | None
    consumers: list[ConsumerStatus]
    groups: list[GroupStatus]
    published: int
    loader_wait: float  # seconds in next(loader)
    slot_wait: float  # seconds waiting for the slowest consumer to free a slot
    publish_time: float  # seconds writing and announcing, slot_wait included
    restaged: int  # kept batches written into a place again for a joiner
    bad_messages: int
    dropped_replies: int  # messages dropped: their peer's queue was full (it read none of them)


class TimeShares(TypedDict):
    """Where a producer's time went over ``span`` seconds, as shares of it."""

    span: float
    loader: float  # in next(loader)
    slot: float  # waiting for a free slot
    write: float  # writing and announcing batches
    idle: float  # the rest: waiting for consumers, or a wait still in progress


def check(status: Mapping[str, Any]) -> ProducerStatus:
    """``status`` as a :class:`ProducerStatus`; ValueError naming the keys it lacks (a producer
    of another version, say) instead of a KeyError somewhere in a reader."""
    missing = sorted(ProducerStatus.__annotations__.keys() - status.keys())
    consumers = status.get("consumers")
    if not isinstance(consumers, list):
        raise ValueError(f"the status has no list of consumers (missing keys: {missing})")
    for c in consumers:
        if not isinstance(c, Mapping):
            raise ValueError(f"a consumer's status is a {type(c).__name__}, not a dict")
        missing += [f"consumers[].{k}" for k in sorted(ConsumerStatus.__annotations__.keys() - c.keys())]
    if missing:
        raise ValueError(f"the status lacks {', '.join(sorted(set(missing)))}")
    return status  # type: ignore[return-value]


# ---------------------------------------------------------------------------- rates


def rates(stats: Sequence[Report], now: float) -> ConsumerRates:
    """A consumer's totals and, over its last few seconds of reports, samples/s, batches/s
    and the share of time it waited for data."""
    if not stats:
        return {
            "batches": 0,
            "samples": 0,
            "waiting_s": 0.0,
            "samples_per_s": None,
            "batches_per_s": None,
            "waiting_share": None,
        }
    t1, b1, s1, w1 = stats[-1]
    recent = [r for r in stats if now - r[0] <= RATE_WINDOW] or [stats[-1]]
    t0, b0, s0, w0 = recent[0]
    span = t1 - t0
    rate = span > 0.2
    return {
        "batches": b1,
        "samples": s1,
        "waiting_s": round(w1, 3),
        "samples_per_s": round((s1 - s0) / span, 2) if rate else None,
        "batches_per_s": round((b1 - b0) / span, 3) if rate else None,
        "waiting_share": round(min(1.0, (w1 - w0) / span), 3) if rate else None,
    }


# ---------------------------------------------------------------------------- analysis


def same_producer(status: ProducerStatus, previous: ProducerStatus | None) -> bool:
    """True when ``previous`` is an earlier snapshot of the producer ``status`` comes from
    (not of another one on the same name, started since)."""
    return (
        previous is not None
        and previous["pid"] == status["pid"]
        and previous["published"] <= status["published"]
        and previous["uptime_s"] < status["uptime_s"]
    )


def time_shares(status: ProducerStatus, previous: ProducerStatus | None = None) -> TimeShares:
    """Where the producer's time went, as shares of its uptime (or, given the previous
    snapshot of the same producer, of the time since): ``loader`` (in next(loader)),
    ``slot`` (waiting for the slowest consumer to free a slot), ``write`` (writing and
    announcing batches) and ``idle`` (the rest: waiting for consumers to join, or a loader
    wait still in progress, which is counted once it ends; a wait for a slot is counted while
    it lasts). Plus ``span``, the seconds covered."""
    loader_wait, slot_wait = float(status["loader_wait"]), float(status["slot_wait"])
    publish_time, span = float(status["publish_time"]), float(status["uptime_s"])
    if previous is not None and same_producer(status, previous):
        loader_wait -= previous["loader_wait"]
        slot_wait -= previous["slot_wait"]
        publish_time -= previous["publish_time"]
        span -= previous["uptime_s"]
    if span <= 0:
        return {"span": 0.0, "loader": 0.0, "slot": 0.0, "write": 0.0, "idle": 0.0}
    loader = loader_wait / span
    slot = slot_wait / span
    write = max(0.0, publish_time - slot_wait) / span
    busy = loader + slot + write
    if busy > 1.0:  # a loader wait begun before the span counts where it ends: never over 100%
        loader, slot, write = loader / busy, slot / busy, write / busy
    return {
        "span": span,
        "loader": loader,
        "slot": slot,
        "write": write,
        "idle": max(0.0, 1.0 - busy),
    }


def _rate(consumer: ConsumerStatus) -> float:
    for value in (consumer["samples_per_s"], consumer["batches_per_s"]):
        if value is not None and value > 0:
            return float(value)
    return math.inf


def behind(consumer: ConsumerStatus) -> int:
    """Published batches a consumer has not released: not yet sent (its lag) plus held. The
    producer may overwrite none of them, so the one furthest behind holds it back."""
    return consumer["lag"] + consumer["held"]


def slowest(status: ProducerStatus) -> ConsumerStatus | None:
    """The consumer holding the producer back: the furthest behind, then the one that
    waits least for data (it is busy, the others wait for it), then the lowest rate. One
    that has not reported its rates yet is not blamed on a tie."""
    consumers = status["consumers"]
    if not consumers:
        return None

    def waiting(c: ConsumerStatus) -> float:
        share = c["waiting_share"]
        return 1.0 if share is None else float(share)

    return min(consumers, key=lambda c: (-behind(c), waiting(c), _rate(c)))


def bottleneck(status: ProducerStatus, previous: ProducerStatus | None = None) -> str:
    """The bottleneck in plain words, from where the producer's time went (since the
    previous snapshot when given, else since it started)."""
    if not same_producer(status, previous):
        previous = None
    if status["ended"]:
        return "none: the stream has ended"
    if not status["published"]:
        if status["preparing"]:
            return f"none yet: {status['preparing']} (the trainers' HELLOs are answered once it is there)"
        if status["starts_with"] is not None:
            return (
                f"none yet: the stream starts once {status['starts_with']} consumer(s) joined (min_consumers, or "
                "after a restart its predecessor's consumers that rejoin; a group counts once all its ranks "
                f"joined), {len(status['consumers'])} connected"
            )
        return "none yet: nothing published (waiting for consumers to join, or for the first batch)"
    if not status["consumers"]:
        return "none: no consumer is connected (the producer waits for one)"
    late = slowest(status)
    assert late is not None
    who = f"the slowest consumer ({late['label']})"
    shares = time_shares(status, previous)
    progressed = previous is None or status["published"] > previous["published"]
    if not progressed:
        # Nothing published since the last look: the producer is inside a wait that is
        # counted only when it ends. A full window means it waits for a free slot.
        if behind(late) >= status["slots"] or late["catching_up"]:
            return f"{who}: no batch published for {shares['span']:.1f} s, the window is full"
        return f"the loader: no batch published for {shares['span']:.1f} s"
    parts = {"loader": shares["loader"], "slot": shares["slot"], "write": shares["write"]}
    top = max(parts, key=lambda k: parts[k])
    if top == "slot":
        return who
    if top == "write":
        return "the producer itself (writing batches into shared memory)"
    return "the loader"
