"""The producer's option rules that the command line shares: straggler policies and max_lag's default.

Kept free of torch and zmq, so ``tensorsocket --help`` and ``tensorsocket status`` start fast.
"""

from __future__ import annotations

import math

STRAGGLERS = ("stall", "skip")  # stall: the slowest consumer sets the pace; skip: the fastest does


def default_max_lag(slots: int) -> int:
    """Batches a consumer may lag behind the leader under ``stragglers="skip"`` when no
    ``max_lag`` is given: half the window, at least 1 (always below ``slots`` for slots >= 2)."""
    return max(1, slots // 2)


def is_seconds(value: object, least: float = 0.0, most: float = math.inf) -> bool:
    """Is ``value`` a finite number of seconds from ``least`` to ``most``? (Not a bool, not
    NaN: ``grace=float("nan")`` would never end, ``timeout=True`` is a slip, not 1 s.)"""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and least <= value <= most
    )
