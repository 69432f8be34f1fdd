"""A consumer's place in the stream as a checkpoint keeps it: the state dict of
:meth:`Consumer.state_dict`, in the shape StatefulDataLoader users know (what to load before
iterating again), and the checks that make a wrong resume impossible.

A position is (stream, epoch, index, offset): the producer's stream id (a restarted
producer is another stream, where the numbers mean nothing), the epoch in progress, the next
producer batch of it to take, and how many samples of that batch this consumer already
handed out (a re-cut with ``batch_size``: its last output ended inside a producer batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMAT = 1  # the state dict's version: one of another version is refused, not misread


@dataclass(frozen=True)
class Position:
    stream: str
    epoch: int
    index: int
    offset: int = 0


def recut_position(stream: str, epoch: int, pushed: Any, handed: int, end_read: bool) -> Position | None:
    """Where a re-cut consumer is, from the producer batches of ``epoch`` its re-cut took
    (``pushed``: (index, first sample's number, samples) each) and the samples it handed out;
    None where that is where it would be without a re-cut (the next producer batch's start).
    ``end_read``: the re-cut read the epoch's end to make its short last batch, which was
    handed out, and the caller's loop has not seen that end yet."""
    for index, start, n in pushed:  # its last output ended inside a batch
        if start <= handed < start + n:
            return Position(stream, epoch, index, handed - start)
    if end_read and pushed:
        # After the epoch's last batch, as without a re-cut (the next epoch's start would make
        # a restored loop's first `for` yield all of the next epoch as this one's rest).
        return Position(stream, epoch, pushed[-1][0] + 1)
    return None


def state_of(position: Position | None, batch_size: int | None, group: list[Any] | None) -> dict[str, Any]:
    """The state dict for ``position`` (None: nothing taken yet, so a load starts afresh);
    ``group`` is [name, world size] for a group member."""
    state: dict[str, Any] = {"tensorsocket": FORMAT, "batch_size": batch_size, "group": group}
    if position is not None:
        state.update(
            stream=position.stream, epoch=position.epoch, index=position.index, offset=position.offset
        )
    return state


def position_of(state: Any, batch_size: int | None, group: list[Any] | None) -> Position | None:
    """The position a state dict holds; ValueError naming what is wrong with it or why it
    does not fit this consumer (another batch size, group or world size would resume
    somewhere else: a group's shares depend on its size)."""
    if not isinstance(state, dict) or state.get("tensorsocket") != FORMAT:
        raise ValueError(
            f"not a tensorsocket Consumer state (version {FORMAT}): {str(state)[:200]}; pass what "
            "Consumer.state_dict() returned"
        )
    if state.get("batch_size") != batch_size or state.get("group") != group:
        raise ValueError(
            f"the state was saved by a consumer with batch_size={state.get('batch_size')!r}, "
            f"group={state.get('group')!r} ([name, world_size]); this one has batch_size={batch_size!r}, "
            f"group={group!r}"
        )
    if "stream" not in state:
        return None
    stream, epoch, index, offset = (state.get(k) for k in ("stream", "epoch", "index", "offset"))
    if not (isinstance(stream, str) and len(stream) <= 64):
        raise ValueError(f"the state's stream must be a string of at most 64 characters, got {stream!r}")
    for key, value in (("epoch", epoch), ("index", index), ("offset", offset)):
        if type(value) is not int or not 0 <= value < 2**63:
            raise ValueError(f"the state's {key} must be a non-negative int, got {value!r}")
    if offset and batch_size is None:
        raise ValueError(f"the state's offset is {offset} but a consumer without batch_size has none")
    return Position(stream, epoch, index, offset)


def offset_into(position: Position, samples: int) -> int:
    """The samples of the position's producer batch handed out before its state was saved,
    checked against the batch's ``samples`` now that it came (load_state_dict() could not)."""
    if position.offset > samples:
        raise ValueError(
            f"the state given to load_state_dict() is {position.offset} samples into batch "
            f"{position.index} of epoch {position.epoch}, which has {samples}: it was saved from "
            "another stream than this producer's"
        )
    return position.offset


def epoch_span(batches_per_epoch: int | None, group: tuple[str, int, int, str] | None) -> int | None:
    """Where an epoch ends in a consumer's positions: its producer batches, or for a group rank
    the end of the last round it is sent (``pad`` sends a short last round, padded: ceil(n /
    size) rounds; ``drop`` sends it to nobody: floor(n / size)). A position past it was never
    anybody's to miss. None when the producer's loader has no len()."""
    if batches_per_epoch is None or group is None:
        return batches_per_epoch
    size = group[2]
    rounds = -(-batches_per_epoch // size) if group[3] == "pad" else batches_per_epoch // size
    return rounds * size


def missed(position: Position, epoch: int, index: int, batches_per_epoch: int | None) -> int | None:
    """Producer batches between ``position`` and the first entry a restored consumer got
    (batch ``index`` of ``epoch``; ``index`` is that epoch's length for its end marker):
    what it lost. None when it cannot be told (the loader has no len())."""
    if epoch == position.epoch:
        return max(0, index - position.index)
    if batches_per_epoch is None:
        return None
    return (
        max(0, batches_per_epoch - position.index) + (epoch - position.epoch - 1) * batches_per_epoch + index
    )
