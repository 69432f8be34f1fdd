"""Start one producer per node of a running Ray cluster, each a Ray actor pinned to its node
with the CPUs its loader needs reserved, and stop them all when the driver's context exits.

Why reserve CPUs: Ray Tune places as many trials on a node as its CPUs allow, and a loader
that runs in trial processes or unreserved competes with them for the same cores (ray#29662).
The producer's actor holds ``cpus`` of the node's logical CPUs, so the scheduler leaves them
to it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import pipeline as pipelines
from ..options import is_seconds
from .actor import NodeProducer, clean_node
from .naming import check_base, node_name

log = logging.getLogger("tensorsocket")

PRODUCER_OPTIONS = frozenset(
    {"device", "slots", "replay", "min_consumers", "grace", "stragglers", "max_lag", "linger"}
)
_STOP_S = 30.0  # beyond the producer's linger: how long a stop() may take before it is killed
_STATUS_S = 10.0


class Fleet:
    """One producer per node, serving ``pipeline`` (``module:function`` or
    ``path/to/file.py:function``, as ``tensorsocket serve`` takes it, or the function itself)
    called with ``args`` on that node. A trial gets a consumer of its node's producer with
    :func:`tensorsocket.ray.consumer` (same ``name``).

    ``epochs``: None (default) serves until the fleet closes, so trials may start whenever Tune
    places them (a late one replays the current epoch from its start, see ``replay``); an int
    ends each stream after that many epochs. ``cpus``: logical CPUs reserved on each node for
    its producer (its loader's worker processes plus about one for the producer itself).
    ``restarts``: how often Ray restarts a producer actor that died; a restarted producer
    continues its predecessor's stream, and trials' consumers (``reconnect=``) go on exactly.
    0: no restarts and no state file (each batch costs a little less). ``nodes``: Ray node ids
    (default: every alive node with at least ``cpus`` CPUs). Other keyword arguments are
    :class:`~tensorsocket.Producer` options (``slots``, ``replay``, ``min_consumers`` per node,
    ``grace``, ``stragglers``, ``max_lag``, ``linger``, ``device``).

    Raises at construction, after stopping what it started: RuntimeError when Ray is not
    initialized or a producer actor died while starting, ValueError for bad arguments or a
    pipeline that does not load or whose loader the producer refuses, TimeoutError when a
    producer did not start within ``start_timeout`` s (its node has no ``cpus`` free).
    """

    def __init__(
        self,
        pipeline: str | Callable[..., Any],
        name: str = "sweep",
        *,
        args: Mapping[str, Any] | None = None,
        epochs: int | None = None,
        cpus: float = 1.0,
        restarts: int = 3,
        nodes: Iterable[str] | None = None,
        start_timeout: float = 120.0,
        **options: Any,
    ) -> None:
        import ray

        self._closed = True
        spec = _check_pipeline(pipeline)
        self.name = check_base(name)
        _check(epochs, cpus, restarts, start_timeout, options)
        if not ray.is_initialized():
            raise RuntimeError(
                "Ray is not initialized: call ray.init() (or ray.init(address=...)) before starting producers"
            )
        self.cpus, self.restarts = float(cpus), restarts
        self.linger = float(options.get("linger", 10.0))
        self.nodes = _pick_nodes(nodes, cpus)
        self.names = {node: node_name(name, node) for node in self.nodes}
        self.pids: dict[str, set[int]] = {node: set() for node in self.nodes}  # every incarnation's
        self.workers: dict[str, set[int]] = {node: set() for node in self.nodes}
        self.final: dict[str, dict[str, Any]] = {}  # each node's record at close
        self.cleanup: dict[str, dict[str, Any]] = {}  # what clean_node found and left, per node
        remote = ray.remote(NodeProducer)
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
        self._actors = {
            node: remote.options(
                num_cpus=cpus,
                scheduling_strategy=strategy(node_id=node, soft=False),
                max_restarts=restarts,
                max_task_retries=0,
            ).remote(spec, dict(args or {}), name, epochs, options, restarts > 0)
            for node in self.nodes
        }
        self._closed = False
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        log.info(
            "tensorsocket.ray: %d producer(s) serving %s as %s",
            len(self.nodes),
            name,
            ", ".join(self.names.values()),
        )

    def _wait_ready(self, timeout: float) -> None:
        import ray

        refs = {self._actors[node].ready.remote(): node for node in self.nodes}
        done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in done:
            node = refs[ref]
            try:
                record = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RuntimeError(
                    f"the producer actor on node {node[:16]} died while starting: {exc}"
                ) from None
            self._note(record)
            if record["error"] is not None:
                kind = ValueError if record["usage_error"] else RuntimeError
                raise kind(f"the producer on node {node[:16]} could not start: {record['error']}")
        if pending:
            late = ", ".join(refs[r][:16] for r in pending)
            raise TimeoutError(
                f"the producer on node(s) {late} did not start within {timeout:g} s: each needs {self.cpus:g} "
                "free CPU(s) there (trials or other actors may hold them; start the fleet before the sweep)"
            )

    def _note(self, record: Mapping[str, Any]) -> None:
        node = record["node_id"]
        self.pids[node].add(record["pid"])
        self.workers[node].update(record.get("children", ()))

    def status(self, timeout: float = _STATUS_S) -> dict[str, dict[str, Any]]:
        """Each node's record (see :meth:`NodeProducer.status`): its producer's name and pid,
        whether it was restarted, the consumers it served, its producer's status. A node whose
        actor does not answer within ``timeout`` (dead, or being restarted) gets
        ``{"node_id", "name", "error"}``."""
        import ray

        if self._closed:
            return dict(self.final)
        refs = {self._actors[node].status.remote(): node for node in self.nodes}
        ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        found: dict[str, dict[str, Any]] = {}
        for ref, node in refs.items():
            try:
                record = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref)
                record = {"node_id": node, "name": self.names[node], "error": "not answering (restarting?)"}
            except ray.exceptions.RayError as exc:
                record = {"node_id": node, "name": self.names[node], "error": f"actor died: {exc}"}
            else:
                self._note(record)
            found[node] = record
        return found

    def close(self) -> None:
        """End every node's stream (consumers get a clean end), stop the actors, then remove on
        each node what a killed producer left (shared memory, socket files). Idempotent.
        ``final`` holds each node's last record, ``cleanup`` what the clean-up found."""
        import ray

        if self._closed:
            return
        if not ray.is_initialized():  # ray.shutdown() came first: the actors went with the cluster
            self._closed = True
            log.warning("tensorsocket.ray: Ray was shut down before the fleet %s closed", self.name)
            return
        try:
            self._stop()
        finally:  # (also when Ctrl-C cut the wait for the stops short: the actors go all the same)
            for actor in self._actors.values():
                ray.kill(actor, no_restart=True)
            self._clean()
            self._closed = True  # (after: a close() cut short in the clean-up is done again by the next)

    def _stop(self) -> None:
        """Ask every node's actor to end its stream and wait (boundedly) for their records
        (those without one yet: a close() cut short in its clean-up has them already)."""
        import ray

        stops = {self._actors[node].stop.remote(): node for node in self.nodes if node not in self.final}
        if stops:
            ray.wait(list(stops), num_returns=len(stops), timeout=self.linger + _STOP_S)
        for ref, node in stops.items():
            try:
                record = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                record = {"node_id": node, "name": self.names[node], "error": "did not stop in time; killed"}
            except ray.exceptions.RayError as exc:
                record = {"node_id": node, "name": self.names[node], "error": f"actor died: {exc}"}
            else:
                self._note(record)
            self.final[node] = record

    def _clean(self) -> None:
        import ray

        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        task = ray.remote(clean_node)
        refs = {
            task.options(num_cpus=0, scheduling_strategy=strategy(node_id=node, soft=False)).remote(
                [self.names[node]], sorted(self.pids[node]), sorted(self.workers[node])
            ): node
            for node in self.nodes
            if node in alive
        }
        ray.wait(list(refs), num_returns=len(refs), timeout=_STOP_S)
        for ref, node in refs.items():
            try:
                self.cleanup[node] = ray.get(ref, timeout=0)
            except ray.exceptions.RayError as exc:
                self.cleanup[node] = {"error": str(exc)}
                log.warning("tensorsocket.ray: cleaning node %s failed: %s", node[:16], exc)
                continue
            left = {k: v for k, v in self.cleanup[node]["left"].items() if v}
            if left:
                log.warning("tensorsocket.ray: node %s still has %s", node[:16], left)

    def __enter__(self) -> Fleet:
        return self

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"tensorsocket.ray fleet {self.name!r} was not closed", ResourceWarning, stacklevel=1
            )

    def __exit__(self, *exc: Any) -> None:
        self.close()


