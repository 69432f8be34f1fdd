"""Waits whose wake-up does not preempt the thread running on the CPU (Linux ``SCHED_BATCH``).

Why: a consumer's thread woken by its producer's message preempts whatever runs on that CPU:
often the producer, half-way through sending the same batch to the next consumer, or another
consumer. With more processes than cores every batch then costs a switch and cold caches,
tens of microseconds on the 2-core VM. A thread that waits as ``SCHED_BATCH`` is woken onto
an idle CPU if there is one, as before, and otherwise waits for the scheduler to come round
to it (at its next tick on this VM's Linux 6.18; older kernels may let the running thread
finish its slice), finding what came meanwhile (``benchmarks.protocol_cost``, variant
``plain-waits``; what a wake-up then waits: ``benchmarks.wake_latency``). The producer's
waits stay plain: it feeds everyone, and waiting so cost it more than it saved.

Only the waiting changes: the thread is ``SCHED_BATCH`` while it blocks and back to
``SCHED_OTHER`` as soon as it runs again (its nice value, its share of CPU and its priority
while it runs stay what they were; the policy is the calling thread's alone). A thread that is
not ``SCHED_OTHER`` (real-time, idle, or batch already) is left alone, and where the kernel
refuses the change (a seccomp filter), every later wait is a plain one.
``TENSORSOCKET_YIELDING=0`` in the environment when tensorsocket is imported turns it off.
"""

from __future__ import annotations

import logging
import os
import select

log = logging.getLogger("tensorsocket")

_ENV = "TENSORSOCKET_YIELDING"
_HAS_BATCH = hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_param")  # (Linux)
_PARAM = os.sched_param(0) if _HAS_BATCH else None  # (the priority of both policies: 0)


class _State:
    """Whether this process switches a waiting thread's policy (cleared at the first refusal)."""

    enabled = _HAS_BATCH and os.environ.get(_ENV, "1") != "0"


def poll(poller: select.poll, timeout_ms: int) -> list[tuple[int, int]]:
    """``poller.poll(timeout_ms)``, waiting as ``SCHED_BATCH`` when this thread may. It looks
    first without waiting, so a message already there costs no change of policy (a change and
    its undoing: ~4 us in a hot loop on the 2-core VM, ~10 us after a training step)."""
    ready = poller.poll(0)
    if ready or timeout_ms == 0:
        return ready
    if not _State.enabled or _policy() != os.SCHED_OTHER:
        return poller.poll(timeout_ms)
    try:  # (the switch inside: an interrupt landing just after it still finds the way back)
        _switch(os.SCHED_BATCH)
        return poller.poll(timeout_ms)
    finally:
        _switch(os.SCHED_OTHER)


def _policy() -> int | None:
    try:
        return os.sched_getscheduler(0)  # (0: the calling thread)
    except OSError as exc:
        _refused(exc)
        return None


def _switch(policy: int) -> None:
    try:
        os.sched_setscheduler(0, policy, _PARAM)
    except OSError as exc:
        _refused(exc)


def _refused(exc: OSError) -> None:
    if _State.enabled:
        _State.enabled = False
        log.warning("waiting as SCHED_BATCH was refused (%s): waits are plain ones from now on", exc)
