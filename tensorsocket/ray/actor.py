"""One node's producer inside a Ray actor, and the per-node clean-up after the fleet stops.

The actor builds the loader from a PIPELINE (as ``tensorsocket serve`` does), serves it in a
thread under a name derived from its node id, and records which consumers it served (the
producer's status lists only those connected now). Ray restarts a dead actor by running
``__init__`` again on the same node: a restarted incarnation continues its predecessor's
stream (``Producer(resume=True)``), the first one starts a fresh stream.

Ownership: the actor creates and, in :meth:`NodeProducer.stop`, closes its producer and
removes its socket files. :func:`clean_node` (a task pinned to the node, run by the fleet
after every actor is gone) removes what a killed incarnation could not: its shared memory
and its files.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import endpoint as endpoints
from .. import pipeline
from ..host import process_state
from ..producer import Producer, state_file
from ..transport import shm
from .naming import current_node_id, node_name

log = logging.getLogger("tensorsocket")

WATCH_EVERY = 0.1  # seconds between samples of the producer's consumers for the served record
_CHILD_EXIT_S = 10.0  # how long stop() and clean_node() wait for loader workers to exit


def build_loader(spec: str | Callable[..., Any], args: Mapping[str, Any]) -> Any:
    """The loader PIPELINE (or a function) makes with ``args``; PipelineError saying what failed."""
    if isinstance(spec, str):
        return pipeline.call(pipeline.load(spec), spec, dict(args))
    return pipeline.call(spec, getattr(spec, "__qualname__", repr(spec)), dict(args))


class NodeProducer:
    """A producer serving the fleet's pipeline to the trials of this actor's node.

    Never raises from ``__init__``: an error (a pipeline that does not load, bad producer
    options, the name taken) is kept and reported by :meth:`ready`, so the fleet can say what
    went wrong instead of Ray restarting an actor that can only fail again.
    """

    def __init__(
        self,
        spec: str | Callable[..., Any],
        args: Mapping[str, Any],
        name: str,
        epochs: int | None,
        options: Mapping[str, Any],
        keep_state: bool,
    ) -> None:
        import ray

        self.node_id = current_node_id()
        self.name = node_name(name, self.node_id)
        self.endpoint = endpoints.resolve(self.name)
        self.pid = os.getpid()
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.error: str | None = None
        self.usage_error = False  # the error is in what the user passed: no use retrying
        self.served: dict[tuple[str, int], dict[str, Any]] = {}
        self.producer: Producer | None = None
        self._last: dict[str, Any] | None = None
        self._lock = threading.Lock()  # guards served and _last (the watcher writes them)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        try:
            loader = build_loader(spec, args)
            if keep_state and not self.restarted:  # a fresh stream: never resume an older fleet's
                # Only under the name's lock: while another fleet's producer serves this name
                # (a second fleet of the same name), its state file is not ours to remove,
                # and lock() refuses with the error the producer would give.
                held = endpoints.lock(self.endpoint)
                try:
                    state_file.remove(state_file.state_path(self.endpoint))
                finally:
                    endpoints.unlock(self.endpoint, held)
            self.producer = Producer(loader, name=self.name, resume=keep_state, **options)
        except (ValueError, TypeError) as exc:  # PipelineError is a ValueError
            self.error, self.usage_error = str(exc), True
            return
        except Exception as exc:
            self.error = pipeline.describe(exc)
            return
        # Daemon threads: the actor's process may be killed at any moment; nothing waits on them.
        self._threads = [
            threading.Thread(target=self._serve, args=(self.producer, epochs), name="tensorsocket-ray-serve"),
            threading.Thread(target=self._watch, name="tensorsocket-ray-watch"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        log.info(
            "node %s: producer %s serving (pid %d, restarted: %s)",
            self.node_id[:16],
            self.name,
            self.pid,
            self.restarted,
        )

    def _serve(self, producer: Producer, epochs: int | None) -> None:
        try:
            producer.serve(epochs=epochs)
        except Exception as exc:
            if not self._stop.is_set():
                self.error = f"serving stopped: {pipeline.describe(exc)}"
                log.error("node %s: %s", self.node_id[:16], self.error)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        """Sample the producer's status: the consumers it served and the last snapshot."""
        while True:
            self._sample()
            if self._stop.wait(WATCH_EVERY):
                return

    def _sample(self) -> None:
        producer = self.producer
        if producer is None:
            return
        try:
            status = dict(producer.status())
        except Exception:  # closed under us: the last snapshot stays
            return
        with self._lock:
            self._last = status
            for c in status["consumers"]:
                key = (c["label"], c["pid"])
                entry = self.served.setdefault(key, {"label": c["label"], "pid": c["pid"], "received": 0})
                entry["received"] = max(entry["received"], c["received"])

    def ready(self) -> dict[str, Any]:
        """This node's record once ``__init__`` ran: the fleet waits on it (with a deadline)."""
        return self.status()

    def status(self) -> dict[str, Any]:
        """The node's record: name, pid, restarted, error, the consumers served (sampled every
        :data:`WATCH_EVERY` s, this incarnation only), the producer's latest status, and the
        pids of the loader's worker processes."""
        self._sample()
        with self._lock:
            served = [dict(v) for v in self.served.values()]
            producer = self._last
        serving = bool(self._threads) and self._threads[0].is_alive()
        return {
            "node_id": self.node_id,
            "name": self.name,
            "endpoint": self.endpoint,
            "pid": self.pid,
            "restarted": self.restarted,
            "serving": serving,
            "error": self.error,
            "usage_error": self.usage_error,
            "served": served,
            "producer": producer,
            "children": children(self.pid),
        }

    def stop(self) -> dict[str, Any]:
        """End the stream (consumers get a clean end), free the shared memory, let the loader's
        workers exit and remove the socket files; the final record, with what is left (nothing,
        normally) under ``left``."""
        self._stop.set()
        producer = self.producer
        if producer is not None:
            self._sample()
            producer.close()  # waits up to its linger for consumers to take the end
        for thread in self._threads:
            thread.join(timeout=30.0)
        record = self.status()
        workers = record["children"]
        # Drop the loader (and a DataLoader's iterator with it): its worker processes exit now
        # instead of when their watchdog notices the actor's process is gone.
        self.producer = None
        del producer
        gc.collect()
        record["left"] = {
            "children": wait_gone(workers, _CHILD_EXIT_S),
            "segments": segments_of([self.pid]),
            "files": remove_files(self.endpoint),
        }
        record["serving"] = False
        return record


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a loader's worker processes), from /proc."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def _alive(pid: int) -> bool:
    """A zombie has exited (its parent only has not reaped it yet); no /proc entry, gone. But
    a killed process's main thread turns zombie before its other threads are done, and they
    hold its files meanwhile (a name's lock: the clean-up found it held, 2 of 2 scenario runs here, before)."""
    state = process_state(pid)
    if state != "Z":
        return state is not None
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to exit; return those still running."""
    deadline = time.monotonic() + timeout
    pending = [p for p in pids if _alive(p)]
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [p for p in pending if _alive(p)]
    return pending


def segments_of(pids: Iterable[int]) -> list[str]:
    """tensorsocket shared-memory segments in /dev/shm owned by any of ``pids``."""
    prefixes = tuple(f"{shm.PREFIX}{os.getuid()}-{pid}-" for pid in pids)
    try:
        return sorted(n for n in os.listdir(shm.SHM_DIR) if prefixes and n.startswith(prefixes))
    except FileNotFoundError:
        return []


def remove_files(endpoint: str) -> list[str]:
    """Remove an ipc endpoint's socket, state and lock files when no producer holds its lock;
    return the paths left (all of them while a producer serves it)."""
    path = endpoint[len("ipc://") :]
    paths = [path, str(state_file.state_path(endpoint)), path + ".lock"]
    try:
        held = endpoints.lock(endpoint)  # ours while we remove: no producer can take the name meanwhile
    except RuntimeError:
        return [p for p in paths if os.path.exists(p)]
    try:
        state_file.remove(state_file.state_path(endpoint))
    finally:
        endpoints.unlock(endpoint, held)  # the socket and lock files
    return [p for p in paths if os.path.exists(p)]


def clean_node(names: list[str], pids: list[int], workers: list[int]) -> dict[str, Any]:
    """Run on a node after the fleet's actors are gone: wait for their processes (``pids``,
    and the loader ``workers`` they had) to exit, remove shared memory of dead producers and the
    fleet's socket files there; report what is left."""
    still = wait_gone(list(pids) + list(workers), _CHILD_EXIT_S)
    swept = shm.sweep_stale()
    left_files = [f for name in names for f in remove_files(endpoints.resolve(name))]
    return {
        "swept": swept,
        "left": {"processes": still, "segments": segments_of(pids), "files": left_files},
    }
