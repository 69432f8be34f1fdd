"""The Ray scenarios of tests/test_ray.py, run in a fresh network namespace (Ray binds every
interface by default; there it can only reach loopback): a 2-node local cluster, then

* ``bad``: the errors a wrong fleet gets at construction;
* ``tune``: a Ray Tune run of 4 trials, 2 per node, 2 epochs, over per-node producers;
* ``kill``: a producer actor SIGKILLed under its consumers (restarted: they go on exactly),
  then killed again with no restart left (its consumer fails clearly);
* ``data``: a Ray Data pipeline as each node's loader;
* ``cut``: a fleet's close() cut short by Ctrl-C as it waits for its actors to stop;
* ``left``: what is left after the fleets and the cluster are gone.

    unshare -n sh -c 'ip link set lo up && exec python3 tests/ray_scenario.py OUT.json'

Writes one JSON object to OUT.json; the test asserts on it. Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = str(ROOT / "tests" / "ray_pipeline.py")
SAMPLES, BATCH = 64, 8  # 8 batches an epoch


def read_epochs(loader: Any, epochs: int, step: float) -> list[list[int]]:
    """The sample ids of each epoch, in the order received."""
    seen = []
    for _ in range(epochs):
        ids: list[int] = []
        for batch_ids, features in loader:
            assert features.shape == (len(batch_ids), 4)
            ids += batch_ids.tolist()
            del batch_ids, features
            time.sleep(step)
        seen.append(ids)
    return seen


def trainable(config: dict[str, Any]) -> None:
    """A Tune trial: read 2 epochs from this node's producer, report what it saw."""
    import ray
    from ray import train, tune

    report = getattr(tune, "report", None) or train.report  # ray.tune.report from Ray 2.41 on

    from tensorsocket.ray import consumer

    node = ray.get_runtime_context().get_node_id()
    with consumer(config["fleet"], timeout=20.0) as loader:
        label = loader.label
        seen = read_epochs(loader, 2, 0.01)
    report({"node": node, "label": label, "seen": json.dumps(seen), "lr": config["lr"]})


def listeners() -> list[str]:
    """Local addresses of every listening TCP and UDP socket in this network namespace."""
    out = subprocess.run(["ss", "-ltunH"], capture_output=True, text=True, timeout=10).stdout
    return sorted({line.split()[4] for line in out.splitlines() if line.strip()})


def bad_input(ray: Any, nodes: list[str]) -> dict[str, str]:
    import tensorsocket.ray as tsray

    errors = {}
    cases = {
        "not_a_spec": lambda: tsray.producers("no_colon_here"),
        "missing_file": lambda: tsray.producers("./nope/pipeline.py:make_loader"),
        "unknown_option": lambda: tsray.producers(f"{PIPELINE}:make_loader", sluts=3),
        "nan_start_timeout": lambda: tsray.producers(f"{PIPELINE}:make_loader", start_timeout=float("nan")),
        "nan_cpus": lambda: tsray.producers(f"{PIPELINE}:make_loader", cpus=float("nan")),
        "raises": lambda: tsray.producers(f"{PIPELINE}:fail_to_build", "bad", nodes=nodes[:1]),
    }
    for key, make in cases.items():
        try:
            make().close()
            errors[key] = "no error"
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def tune_run(ray: Any, tmp: str) -> dict[str, Any]:
    from ray import train, tune

    import tensorsocket.ray as tsray

    report: dict[str, Any] = {}
    listening: list[list[str]] = []
    with tsray.producers(
        f"{PIPELINE}:make_loader",
        "tune",
        args={"samples": SAMPLES, "batch_size": BATCH},
        cpus=1,
        min_consumers=2,
        grace=30,
        replay=0,
    ) as fleet:
        report["names"] = fleet.names
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.5):
                listening.append(listeners())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": 1}),
            param_space={"fleet": "tune", "lr": tune.grid_search([0.1, 0.01, 0.001, 0.0001])},
            run_config=(getattr(tune, "RunConfig", None) or train.RunConfig)(
                storage_path=tmp, name="ts", verbose=0
            ),
        )
        start = time.monotonic()
        results = tuner.fit()
        report["fit_s"] = time.monotonic() - start
        stop.set()
        watcher.join(5)
        report["status"] = fleet.status()
        report["trials"] = [
            {"error": None if r.error is None else str(r.error)[:2000]} | dict(r.metrics or {})
            for r in results
        ]
    report["final"] = fleet.final
    report["cleanup"] = fleet.cleanup
    report["listening"] = sorted({a for snapshot in listening for a in snapshot})
    report["pids"] = {n: sorted(p) for n, p in fleet.pids.items()}
    report["workers"] = {n: sorted(p) for n, p in fleet.workers.items()}
    return report


