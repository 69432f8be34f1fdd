"""Slot pools that hold batches where consumers can map them: host shared memory (``shm``).

The CUDA IPC backend (``cuda``) lands behind the same two classes: a producer-side
``SlotPool`` (allocate, grow, write, export arena descriptors, unlink) and a consumer-side
``ArenaMap`` (open each arena once, hand out bounds-checked regions).
"""

from .shm import ArenaMap, SlotPool, sweep_stale

__all__ = ["ArenaMap", "SlotPool", "sweep_stale"]
