"""Delivery: a BATCH message becomes the user's batch, and the batch's death its release.

Lifetime: each batch's views hang off one owner object from the transport (a NumPy array
over shared memory, or a CUDA array interface over a GPU mapping) with a finalizer. When
the last view (or anything derived from one) dies, the finalizer asks the reader to retire
the region; the reader calls back once it may be released (at once on the host; on a GPU
after the work queued on the batch ran), and the I/O thread then re-checks the batch's
fingerprint and sends RELEASE. Only then may the producer reuse the place.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

from .. import layout
from ..transport import Reader
from ..wakeup import Wakeup
from .shared import Shared


def build(
    msg: dict[str, Any], reader: Reader, shared: Shared, copy: bool
) -> tuple[Any, Any, weakref.finalize]:
    """The user's batch from a BATCH message, its lease's token and its release finalizer
    (I/O thread). Raises ProtocolError / ValueError for a layout that does not fit."""
    place, seq = msg["place"], msg["seq"]
    tree, leaves = layout.check(msg["layout"], reader.size(place))
    nbytes = msg["layout"][2]
    lease = reader.lease(place, nbytes)
    item = (seq, lease.token, nbytes, msg["fingerprint"], msg["epoch"], msg["index"], reader)
    release = weakref.finalize(
        lease.owner, _release_later, shared.live, shared.released, shared.wakeup, reader, item
    )
    release.atexit = False
    batch = reader.deliver(layout.build(tree, leaves, lease.region), copy=copy)
    return batch, lease.token, release


def _release_later(
    live: set[int], released: collections.deque[Any], wakeup: Wakeup, reader: Reader, item: tuple[Any, ...]
) -> None:
    """A batch's finalizer: runs in whichever thread dropped its last view. It must not touch
    the socket, and it references no Consumer, so a dropped Consumer can be collected."""
    live.discard(item[0])

    def ready() -> None:
        released.append(item)
        wakeup.wake()

    reader.retire(item[1], ready)