def consume_task(fleet: str, epochs: int, step: float, reconnect: float) -> dict[str, Any]:
    """A plain Ray task as a trial: what it saw, or the error that ended it and when."""
    import ray

    from tensorsocket.ray import consumer

    out: dict[str, Any] = {"node": ray.get_runtime_context().get_node_id(), "seen": [], "error": None}
    try:
        with consumer(fleet, reconnect=reconnect, timeout=5.0, label=f"task-{os.getpid()}") as loader:
            for _ in range(epochs):
                ids: list[int] = []
                out["seen"].append(ids)
                for batch_ids, _features in loader:
                    ids += batch_ids.tolist()
                    time.sleep(step)
                out["repeated"] = getattr(loader, "repeated", None)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["failed_at"] = time.time()
    return out


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"waited {timeout} s for {what}")


def published(fleet: Any, node: str) -> int:
    record = fleet.status(timeout=5)[node]
    return (record.get("producer") or {}).get("published", 0) if record.get("error") is None else 0


def kill_run(ray: Any, nodes: list[str]) -> dict[str, Any]:
    import tensorsocket.ray as tsray

    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
    task = ray.remote(consume_task)
    report: dict[str, Any] = {}
    victim = nodes[1]
    with tsray.producers(
        f"{PIPELINE}:make_loader",
        "kill",
        args={"samples": SAMPLES, "batch_size": BATCH},
        cpus=1,
        restarts=1,
        min_consumers=2,
        grace=30,
        slots=4,
        replay=0,
    ) as fleet:
        report["names"] = fleet.names
        refs = [
            task.options(num_cpus=1, scheduling_strategy=strategy(node_id=n, soft=False)).remote(
                "kill", 2, 0.05, 30.0
            )
            for n in nodes
            for _ in range(2)
        ]
        wait_for(lambda: published(fleet, victim) >= 5, 60, "the victim's producer to publish 5 batches")
        first_pid = fleet.status()[victim]["pid"]
        os.kill(first_pid, signal.SIGKILL)
        report["killed_at"] = time.time()
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=90)
        report["tasks"] = [ray.get(r) for r in done]
        report["pending"] = len(pending)
        after = fleet.status()[victim]
        report["restarted"] = {
            "first_pid": first_pid,
            "pid": after.get("pid"),
            "restarted": after.get("restarted"),
            "served": after.get("served"),
            "error": after.get("error"),
        }

        # Now with no restart left: a consumer reading when the producer dies for good.
        ref = task.options(num_cpus=1, scheduling_strategy=strategy(node_id=victim, soft=False)).remote(
            "kill", 50, 0.05, 2.0
        )
        wait_for(lambda: fleet.status(timeout=5)[victim].get("served"), 60, "the last consumer to join")
        time.sleep(0.5)
        second_pid = fleet.status()[victim]["pid"]
        os.kill(second_pid, signal.SIGKILL)
        killed = time.time()
        done, pending = ray.wait([ref], timeout=60)
        last = ray.get(done[0]) if done else {"error": "hung"}
        report["no_restart"] = {
            "error": last["error"],
            "after_kill_s": last.get("failed_at", 0) - killed,
            "epochs_seen": len(last["seen"]),
            "status": fleet.status(timeout=5)[victim],
        }
    report["final"] = fleet.final
    report["cleanup"] = fleet.cleanup
    report["pids"] = {n: sorted(p) for n, p in fleet.pids.items()}
    report["workers"] = {n: sorted(p) for n, p in fleet.workers.items()}
    return report


def data_run(ray: Any, nodes: list[str]) -> dict[str, Any]:
    import tensorsocket.ray as tsray

    def read(fleet: str) -> dict[str, Any]:
        import ray as ray_

        from tensorsocket.ray import consumer

        with consumer(fleet, timeout=30.0) as loader:
            seen = []
            for _ in range(2):
                ids: list[int] = []
                for batch in loader:
                    assert (batch["twice"] == batch["id"] * 2).all()
                    ids += batch["id"].tolist()
                seen.append(ids)
            return {"node": ray_.get_runtime_context().get_node_id(), "seen": seen, "len": len(loader)}

    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
    task = ray.remote(read)
    with tsray.producers(f"{PIPELINE}:make_ray_data_loader", "data", cpus=1, replay=0) as fleet:
        names = fleet.names
        refs = [
            task.options(num_cpus=1, scheduling_strategy=strategy(node_id=n, soft=False)).remote("data")
            for n in nodes
        ]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=90)
        report: dict[str, Any] = {
            "tasks": [ray.get(r) for r in done],
            "pending": len(pending),
            "names": names,
        }
    report["cleanup"] = fleet.cleanup
    report["pids"] = {n: sorted(p) for n, p in fleet.pids.items()}
    return report


