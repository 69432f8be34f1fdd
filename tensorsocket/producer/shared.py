"""What the producer's two threads share: one record, guarded by one condition.

The caller's thread (publishing) and the I/O thread (the socket) meet only here. Every field
is read and written under ``changed`` (a Condition over one lock), except where noted:

* ``flow``: both threads (publish / release, join / leave).
* ``peers``: the I/O thread adds and drops them; the caller's thread reads them, and notes
  a consumer's RELEASE, STATS and HEARTBEAT in them (``apply_routine``) when it reads those.
* ``outbox``: both queue frames (``post``) in the order the flow decided them; the I/O thread
  drains it. A frame for a consumer on a session goes straight to its connection instead
  (``direct``, set by the I/O thread) while nothing is queued before it: the caller's thread
  then publishes without waking the I/O thread (``io_wanted`` says when it must).
* ``store``: the caller's thread prepares and writes places *outside* the lock (the store's
  own rule: only the caller's thread writes) and installs them under it; the I/O thread reads
  its descriptors and admits consumers under it; close() closes it under it.
* ``stats``: the caller's thread adds its timings; the I/O thread counts bad messages.
* ``layouts``: the caller's thread numbers layouts; the I/O thread reads them for WELCOME.
* ``first_join``, ``departed``: the I/O thread; ``replay_batches``, ``batch_bytes``,
  ``starts_with``: the caller's thread.
* ``place_wait_since``: the caller's thread sets it while it waits for a place, without the
  lock; :meth:`Shared.status` reads it once.
* ``tracker``: a resumable producer's state file (:class:`.restart.Tracker`, its own lock,
  taken after this one): the caller's thread writes it as it publishes, the I/O thread when a
  join moves the restart point back (:meth:`Shared.send_joined`); ``joins`` counts those,
  ``taken`` is the point last taken for it (the publishing thread writes its own after).
* ``preparing``, ``held``, ``held_beat``: a successor bringing its loader to the restart
  point (:mod:`.successor`): the caller's thread sets ``preparing`` (without the lock while
  it only reports progress) and clears it; the I/O thread keeps the HELLOs it holds meanwhile.
* ``stop``: an Event, set by close() from any thread; ``wakeup``: any thread pokes it.
* ``publisher_at``, ``publisher_polling``: the caller's thread's turn at the consumers'
  sessions (:mod:`.session_turns`): while it lasts, the I/O thread reads them only for what
  the caller's thread left it, and before a ZeroMQ message. The I/O thread reads both
  without the lock (a stale answer costs a wake-up or a poll's delay), and the caller's
  thread clears ``publisher_polling`` without it when a wait ends. ``publisher_wakeup``:
  poked by :meth:`Shared.notify` while the caller's thread polls.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .. import gpu_memory, protocol
from ..flow import Action, Deliver, Flow, GroupBroken, Placed, Skipped
from ..flow_groups import NotRejoined
from ..layout import Plan
from ..layout_table import LayoutTable
from ..protocol import Kind
from ..status import ConsumerStatus, GroupStatus, ProducerStatus, Report, rates
from ..transport import Store
from ..wakeup import Wakeup
from .restart import Tracker, rejoinable

log = logging.getLogger("tensorsocket")

TICK = 0.05  # seconds between liveness checks, and the longest any wait goes unchecked
TICK_MS = int(TICK * 1000)
ROUTINE = frozenset((Kind.RELEASE, Kind.STATS, Kind.HEARTBEAT))
_MAX_HEARTBEAT = 1.0


def heartbeat_every(timeout: float) -> float:
    """Seconds between heartbeats to a consumer with this ``timeout``: four before it would
    give up on the producer, and at least one a second."""
    return min(_MAX_HEARTBEAT, timeout / 4)


@dataclass
class Peer:
    """What the I/O thread knows of a joined consumer besides its flow state."""

    label: str
    pid: int
    timeout: float
    local: bool  # same host and pid namespace: its pid can be watched
    joined: float
    last_seen: float
    device: str = "cpu"
    batch_size: int | None = None
    last_sent: float = 0.0
    transport: str = "shm"  # the transport it reads batches through (the store's admit says)
    check_writes: bool = False  # it checks each batch's fingerprint at release
    modified: int = 0  # the MODIFIED reports it sent (producer/writes.py)
    counted: bool = False  # the state file counted it among those a successor waits for (resume)
    # its STATS reports, the last few seconds of them
    stats: collections.deque[Report] = field(default_factory=lambda: collections.deque(maxlen=32))

    def describe(self) -> str:
        return f"consumer {self.label!r} (pid {self.pid})"


@dataclass(frozen=True)
class Config:
    """The producer's settings, fixed at construction; read by both threads without the lock."""

    endpoint: str
    slots: int
    replay: int
    stragglers: str
    max_lag: int | None
    batches_per_epoch: int | None
    samples_per_epoch: int | None
    stream: str = ""  # this stream's id (a restored consumer's position names the stream it is on)
    restarted: list[Any] | None = None  # [old stream, epoch, *earlier]: protocol.replaced_streams
    succeeds: bool = False  # resumed a predecessor's stream (its consumers may write to us unawares)