def producers(pipeline: str | Callable[..., Any], name: str = "sweep", **kwargs: Any) -> Fleet:
    """Start one producer per node: ``with tensorsocket.ray.producers(PIPELINE, name, ...) as
    fleet:`` runs the sweep; leaving the block stops them. See :class:`Fleet`."""
    return Fleet(pipeline, name, **kwargs)


def _check_pipeline(spec: Any) -> str | Callable[..., Any]:
    """A PIPELINE string checked for form (and, for a file the driver has, made absolute so a
    worker with another working directory finds it), or a function; ValueError otherwise."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"pipeline must be 'module:function', 'path/to/file.py:function' or a function, got {spec!r}"
        )
    target, func, is_file = pipelines.parse(spec)
    if is_file:
        from pathlib import Path

        path = Path(target).expanduser()
        if not path.is_file():
            raise pipelines.PipelineError(
                f"pipeline file {target!r} does not exist (relative to {Path.cwd()})"
            )
        return f"{path.resolve()}:{func}"
    return spec


def _check(epochs: Any, cpus: Any, restarts: Any, start_timeout: Any, options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - PRODUCER_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)}; Producer options here: {', '.join(sorted(PRODUCER_OPTIONS))}"
        )
    if epochs is not None and (type(epochs) is not int or epochs < 1):
        raise ValueError(
            f"epochs must be a positive int or None (serve until the fleet closes), got {epochs!r}"
        )
    if not is_seconds(cpus):  # (the same rule: a finite number >= 0, not a bool; NaN passed `cpus < 0`)
        raise ValueError(f"cpus must be a finite number of CPUs >= 0, got {cpus!r}")
    if type(restarts) is not int or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
    if not is_seconds(start_timeout) or start_timeout <= 0:
        raise ValueError(f"start_timeout must be a positive number of seconds, got {start_timeout!r}")


def _pick_nodes(nodes: Iterable[str] | None, cpus: float) -> list[str]:
    """The node ids to start producers on: those asked for, else every alive node with the CPUs."""
    import ray

    alive = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}
    if nodes is not None:
        picked = list(dict.fromkeys(nodes))
        missing = [n for n in picked if n not in alive]
        if missing:
            raise ValueError(f"node(s) {', '.join(missing)} are not alive nodes of this cluster")
        small = [n[:16] for n in picked if alive[n] < cpus]
        if small:
            raise ValueError(f"node(s) {', '.join(small)} have fewer than cpus={cpus:g} CPUs")
        return picked
    picked = [n for n, have in alive.items() if have >= cpus]
    skipped = [n[:16] for n, have in alive.items() if have < cpus]
    if skipped:
        log.warning(
            "tensorsocket.ray: no producer on node(s) %s: fewer than %g CPUs", ", ".join(skipped), cpus
        )
    if not picked:
        raise ValueError(f"no alive node has cpus={cpus:g} CPUs for a producer")
    return picked
