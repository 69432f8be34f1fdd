"""tensorsocket.ray on a local Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``).

The cluster runs in ``tests/ray_scenario.py``, in a fresh network namespace (``unshare -n``,
loopback only), because Ray binds every interface by default. One run of it (~90 s) serves
every test here; each test asserts on its part of the JSON it writes. Skipped without the
``ray`` extra or where ``unshare -n`` is not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'tensorsocket[ray]')")
pytest.importorskip("ray.tune", reason="ray[tune] is not installed (pip install 'tensorsocket[ray]')")

ROOT = Path(__file__).resolve().parent.parent
SCENARIO_S = 420  # the whole scenario's deadline (about 90 s on a 2-core VM)
SAMPLES = 64
pytestmark = [pytest.mark.ray, pytest.mark.timeout(SCENARIO_S + 60)]


def _namespace_command() -> list[str] | None:
    """``unshare`` arguments that give a private network namespace here, or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None or shutil.which("ss") is None:
        return None
    for args in (["unshare", "-n"], ["unshare", "-rn"]):  # as root, else in a user namespace
        try:
            probe = subprocess.run([*args, "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return args
    return None


@pytest.fixture(scope="module")
def scenario() -> dict[str, Any]:
    unshare = _namespace_command()
    if unshare is None:
        pytest.skip("needs `unshare -n` (a private network namespace for Ray), ip and ss")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with tempfile.TemporaryDirectory(prefix="ts-ray-test-") as tmp:
        out = Path(tmp) / "scenario.json"
        command = f"ip link set lo up && exec {sys.executable} tests/ray_scenario.py {out}"
        try:
            run = subprocess.run(
                [*unshare, "sh", "-c", command],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=SCENARIO_S,
            )
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-4000:]
            pytest.fail(f"the Ray scenario did not finish within {SCENARIO_S} s; stderr: {tail!r}")
        if run.returncode != 0 or not out.exists():
            pytest.fail(f"the Ray scenario failed (exit {run.returncode}): {run.stderr[-4000:]}")
        result = json.loads(out.read_text())
    assert result["errors"] == {}, "a scenario part raised:\n" + "\n".join(result["errors"].values())
    return result


def _all_once(epochs: list[list[int]], n: int, count: int) -> bool:
    return len(epochs) == count and all(sorted(ids) == list(range(n)) for ids in epochs)


def test_bad_fleets_fail_at_construction(scenario: dict[str, Any]) -> None:
    assert scenario["before_init"].startswith("RuntimeError: Ray is not initialized")
    bad = scenario["parts"]["bad"]
    assert bad["not_a_spec"].startswith("PipelineError: PIPELINE 'no_colon_here' must be module:function")
    assert bad["missing_file"].startswith("PipelineError: pipeline file './nope/pipeline.py' does not exist")
    assert bad["unknown_option"].startswith("TypeError: unknown option(s) sluts")
    assert bad["nan_start_timeout"].startswith(
        "ValueError: start_timeout must be a positive number of seconds"
    )
    assert bad["nan_cpus"].startswith("ValueError: cpus must be a finite number of CPUs >= 0, got nan")
    assert bad["raises"].startswith("ValueError: the producer on node ")
    assert "OSError: no such dataset: /nonexistent" in bad["raises"]


def test_tune_trials_read_their_own_nodes_producer(scenario: dict[str, Any]) -> None:
    tune = scenario["parts"]["tune"]
    nodes = scenario["nodes"]
    trials = tune["trials"]
    assert len(trials) == 4 and all(t["error"] is None for t in trials), trials
    by_node = {node: sorted(t["label"] for t in trials if t["node"] == node) for node in nodes}
    assert sorted(len(labels) for labels in by_node.values()) == [2, 2], by_node
    for node in nodes:
        record = tune["status"][node]
        assert record["error"] is None and record["name"] == tune["names"][node]
        assert sorted(c["label"] for c in record["served"]) == by_node[node], (
            "served exactly its node's trials"
        )
    for trial in trials:
        assert _all_once(json.loads(trial["seen"]), SAMPLES, 2), (
            f"{trial['label']} missed or repeated samples"
        )
    for node in nodes:  # both trials of a node read the same stream: one producer per node
        streams = {trial["seen"] for trial in trials if trial["node"] == node}
        assert len(streams) == 1


def test_ray_listens_on_loopback_only(scenario: dict[str, Any]) -> None:
    listening = scenario["parts"]["tune"]["listening"]
    assert listening, "ss saw no listening socket while the cluster ran"
    loopback = ("127.", "[::1]", "[::ffff:127.")
    assert [a for a in listening if not a.startswith(loopback)] == []


def test_a_killed_producer_actor_restarts_and_its_trials_go_on(scenario: dict[str, Any]) -> None:
    kill = scenario["parts"]["kill"]
    assert kill["pending"] == 0
    tasks = kill["tasks"]
    assert len(tasks) == 4
    for task in tasks:
        assert task["error"] is None, task["error"]
        assert _all_once(task["seen"], SAMPLES, 2)
    restarted = kill["restarted"]
    assert restarted["restarted"] is True and restarted["pid"] != restarted["first_pid"]
    assert len(restarted["served"]) == 2  # both consumers rejoined the restarted producer


def test_a_producer_actor_without_restarts_left_fails_its_trial_clearly(scenario: dict[str, Any]) -> None:
    last = scenario["parts"]["kill"]["no_restart"]
    assert last["error"].startswith("ProducerLost: the producer at ipc://")
    assert "died; waited 2 s for a producer to continue the stream" in last["error"]
    assert last["after_kill_s"] < 15  # reconnect=2 s, plus noticing the death: never a hang
    assert "actor died" in last["status"]["error"]


def test_a_ray_data_pipeline_as_the_loader(scenario: dict[str, Any]) -> None:
    data = scenario["parts"]["data"]
    assert data["pending"] == 0 and len(data["tasks"]) == 2
    assert sorted(t["node"] for t in data["tasks"]) == sorted(scenario["nodes"])
    for task in data["tasks"]:
        assert task["len"] == 6
        assert _all_once(task["seen"], 48, 2)


def test_a_fleet_close_cut_short_by_ctrl_c_still_stops_its_actors(scenario: dict[str, Any]) -> None:
    """Before: close() marked the fleet closed, then Ctrl-C in its wait for the stops (up to
    linger + 30 s) skipped the kill and the clean-up, and the next close() did nothing: the
    actors kept their CPUs for the driver's life and left their files on the nodes."""
    cut = scenario["parts"]["cut"]
    assert cut["interrupted"]
    assert cut["alive_after"] == []
    assert len(cut["cleanup"]) == 2  # (both nodes cleaned; what was left: checked below)
    # Cut short in the clean-up: the next close() cleans, and keeps the stops' records.
    first, after = cut["interrupted_cleaning"], cut["after_cleaning"]
    assert first["cleanup"] == {} and len(first["final"]) == 2
    assert after["final"] == first["final"] and len(after["cleanup"]) == 2
    assert all(record["error"] is None for record in after["final"].values()), after["final"]


def test_nothing_is_left(scenario: dict[str, Any]) -> None:
    for part in ("tune", "kill", "data", "cut"):
        for node, found in scenario["parts"][part]["cleanup"].items():
            assert not any(found["left"].values()), (part, node, found)
    for node, found in scenario["parts"]["cut"]["after_cleaning"]["cleanup"].items():
        assert not any(found["left"].values()), ("cut2", node, found)
    for part in ("tune", "kill"):
        for record in scenario["parts"][part]["final"].values():
            if record.get("error") is None:  # the node whose actor was killed for good has no record
                assert not any(record["left"].values()), record
    assert scenario["left"] == {"processes": [], "segments": [], "files": [], "ray_children": []}


def test_arguments_are_checked_without_a_cluster() -> None:
    """What needs no running Ray: names, options, the trial side outside Ray."""
    import tensorsocket.ray as tsray

    node = "ab" * 28  # a node id: 56 hex digits
    assert tsray.node_name("sweep1", node) == "sweep1-" + node[:16]
    with pytest.raises(ValueError, match="1-47 characters"):
        tsray.node_name("n" * 48, node)
    with pytest.raises(ValueError, match="not a Ray node id"):
        tsray.node_name("sweep1", "node-1")
    with pytest.raises(ValueError, match="must be 1-64 characters of letters"):
        tsray.node_name("bad/name", node)
    spec = str(ROOT / "tests" / "ray_pipeline.py") + ":make_loader"
    with pytest.raises(TypeError, match="unknown option"):
        tsray.producers(spec, resume=True)
    with pytest.raises(ValueError, match="restarts must be"):
        tsray.producers(spec, restarts=-1)
    with pytest.raises(ValueError, match="epochs must be"):
        tsray.producers(spec, epochs=0)
    with pytest.raises(RuntimeError, match="Ray is not initialized"):
        tsray.producers(spec)
    with pytest.raises(RuntimeError, match="Ray is not initialized in this process"):
        tsray.consumer("sweep1")
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        tsray.RayDataLoader([1, 2, 3], 2)


def test_a_second_fleet_of_a_served_name_leaves_the_first_ones_state_file(monkeypatch, tmp_path) -> None:
    """A node's producer of a second fleet with the same name is refused, as before, and does
    not first remove the serving producer's state file (what a restart of that producer
    resumes from). No cluster needed: the actor's class is built as Ray would, on this node."""
    import ray

    from tensorsocket import Producer
    from tensorsocket import endpoint as endpoints
    from tensorsocket.producer import state_file
    from tensorsocket.ray import actor
    from tensorsocket.ray.naming import node_name

    node = "ab" * 28
    monkeypatch.setattr(actor, "current_node_id", lambda: node)
    monkeypatch.setattr(
        ray, "get_runtime_context", lambda: type("C", (), {"was_current_actor_reconstructed": False})()
    )
    name = f"t{os.getpid() % 10000}-{os.urandom(3).hex()}"
    served = node_name(name, node)
    state = state_file.state_path(endpoints.resolve(served))
    with Producer([1, 2, 3], name=served, resume=True):
        state.write_text("{}")  # (what the serving producer keeps; its content is not read here)
        second = actor.NodeProducer(
            f"{ROOT / 'tests' / 'ray_pipeline.py'}:make_loader", {}, name, None, {}, True
        )
        assert second.producer is None and "already serving" in (second.error or ""), second.error
        assert state.exists()  # the first fleet's, untouched
    state_file.remove(state)


def test_a_killed_process_is_alive_until_its_last_thread_is_gone() -> None:
    """The clean-up waits for the actors' processes to exit before it takes their names' locks.
    A killed process's main thread turns zombie before its other threads have exited, and
    they hold its files meanwhile: taken for gone then, the clean-up found the lock held and
    left the name's files (2 of 2 scenario runs here, before). Here a main thread that exits alone."""
    from tensorsocket.host import process_state
    from tensorsocket.ray.actor import _alive

    code = (
        "import ctypes, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        wait_until(lambda: process_state(child.pid) == "Z", 10, "the main thread to exit")
        assert _alive(child.pid)  # (its other thread sleeps on)
        child.kill()
        wait_until(lambda: not _alive(child.pid), 10, "the whole process to exit")
    finally:
        child.kill()
        child.wait(timeout=10)