class Shared:
    """The record both threads share (see the module docstring for who writes what)."""

    def __init__(self, config: Config, flow: Flow, store: Store) -> None:
        self.config = config
        self.flow = flow
        self.store = store
        self.peers: dict[Hashable, Peer] = {}
        self.outbox: collections.deque[tuple[Hashable, bytes]] = collections.deque()
        # (cid, frame): sent over its session? None: no (queue it); True: yes, but it waits for room
        self.direct: Callable[[Hashable, bytes], bool | None] | None = None
        self.io_wanted = False  # something was queued since the I/O thread last drained the outbox
        self.layouts = LayoutTable()
        # ``with shared.lock`` is ``with shared.changed`` a Python call less on each side (the
        # publishing thread takes it three times a batch); wait and notify go through ``changed``
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.wakeup = Wakeup()
        self.stop = threading.Event()
        self.first_join: float | None = None
        # group members that left, described for the GROUP_BROKEN their group's others get
        # (some only once they were sent their share of the epoch); the last few
        self.departed: collections.OrderedDict[Hashable, str] = collections.OrderedDict()
        self.replay_batches = 0  # sized at the first batch, from its bytes
        self.batch_bytes: int | None = None  # the first batch's (the places' size: see .room)
        # before the first batch, the consumers it waits for (min_consumers, or those of before
        # a restart); None once the stream started. WELCOME and status() say it.
        self.starts_with: int | None = None
        self.tracker: Tracker | None = None
        self.preparing: str | None = None  # what a successor does before it answers a HELLO
        self.held: dict[Hashable, dict[str, Any]] = {}  # the HELLOs it holds meanwhile, by sender
        self.held_beat = 0.0  # when it last sent their senders a heartbeat
        self.joins = 0  # joins that moved the restart point back (orders the state file's writes)
        self.taken = 0  # the restart point restart_where() last gave
        self.awaited = 0  # a successor before its first batch: its predecessor's consumers it waits for
        # loader_wait: in next(loader); slot_wait: for the slowest consumer to free a place;
        # publish_time: writing and announcing (slot_wait included)
        self.stats: dict[str, Any] = {
            "published": 0,
            "loader_wait": 0.0,
            "slot_wait": 0.0,
            "publish_time": 0.0,
            "restaged": 0,  # kept batches written into a place again for a joiner
            "bad_messages": 0,
            "dropped_replies": 0,  # messages to a peer whose queue was full (it read nothing): see io_loop
        }
        self.place_wait_since: float | None = None  # (perf_counter) a wait for a free place began
        self.born = time.monotonic()
        self.publisher_at = 0.0  # (monotonic) the caller's thread last read the sessions; 0: handed over
        self.publisher_polling = False  # it sleeps in poll() on them (and on publisher_wakeup)
        self.publisher_wakeup = Wakeup()

    def notify(self) -> None:
        """Wake whoever waits for a change (lock held): the condition's waiters, and the caller's
        thread if it sleeps polling the sessions instead."""
        self.changed.notify_all()
        if self.publisher_polling:
            self.publisher_wakeup.wake()

    def apply_routine(self, cid: Hashable, kind: Kind, msg: dict[str, Any], now: float) -> bool:
        """Apply a joined consumer's RELEASE, STATS or HEARTBEAT (lock held): the messages that
        come with every few batches, which either thread applies. False for any other message
        (the I/O thread's to apply)."""
        peer = self.peers.get(cid)
        if peer is None or kind not in ROUTINE:
            return False
        peer.last_seen = now
        if kind is Kind.RELEASE:
            self.send_all(self.flow.release(cid, msg["seqs"]))
        elif kind is Kind.STATS:
            peer.stats.append((now, msg["taken_batches"], msg["taken_samples"], float(msg["waiting"])))
        return True

    def post(self, cid: Hashable, frame: bytes, now: float | None = None) -> None:
        """Send ``frame`` to ``cid`` over its session, or queue it for the I/O thread when it
        has none or anything is queued before it (lock held: the order is the lock's)."""
        waits = None if self.outbox or self.direct is None else self.direct(cid, frame)
        if waits is None:
            self.outbox.append((cid, frame))
            self.io_wanted = True
            return
        self.io_wanted |= waits  # it waits for room in the kernel: the I/O thread polls for it
        peer = self.peers.get(cid)
        if peer is not None:
            peer.last_sent = time.monotonic() if now is None else now

    def send_all(self, actions: list[Action]) -> None:
        """Send or queue what the flow decided (lock held)."""
        if not actions:
            return
        if self.tracker is not None:
            self._count_first_sends(actions)
        now = time.monotonic()  # (once: a batch is sent to every consumer at once)
        for action in actions:
            if type(action) is Deliver:
                self.post(action.consumer, action.entry.payload, now)
            elif isinstance(action, Skipped):
                self.post(action.consumer, protocol.encode(Kind.SKIPPED, count=action.count), now)
            elif isinstance(action, Placed):
                self._placed(action, now)
            else:
                assert isinstance(action, GroupBroken)
                self.post(action.consumer, self._group_broken(action), now)

    def _placed(self, action: Placed, now: float) -> None:
        """Tell a group rank where it goes on in an epoch started again, and log why."""
        state = self.flow.consumers[action.consumer]
        peer, group = self.peers.get(action.consumer), state.group
        log.warning(
            "%s, rank %d of group %r, goes on at batch %d of epoch %d, which starts again in a new order: "
            "it skips its first %d batch(es) of that order, for as many of the old it had beyond what the "
            "others get again, so every rank of the group ends the epoch after as many batches",
            action.consumer if peer is None else peer.describe(), state.rank, group and group.name,
            action.index, action.epoch, action.skipped,
        )  # fmt: skip
        self.post(
            action.consumer,
            protocol.encode(Kind.PLACED, epoch=action.epoch, index=action.index, skipped=action.skipped),
            now,
        )

    def _count_first_sends(self, actions: list[Action]) -> None:
        """Before a consumer's first entry goes out, whatever sends it (a publish, a release
        that lets it take more, a replayed batch written again, its group's start), the state
        file counts it among the consumers a successor waits for: it rejoins after what it
        received, and a successor that started without it could publish past it (lock held)."""
        first = False
        for action in actions:
            if type(action) is Deliver:
                peer = self.peers.get(action.consumer)
                if peer is not None and not peer.counted:
                    peer.counted = first = True
        if first and self.tracker is not None:
            self.joins += 1  # (a point taken before this one must not be written after it)
            self.tracker.save(*self.restart_where(), force=True)

    def send_joined(self, actions: list[Action]) -> None:
        """Send what a join (or a group's start) decided (lock held). A joiner that replays
        moves the restart point back: the state file says so before any of its batches goes
        out, or a successor started after a crash would resume past batches it never got."""
        # Back past the point last written, or past the one the publishing thread took and
        # may be about to write (that one must not land after the join: joins supersedes it).
        point = self.flow.restart_point()
        if self.tracker is not None and (self.tracker.behind(point) or point < self.taken):
            self.joins += 1
            self.tracker.save(*self.restart_where(), force=True)
        self.send_all(actions)

    def restart_where(self) -> tuple[int, int, int, int]:
        """(restart point, keep-from seq, consumers a successor waits for, joins) for the state
        file (lock held)."""
        flow = self.flow
        self.taken = flow.restart_point()
        # (a successor killed before they rejoined leaves them to the next: its file names them)
        return self.taken, flow.keep_from(), max(rejoinable(flow), self.awaited), self.joins

    def _group_broken(self, action: GroupBroken) -> bytes:
        who = self.departed.get(
            action.lost, str(action.lost) if isinstance(action.lost, NotRejoined) else "left"
        )
        when = "mid-epoch" if action.until is None else f"after the end of epoch {action.until}"
        reason = (
            f"rank {action.rank} of group {action.group!r} ({who}) {when}: the group's ranks can no "
            "longer get equal shares, so this one is sent nothing more. Restart the job as a whole "
            "(torchrun's elastic restart does) to join again as a new group"
        )
        return protocol.encode(Kind.GROUP_BROKEN, reason=reason, until=action.until)

    def broadcast(self, frame: bytes, transport: str | None = None) -> None:
        """Queue ``frame`` for every joined consumer, or those reading through ``transport``
        (lock held)."""
        for cid, peer in list(self.peers.items()):
            if transport in (None, peer.transport):
                self.post(cid, frame)

    def write(self, place: int, plan: Plan, check: bool) -> int | None:
        """Write ``plan`` into the reserved ``place`` (lock not held), announcing a larger
        arena first if it needs one; its fingerprint if the store took one."""
        arena = self.store.prepare(place, plan.nbytes)  # slow for big arenas: not under the lock
        if arena is not None:
            with self.changed:
                for descriptor in self.store.install(arena):  # one per transport served
                    self.broadcast(protocol.encode(Kind.ARENA, arena=descriptor), descriptor[0])
        # Announce after completion: the BATCH goes out only once the bytes are where
        # consumers read them (on a GPU, the copy's event fired), so no consumer ever
        # waits on the producer's GPU work.
        return self.store.write(place, plan, check).wait()

    def fingerprints_wanted(self) -> bool:
        """Does a joined consumer check fingerprints (lock held)? A host consumer that maps
        batches read-only (the default) needs none; computing one was ~10% of the
        publisher's CPU with small batches."""
        for peer in self.peers.values():  # (a loop, not any() over a generator: asked twice a batch)
            if peer.check_writes:
                return True
        return False

    def _groups(self) -> list[GroupStatus]:
        flow = self.flow
        out: list[GroupStatus] = []
        for group in flow.groups():
            members = sorted((rank, cid) for rank, cid in group.members.items() if cid in flow.consumers)
            states = [flow.consumers[cid] for _, cid in members]
            broken = group.lost is not None
            out.append(
                {
                    "name": group.name,
                    "size": group.size,
                    "tail": group.tail.value,
                    "state": "broken" if broken else "running" if group.started else "forming",
                    "ranks": [rank for rank, _ in members],
                    "received": [s.received for s in states],
                    "lag": max((flow.lag(cid) for _, cid in members), default=0),
                }
            )
        return out

    def status(self) -> ProducerStatus:
        """A snapshot of consumers, places and timings (lock held)."""
        now = time.monotonic()
        config, flow = self.config, self.flow
        # GPU memory by pid on the producer's GPU (None: host memory, or not known, as for the
        # CPU stand-in's GPUs, which NVML does not know; never raises, cached)
        gpu_mib = gpu_memory.process_mib(self.store.gpu)
        consumers: list[ConsumerStatus] = []
        for cid, peer in self.peers.items():
            state = flow.consumers[cid]
            consumers.append(
                {
                    "label": peer.label,
                    "pid": peer.pid,
                    "device": peer.device,
                    "batch_size": peer.batch_size,
                    "late_join": state.policy.value,
                    "joined_s_ago": round(now - peer.joined, 3),
                    "cursor": state.cursor,
                    "lag": flow.lag(cid),
                    "catching_up": state.catching_up,
                    "held": len(state.held),
                    "received": state.received,
                    "skipped": state.skipped,
                    # a pid of another PID namespace means nothing to NVML here
                    "gpu_mib": gpu_mib.get(peer.pid) if gpu_mib is not None and peer.local else None,
                    "group": None if state.group is None else state.group.name,
                    "rank": None if state.group is None else state.rank,
                    **rates(peer.stats, now),
                }
            )
        stats = dict(self.stats)
        since = self.place_wait_since  # (read once: the publishing thread clears it unlocked)
        if since is not None:  # a wait still on: counted too, or a long stall looked idle
            waited = time.perf_counter() - since
            stats["slot_wait"] += waited
            stats["publish_time"] += waited
        stats = {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()}
        return {
            "endpoint": config.endpoint,
            "pid": os.getpid(),
            "uptime_s": round(max(now - self.born, 1e-9), 3),
            "slots": config.slots,
            "places": flow.place_count,
            "replay_batches": self.replay_batches,
            "starts_with": self.starts_with,
            "preparing": None
            if self.preparing is None
            else f"{self.preparing}; {len(self.held)} HELLO(s) held",
            "replay_budget_bytes": config.replay,
            "kept_batches": flow.kept(),
            "resident_batches": flow.resident(),
            "slot_bytes": self.store.bytes,
            "transport": self.store.kind,
            "device": self.store.device,
            "gpu_mib": None if gpu_mib is None else gpu_mib.get(os.getpid()),
            "stragglers": config.stragglers,
            "max_lag": config.max_lag,
            "epoch": flow.epoch,
            "next_seq": flow.next_seq,
            "ended": flow.ended,
            "batches_per_epoch": config.batches_per_epoch,
            "samples_per_epoch": config.samples_per_epoch,
            "consumers": consumers,
            "groups": self._groups(),
            **stats,  # type: ignore[typeddict-item]
        }
