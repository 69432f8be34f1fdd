"""The producer's option rules that the command line shares: straggler policies and max_lag's default.

Kept free of torch and zmq, so ``tensorsocket --help`` and ``tensorsocket status`` start fast.
"""

from __future__ import annotations

STRAGGLERS = ("stall", "skip")  # stall: the slowest consumer sets the pace; skip: the fastest does


def default_max_lag(slots: int) -> int:
    """Batches a consumer may lag behind the leader under ``stragglers="skip"`` when no
    ``max_lag`` is given: half the window, at least 1 (always below ``slots`` for slots >= 2)."""
    return max(1, slots // 2)
