"""Waits whose wake-up does not preempt the thread running on the CPU (Linux ``SCHED_BATCH``).

Why: a consumer's thread woken by its producer's message preempts whatever runs on that CPU:
often the producer, half-way through sending the same batch to the next consumer, or another
consumer. With more processes than cores every batch then costs a switch and cold caches,
tens of microseconds on the 2-core VM. A thread that waits as ``SCHED_BATCH`` is woken onto
an idle CPU if there is one, as before, and otherwise runs at the scheduler's next tick,
finding what came meanwhile (``benchmarks.protocol_cost``, variant ``plain-waits``; what a
wake-up then waits: ``benchmarks.wake_latency``). The producer's waits stay plain: it feeds
everyone, and waiting so cost it more than it saved.

Only the waiting changes: the thread is ``SCHED_BATCH`` while it blocks and back to
``SCHED_OTHER`` as soon as it wakes (its nice value, its share of CPU and its priority while it
runs stay what they were). A thread that is not ``SCHED_OTHER`` (real-time, idle, or batch
already) is left alone, and where the kernel refuses the change (a seccomp filter), every
wait is a plain one. ``TENSORSOCKET_YIELDING=0`` turns it off.
"""

from __future__ import annotations

import os
import select

_ENV = "TENSORSOCKET_YIELDING"
_LINUX = hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_param")
_PARAM = os.sched_param(0) if _LINUX else None  # (the priority of both policies: 0)


class _State:
    """Whether this process may switch a thread's policy (cleared at the first refusal)."""

    enabled = _LINUX and os.environ.get(_ENV, "1") != "0"


def poll(poller: select.poll, timeout_ms: int) -> list[tuple[int, int]]:
    """``poller.poll(timeout_ms)``, waiting as ``SCHED_BATCH`` when this thread may. It looks
    first without waiting, so a message already there costs no change of policy (a change and
    its undoing: ~4 us on the 2-core VM)."""
    ready = poller.poll(0)
    if ready or timeout_ms == 0:
        return ready
    if not _State.enabled:
        return poller.poll(timeout_ms)
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return poller.poll(timeout_ms)
        os.sched_setscheduler(0, os.SCHED_BATCH, _PARAM)
    except OSError:  # (refused: every wait is a plain one from now on)
        _State.enabled = False
        return poller.poll(timeout_ms)
    try:
        return poller.poll(timeout_ms)
    finally:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, _PARAM)
        except OSError:  # (a change the kernel allowed one way it allows back: never seen)
            _State.enabled = False
