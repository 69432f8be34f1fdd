"""The state file of a producer started with ``resume=True``: where it lives (the per-user
runtime directory, mode 0600), what it holds (:class:`State`: the stream, the loader it was
saved over, the restart :class:`Point` and fingerprints), and how it is written (atomically,
with ``torch.save``: states hold tensors) and read (``weights_only=True``: tensors and plain
containers only, nothing a file could use to run code; anything else is a ValueError naming
the file). :mod:`.restart` says what the fields mean and how a successor uses them."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import endpoint as endpoints
from .. import protocol
from ..errors import StateFileError

FORMAT = 1
_TMP_PREFIX, _TMP_SUFFIX, _TMP_RANDOM = ".{}.", ".tmp", 8  # write()'s temporary files (mkstemp's 8)
_KEY = "tensorsocket_producer_state"
MAX_BYTES = 64 << 20  # a state file larger than this was not written by a producer


def state_path(endpoint: str) -> Path:
    """The state file of a producer bound at ``endpoint``, always in the per-user runtime
    directory (mode 0700): beside a named producer's socket, else named by a digest of the
    endpoint (an ``ipc:///tmp/x`` socket's directory may be open to others)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":*"):
        raise ValueError(
            f"resume=True needs a fixed endpoint (consumers rejoin it), not {endpoint!r} with a port the OS picks"
        )
    folder = endpoints.runtime_dir()
    if endpoint.startswith("ipc://") and Path(endpoint[6:]).parent == folder:
        return folder / f"{Path(endpoint[6:]).name}.state"
    return folder / f"endpoint-{hashlib.sha256(endpoint.encode()).hexdigest()[:20]}.state"


@dataclass
class Point:
    """How to publish the stream again from batch ``index`` of ``epoch`` (whose first entry
    was ``first_seq``); ``index`` may be the epoch's length: its end marker. ``ended``: that
    marker was published (the epoch is known to end there: nothing to run again)."""

    epoch: int
    first_seq: int
    index: int
    rng: dict[str, Any]  # at the epoch's start (rerun), at the point (stateful), or after its end
    loader_state: Any = None  # stateful: the loader's state after the batch before the point
    ended: bool = False


@dataclass
class State:
    """What the file holds."""

    stream: str
    loader: dict[str, Any]
    point: Point
    fingerprints: dict[tuple[int, int], int]  # (epoch, index) -> content fingerprint, from the point - 1 on
    consumers: int  # with a position to lose (restart.rejoinable): a successor waits for their rejoins
    restarted: list[Any] | None = None  # [old stream, epoch, *earlier]: protocol.replaced_streams


def encode(state: State) -> bytes:
    p = state.point
    record = {
        _KEY: FORMAT,
        "stream": state.stream,
        "loader": state.loader,
        "point": [p.epoch, p.first_seq, p.index, p.ended],
        "rng": p.rng,
        "loader_state": p.loader_state,
        "fingerprints": [[e, i, fp] for (e, i), fp in state.fingerprints.items()],
        "consumers": state.consumers,
        "restarted": state.restarted,
    }
    buf = io.BytesIO()
    torch.save(record, buf)
    return buf.getvalue()


def decode(data: bytes, where: str) -> State:
    """The state in ``data``; ValueError naming what is wrong with it."""
    try:
        record = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # torch raises many kinds for a corrupt or hostile file
        # Not torch's advice for an UnpicklingError (load it with weights_only=False: unsafe,
        # and no help here); the line between says what it refused.
        lines = [line for line in str(exc).splitlines() if line.strip() and "weights_only" not in line]
        said = (lines[-1] if isinstance(exc, pickle.UnpicklingError) else lines[0]) if lines else ""
        raise ValueError(
            f"{where} is not a readable producer state ({type(exc).__name__}: {said[:200]})"
        ) from None
    if not isinstance(record, dict) or record.get(_KEY) != FORMAT:
        raise ValueError(f"{where} is not a tensorsocket producer state of format {FORMAT}")
    try:
        epoch, first_seq, index, ended = record["point"]
        ints = (epoch, first_seq, index)
        if not all(type(v) is int and 0 <= v < 2**62 for v in ints) or type(ended) is not bool:
            raise ValueError(f"bad point {record['point']!r}")
        fingerprints = {(int(e), int(i)): int(fp) for e, i, fp in record["fingerprints"]}
        stream, loader, consumers = record["stream"], record["loader"], record["consumers"]
        if not (isinstance(stream, str) and 0 < len(stream) <= 64 and isinstance(loader, dict)):
            raise ValueError("bad stream or loader description")
        if type(consumers) is not int or consumers < 0:
            raise ValueError(f"bad consumer count {consumers!r}")
        point = Point(epoch, first_seq, index, record["rng"], record["loader_state"], ended)
        restarted = record.get("restarted")  # (absent from a file an earlier version wrote)
        if restarted is not None and not (
            isinstance(restarted, list)
            and 2 <= len(restarted) <= 2 + protocol.MAX_EARLIER_STREAMS
            and all(isinstance(s, str) and 0 < len(s) <= 64 for s in protocol.replaced_streams(restarted))
            and type(restarted[1]) is int
            and 0 <= restarted[1] < 2**62
        ):
            raise ValueError(f"bad restarted stream {restarted!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where} is damaged: {exc}") from None
    return State(stream, loader, point, fingerprints, consumers, restarted)


def read(path: Path) -> State | None:
    """The state a predecessor left at ``path``; None if there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_BYTES:
        raise ValueError(f"the state file {path} is over {MAX_BYTES >> 20} MiB: not one a producer wrote")
    return decode(data, f"the state file {path}")


def write(path: Path, data: bytes) -> None:
    """Replace the state file atomically: a reader sees the old state or the new one. The
    temporary file is new (O_EXCL, mode 0600), never one someone put there."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX.format(path.name), suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        remove(Path(tmp))
        raise


def remove_leftovers(path: Path) -> None:
    """Remove the temporary files of :func:`write` that a process killed while it wrote left
    (call it only with the name held: another producer's write may be under way)."""
    pattern = f"{glob.escape(_TMP_PREFIX.format(path.name))}{'?' * _TMP_RANDOM}{_TMP_SUFFIX}"
    for leftover in path.parent.glob(pattern):
        remove(leftover)


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def check_matches(state: State, description: dict[str, Any], where: Path) -> None:
    """ValueError when the successor's loader is not the one the state was saved over."""
    if state.loader != description:
        raise ValueError(
            f"the state file {where} was saved by a producer over {state.loader}; this producer's loader is "
            f"{description}. Resuming would publish another stream under the old one's numbers. Start it "
            f"without resume=True, or remove {where}, to begin a fresh stream"
        )


@contextlib.contextmanager
def applying(path: Path) -> Iterator[None]:
    """Reading or applying the state file at ``path`` (not the loader's own work, whose errors
    are its own): what fails is a StateFileError naming the file, never a wrong resume."""
    try:
        yield
    except ValueError as exc:  # (its own say what is wrong; others, random.setstate's, need the file named)
        said = str(exc) if str(path) in str(exc) else f"the state file {path}: {exc}"
        if "fresh stream" not in said:
            said += ": remove it to begin a fresh stream"
        raise StateFileError(said) from None
    except (TypeError, AttributeError, KeyError, IndexError, RuntimeError) as exc:
        raise StateFileError(
            f"the state file {path} could not be applied ({type(exc).__name__}: {exc}): remove it "
            "to begin a fresh stream"
        ) from exc
