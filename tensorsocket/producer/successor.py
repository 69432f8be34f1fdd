"""A producer started with ``resume=True``: the state file read and checked before it binds
its name, the loader brought back to the restart point after.

A rerun (any loader without a state of its own: see :mod:`.restart`) runs the epoch again up
to the point, which takes up to the time the epoch took to get there: minutes, for a large
epoch. Were the name bound only after it, its trainers would have to give ``reconnect`` that
long. So the successor binds first, and while it is *preparing* its I/O thread holds each
HELLO it gets and sends a heartbeat to its sender every second (or a quarter of its
``timeout``, if less): a consumer waiting for a WELCOME waits on while heartbeats come (up to
its ``timeout`` after the last). Once the loader is there, the HELLOs are answered in the
order they came, on the stream as the rerun left it (a new one if the loader did not repeat
the epoch). If the rerun fails, each is answered with the error; if it is interrupted
(Ctrl-C, SIGTERM), with nothing: its consumers wait on for another successor.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import protocol
from ..errors import ProtocolError
from ..host import pid_alive, same_host
from ..pooled_collate import LoaderPool
from ..protocol import Kind
from . import restart
from .shared import Config, Shared, heartbeat_every

log = logging.getLogger("tensorsocket")


@dataclass
class Begun:
    """What a resuming producer knows before it binds: the state file, and what it read there
    (``state`` None: there was none, so a fresh stream begins)."""

    endpoint: str
    path: Path
    description: dict[str, Any]
    state: restart.State | None
    stream: str  # the stream consumers rejoin (a rerun that finds another epoch makes a new one)

    @property
    def preparing(self) -> str | None:
        """What the successor does before it can answer a HELLO, for status(); None: nothing."""
        p = None if self.state is None else self.state.point
        if p is None:
            return None
        if p.ended:
            return f"resuming stream {self.stream} after epoch {p.epoch}"
        if self.description["mode"] == restart.STATEFUL:
            return f"resuming stream {self.stream}: loading its loader's state at batch {p.index} of epoch {p.epoch}"
        return f"resuming stream {self.stream}: running epoch {p.epoch} again up to batch {p.index}"


def begin(loader: Any, endpoint: str, resume: bool, batches: int | None, samples: int | None) -> Begun | None:
    """Before the bind: with ``resume``, the state file read and checked against ``loader``;
    without, None (see :func:`bound`)."""
    if not resume:
        return None
    path = restart.state_path(endpoint)
    description = restart.describe(loader, batches, samples)
    with restart.applying(path):
        state = restart.read(path)
        if state is not None:
            restart.check_matches(state, description, path)
    return Begun(endpoint, path, description, state, uuid.uuid4().hex if state is None else state.stream)


def bound(endpoint: str, fresh: bool) -> None:
    """Once bound, the endpoint's state files are ours: the temporary ones a predecessor killed
    while it wrote left go, and without ``resume`` (``fresh``) the state too (a fresh stream: an
    older state must not be resumed later). Not before the bind: a tcp endpoint has no lock
    file, and a producer that turns out not to bind (another serves there) must not remove the
    files of the one that does."""
    if endpoint.endswith(":*"):  # (the port picked is new: no state can be of it)
        return
    path = restart.state_path(endpoint)
    restart.remove_leftovers(path)
    if fresh:
        restart.remove(path)


def finish(
    loader: Any, begun: Begun, pool: LoaderPool, progress: Callable[[int], None] | None = None
) -> tuple[restart.Tracker, restart.Resumed | None]:
    """After the bind: the loader brought to where the stream goes on (``progress``: called
    with the batches pulled so far), and the tracker that keeps the state file from here."""
    state, resumed = begun.state, None
    if state is not None:
        resumed = restart.resume(loader, state, uuid.uuid4().hex, pool, begun.path, progress)
        log.info(
            "resuming stream %s of %s at batch %d of epoch %d (%s)",
            state.stream, begun.endpoint, resumed.index, resumed.epoch,
            "; ".join((
                "starting that epoch again" if resumed.stream != state.stream else begun.description["mode"],
                f"{state.consumers} consumer(s) to rejoin first",
            )),
        )  # fmt: skip
    stream = begun.stream if resumed is None else resumed.stream
    tracker = restart.Tracker(begun.path, loader, begun.description, stream)
    if resumed is not None:
        tracker.resumed(resumed)
    return tracker, resumed


# ---------------------------------------------------------------------- the I/O thread's part


def hold(shared: Shared, cid: Hashable, msg: dict[str, Any]) -> None:
    """A HELLO while the producer prepares (lock held): kept, and its sender told we live."""
    shared.held[cid] = msg
    shared.post(cid, protocol.encode(Kind.HEARTBEAT))


def holding(shared: Shared) -> bool:
    """Does the I/O thread hold HELLOs (lock held)? While the producer prepares, and until
    those it held then are answered (a later one waits its turn behind them)."""
    return shared.preparing is not None or bool(shared.held)


def serve_held(
    shared: Shared,
    now: float,
    hello: Callable[[Hashable, dict[str, Any], float], None],
    bad: Callable[[Hashable, str], None],
) -> None:
    """The HELLOs held (lock held): heartbeats to each sender while the producer prepares, as
    often as to a joined consumer with the shortest of their timeouts; once it is ready, each
    answered by ``hello`` in the order they came (those of consumers on this host that died
    meanwhile dropped: they would only be evicted), and one it refuses reported to ``bad``,
    as one not held is."""
    if shared.preparing is not None:
        timeouts = [msg["timeout"] for msg in shared.held.values()]
        if timeouts and now - shared.held_beat >= heartbeat_every(min(timeouts)):
            shared.held_beat = now
            for cid in shared.held:
                shared.post(cid, protocol.encode(Kind.HEARTBEAT))
        return
    held, shared.held = shared.held, {}
    for cid, msg in held.items():
        if not same_host(msg["boot_id"], msg["pidns"]) or pid_alive(msg["pid"]):
            try:
                hello(cid, msg, now)
            except ProtocolError as exc:
                bad(cid, str(exc))


def refuse_held(shared: Shared, reason: str) -> None:
    """The producer could not prepare (lock held): each held HELLO answered with ``reason``."""
    held, shared.held = shared.held, {}
    for cid in held:
        shared.post(cid, protocol.encode(Kind.ERROR, reason=reason[:4000]))


def settle(shared: Shared, resumed: restart.Resumed | None, tracker: restart.Tracker) -> None:
    """The loader is at the restart point (lock held): the flow starts there, the WELCOME names
    the stream as the rerun left it, and the I/O thread answers the HELLOs held."""
    if resumed is not None:
        shared.flow.start_at(resumed.epoch, resumed.first_seq, resumed.index)
        shared.config = dataclasses.replace(shared.config, stream=resumed.stream, restarted=resumed.restarted)
    shared.tracker = tracker
    shared.preparing = None
    shared.wakeup.wake()


def position(config: Config, resume: list[Any] | None) -> tuple[tuple[int, int] | None, bool]:
    """A restored or rejoining consumer's (epoch, index) and whether it rejoins (see
    Flow.ready); None for a position on another stream (its numbers mean nothing here). One
    rejoining from the stream whose epoch we start again (``config.restarted``) rejoins at its
    own epoch's start (that epoch, or one after it, which comes again too, in a new order)."""
    if resume is None:
        return None, False
    if resume[0] == config.stream:
        return (resume[1], resume[2]), resume[3]
    restarted, replaced = config.restarted, protocol.replaced_streams(config.restarted)
    if resume[0] in replaced and resume[3]:
        # One from a stream before the one we replaced did not rejoin that one in time: it is
        # none of those our state file names, whom we wait for (rejoined False: not counted).
        return (max(resume[1], restarted[1]), 0), resume[0] == replaced[0]
    return None, False


def had(config: Config, resume: list[Any] | None, size: int | None) -> int | None:
    """For a rank of a group of ``size`` rejoining from the stream whose epoch we start again:
    how many rounds of the epoch :func:`position` places it at it had received there (the
    flow levels the ranks' shares with it: a rank that had more skips more); None for
    anyone else."""
    if size is None or resume is None or config.restarted is None:
        return None
    if resume[0] != protocol.replaced_streams(config.restarted)[0]:
        return None
    # (rejoined, or restored and received nothing since: what its checkpoint had)
    return resume[2] // size if resume[1] >= config.restarted[1] else 0


def give_up_groups(shared: Shared, rejoiners: int) -> None:
    """The successor's first batch, once it waited for its predecessor's consumers (``rejoiners``,
    0 for any other producer): a group still waiting for a rank that did not rejoin is told it
    broke (:meth:`Flow.break_unrejoined`), and the state file no longer names those not back."""
    with shared.changed:
        shared.awaited = 0
        if rejoiners:
            shared.send_all(shared.flow.break_unrejoined())