def cut_run(ray: Any, nodes: list[str]) -> dict[str, Any]:
    """A fleet whose close() Ctrl-C cuts short as it waits for the actors to stop (a trace
    function raises as ``ray.wait`` is entered): the actors are killed and the nodes cleaned
    all the same, and the next close() has nothing left to do."""
    import inspect

    import tensorsocket.ray as tsray

    fleet = tsray.producers(f"{PIPELINE}:make_loader", "cut", cpus=1, replay=0)
    report: dict[str, Any] = {"names": dict(fleet.names), "interrupted": False}
    code, armed = inspect.unwrap(ray.wait).__code__, [True]

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and armed[0] and frame.f_code is code:
            armed[0] = False
            raise KeyboardInterrupt

    sys.settrace(trace)
    try:
        fleet.close()
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        sys.settrace(None)
    report["alive_after"] = []
    for node, actor in fleet._actors.items():
        try:
            ray.get(actor.status.remote(), timeout=30)
            report["alive_after"].append(node)
        except ray.exceptions.RayActorError:
            pass  # killed
    report["cleanup"] = dict(fleet.cleanup)
    fleet.close()  # (nothing left to do: no error)
    report["pids"] = {n: sorted(p) for n, p in fleet.pids.items()}

    # Cut short in the clean-up instead: the next close() cleans, and keeps the stops' records.
    fleet = tsray.producers(f"{PIPELINE}:make_loader", "cut2", cpus=1, replay=0)
    report["names"].update({f"2-{n}": name for n, name in fleet.names.items()})
    code, armed = type(fleet)._clean.__code__, [True]
    sys.settrace(trace)
    try:
        fleet.close()
    except KeyboardInterrupt:
        report["interrupted_cleaning"] = {"final": dict(fleet.final), "cleanup": dict(fleet.cleanup)}
    finally:
        sys.settrace(None)
    fleet.close()
    report["after_cleaning"] = {"final": dict(fleet.final), "cleanup": dict(fleet.cleanup)}
    report["pids"].update({f"2-{n}": sorted(p) for n, p in fleet.pids.items()})
    return report


def main(out_path: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    import tensorsocket.ray as tsray
    from tensorsocket.endpoint import runtime_dir

    result: dict[str, Any] = {"parts": {}, "errors": {}}
    t0 = time.monotonic()
    try:
        tsray.producers(f"{PIPELINE}:make_loader")
        result["before_init"] = "no error"
    except Exception as exc:
        result["before_init"] = f"{type(exc).__name__}: {exc}"
    tmp = tempfile.mkdtemp(prefix="tsr-")
    # Ray writes the cluster's address under $RAY_TMPDIR/ray whatever temp_dir says, and does
    # not make that folder (/tmp/ray is missing where Ray never ran): keep it in ours.
    os.environ["RAY_TMPDIR"] = tmp
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3, "temp_dir": os.path.join(tmp, "ray")},
    )
    cluster.add_node(num_cpus=3)
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        cluster.wait_for_nodes()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        result["nodes"] = nodes
        result["up_s"] = time.monotonic() - t0
        parts = [
            ("bad", lambda: bad_input(ray, nodes)),
            ("tune", lambda: tune_run(ray, os.path.join(tmp, "tune"))),
            ("kill", lambda: kill_run(ray, nodes)),
            ("data", lambda: data_run(ray, nodes)),
            ("cut", lambda: cut_run(ray, nodes)),
        ]
        wanted = set(sys.argv[2:]) or {name for name, _ in parts}
        for name, run in parts:
            if name not in wanted:
                continue
            start = time.monotonic()
            try:
                result["parts"][name] = run()
            except Exception:
                result["errors"][name] = traceback.format_exc()
            result.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
    finally:
        ray.shutdown()
        cluster.shutdown()
    pids = [
        p
        for part in result["parts"].values()
        for key in ("pids", "workers")
        for ps in part.get(key, {}).values()
        for p in ps
    ]
    names = {n for part in result["parts"].values() for n in part.get("names", {}).values()}
    left = {
        "processes": [p for p in pids if os.path.exists(f"/proc/{p}")],
        "segments": [n for n in os.listdir("/dev/shm") if any(f"-{p}-" in n for p in pids)],
        "files": sorted(f for f in os.listdir(runtime_dir()) if f.split(".")[0] in names),
        "ray_children": [p for p in _children(os.getpid())],
    }
    result["left"] = left
    result["total_s"] = round(time.monotonic() - t0, 1)
    Path(out_path).write_text(json.dumps(result, default=str))
    subprocess.run(["rm", "-rf", tmp], timeout=60)
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return [
        p
        for p in found
        if Path(f"/proc/{p}/stat").exists()
        and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
