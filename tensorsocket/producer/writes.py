"""A consumer's report that a batch changed in shared memory while it held it (MODIFIED, from
a consumer that checks each batch's fingerprint as it lets it go): checked against what that
consumer holds, and logged with every holder of the batch, any of whom may have written it.

A consumer reports each batch at most once, but a broken or hostile peer may repeat it: the
producer logs a peer's first 20 reports and every 1000th after, as it does bad messages, so
no peer can flood its log.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from ..errors import ProtocolError
from .shared import Peer, Shared

log = logging.getLogger("tensorsocket")

_LOGGED_FIRST, _LOGGED_EVERY = 20, 1000


def report_modified(shared: Shared, cid: Hashable, peer: Peer, msg: dict[str, Any]) -> None:
    """Apply one MODIFIED from joined consumer ``cid`` (lock held)."""
    if msg["seq"] not in shared.flow.consumers[cid].held:  # (sent before that batch's RELEASE)
        raise ProtocolError(f"MODIFIED names batch {msg['seq']}, which this consumer does not hold")
    peer.modified = count = peer.modified + 1
    if count > _LOGGED_FIRST and count % _LOGGED_EVERY:
        return
    more = (
        f" ({count} such reports from it so far: its first {_LOGGED_FIRST} and every {_LOGGED_EVERY}th are logged)"
        if count >= _LOGGED_FIRST
        else ""
    )
    log.error(
        "%s reports batch %d (epoch %d, index %d) changed in shared memory while it held it; "
        "held by %s, any of which may have written it: an in-place op on a shared batch "
        "corrupts every consumer's data; use copy=True or out-of-place ops%s",
        peer.describe(), msg["seq"], msg["epoch"], msg["index"], holders_of(shared, cid, msg["seq"]), more,
    )  # fmt: skip


def holders_of(shared: Shared, cid: Hashable, seq: int) -> str:
    """Who holds batch ``seq`` besides ``cid`` (which reports it): their descriptions (lock held)."""
    place = shared.flow.consumers[cid].held.get(seq)
    holders = shared.flow.holders(place) if place is not None else frozenset((cid,))
    return ", ".join(sorted(shared.peers[h].describe() for h in holders if h in shared.peers))
