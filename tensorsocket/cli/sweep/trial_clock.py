"""How long each trial of a wave has run on its own account: what ``--trial-timeout`` limits.

Why: under ``stall`` a wave's trials go at the pace of the slowest. A trial that hangs holding
a batch holds up every other trial of its wave, each waiting in ``next()`` for a batch that
cannot come; a limit on the time since a trial started stopped those too (they start
together, so they reach it together). So a trial's clock leaves out the time it waited for a
batch while another trial of its wave was busy (not waiting): that wait was the other one's
doing. Time it waited while every trial waited counts: the producer or its loader is slow or
stuck, no trial is to blame, and each reaches its limit as before.

How: the producer's status gives each consumer's total time spent waiting in ``next()`` (from
its STATS, sent every second, a wait in progress included). The sweep polls it about once a
second and tells :meth:`WaveClock.poll` each consumer's trial and total; a trial's wait is the
sum over its consumers, and what it waited in an interval is how much that sum grew. A trial
with no consumer there (starting, or done with them) is busy: it is not waiting for a batch.
Pure logic, no I/O: the sweep's loop feeds it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

#: A trial that waited less than this share of an interval between two polls was busy in it.
BUSY_SHARE = 0.5


class WaveClock:
    """The time the trials of one wave waited, held up by another trial (see the module)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._waited: dict[str, float | None] = dict.fromkeys(names)  # the last sum seen
        self.excused: dict[str, float] = dict.fromkeys(self._waited, 0.0)
        self._polled_at: float | None = None

    def poll(self, waits: Iterable[tuple[str | None, float]], running: Collection[str], now: float) -> None:
        """Take one status at time ``now`` (monotonic): ``waits`` holds (trial, seconds) for
        each consumer, the time it waited so far. The trials in ``running`` that waited while
        another of them was busy are excused that wait."""
        sums: dict[str, float] = {}
        for name, seconds in waits:
            if name is not None and name in self._waited:
                sums[name] = sums.get(name, 0.0) + seconds
        grew: dict[str, float] = {}
        for name in running:
            now_sum, before = sums.get(name), self._waited[name]
            # (a consumer that left takes its total with it: the sum shrinks, nothing grew)
            grew[name] = max(0.0, now_sum - before) if now_sum is not None and before is not None else 0.0
            self._waited[name] = now_sum
        if self._polled_at is not None and now > self._polled_at:
            interval = now - self._polled_at
            busy = {name for name in running if grew[name] < BUSY_SHARE * interval}
            for name in running:
                if busy - {name}:
                    self.excused[name] += min(grew[name], interval)
        self._polled_at = now

    def charged(self, name: str, started: float, now: float) -> float:
        """Seconds trial ``name``, started at ``started``, has run on its own account by ``now``."""
        return now - started - self.excused[name]
