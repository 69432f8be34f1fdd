"""The GPU path end to end: ``Producer(device="cuda:0")`` and GPU consumers in real processes.

On CI (no GPU) every test runs over the CPU stand-in of the CUDA primitives
(``TENSORSOCKET_FAKE_CUDA=1``: arenas in /dev/shm, streams as FIFO worker threads, events that
fire when their stream reaches them). ``scripts/gpu.sh`` runs this same file on a real GPU with
``TENSORSOCKET_GPU_REAL=1``; the few tests that need the stand-in's knobs (several fake GPUs,
injected copy delays) say so and skip there.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Producer
from tensorsocket.transport.gpu_topology import GpuPathError
from tests.support import (
    SPAWN,
    NestedLoader,
    expected_batch,
    run_consumer,
    same,
    serving,
    shm_segments,
    start_consumers,
    unshare_pid_works,
    wait_until,
)

REAL = os.environ.get("TENSORSOCKET_GPU_REAL") == "1"
if REAL and not torch.cuda.is_available():
    pytest.skip("TENSORSOCKET_GPU_REAL=1 needs a CUDA GPU", allow_module_level=True)
fake_only = pytest.mark.skipif(REAL, reason="uses the CPU stand-in's knobs")
EPOCHS = 2


@pytest.fixture(autouse=True)
def _backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in for this process and every consumer it spawns (they inherit the env)."""
    for var in ("TENSORSOCKET_FAKE_CUDA_DELAY", "TENSORSOCKET_TEST_UNORDERED"):
        monkeypatch.delenv(var, raising=False)
    if not REAL:
        monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA", "1")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def collect(procs: list[Any], results: Any, n: int) -> list[dict[str, Any]]:
    reports = [results.get(timeout=90) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    return reports


def assert_exact(report: dict[str, Any], batches: int, epochs: int = EPOCHS) -> None:
    assert report["error"] is None, report["error"]
    assert report["bad"] == []
    assert report["seen"] == [(e, i) for e in range(epochs) for i in range(batches)]


def test_gpu_and_cpu_consumers_get_every_batch_bit_exact_over_two_epochs(name):
    batches = 7
    procs, results = start_consumers(name, 2, EPOCHS, batches, options={"device": "cuda:0"})
    cpu = SPAWN.Process(
        target=run_consumer, args=(name, EPOCHS, batches, results), kwargs={"options": {"device": "cpu"}}
    )
    cpu.start()
    with Producer(NestedLoader(batches), name=name, device="cuda:0", slots=3, min_consumers=3) as producer:
        pid = os.getpid()
        status = producer.status()
        assert status["transport"] == "cuda" and status["device"] == "cuda:0"
        producer.serve(epochs=EPOCHS)
    for report in collect(procs + [cpu], results, 3):
        assert_exact(report, batches)
        assert report["finished"] is True
    assert shm_segments(pid) == []  # the stand-in's arenas are segments; real ones are freed


def test_a_sigkilled_gpu_consumer_is_evicted_and_the_others_stay_exact(name):
    batches = 12
    procs, results = start_consumers(name, 2, EPOCHS, batches, options={"device": "cuda:0"}, step=0.01)
    victim = SPAWN.Process(
        target=run_consumer,
        args=(name, EPOCHS, batches, results),
        kwargs={"options": {"device": "cuda:0"}, "kill_after": 4, "hold": 2},
    )
    victim.start()
    Producer(NestedLoader(batches), name=name, device="cuda:0", slots=3, min_consumers=3).serve(epochs=EPOCHS)
    # The victim's own "killed" report may or may not beat its SIGKILL: read until both
    # survivors reported.
    survivors = []
    while len(survivors) < 2:
        report = results.get(timeout=90)
        if "killed_at" not in report:
            survivors.append(report)
    for p in procs + [victim]:
        p.join(timeout=30)
    assert victim.exitcode == -signal.SIGKILL
    for report in survivors:
        assert_exact(report, batches)


@fake_only
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_batches_are_announced_only_after_their_copy_completed(name, monkeypatch, ordered):
    # Every host-to-device copy takes 20 ms on the stand-in's producer stream. Announced
    # after completion, every batch is intact; announced at once (ordering disabled),
    # consumers read places whose copy has not landed.
    monkeypatch.setenv("TENSORSOCKET_FAKE_CUDA_DELAY", "0.02")
    if not ordered:
        monkeypatch.setenv("TENSORSOCKET_TEST_UNORDERED", "announce")
    batches = 10
    procs, results = start_consumers(name, 2, 1, batches, options={"device": "cuda:0"})
    producer = Producer(NestedLoader(batches), name=name, device="cuda:0", slots=2, replay=0, min_consumers=2)
    with serving(producer, epochs=1):  # closed once both reported, even if one left early
        reports = collect(procs, results, 2)
    if ordered:
        for report in reports:
            assert_exact(report, batches, epochs=1)
    else:
        # Read too early: wrong bytes, or bytes that changed under the consumer (BatchModified).
        assert any(r["bad"] or "BatchModified" in (r["error"] or "") for r in reports), reports


def _read_later(t: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Queue a read of ``t`` on the current stream that runs ~20 ms from now, as a kernel
    would: it holds no reference to the tensor, only its memory."""
    if REAL:
        torch.cuda._sleep(40_000_000)
        out.append(t.clone())
        return
    from tensorsocket.transport.device import backend

    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    dtype, shape = t.dtype, t.shape

    def kernel() -> None:
        time.sleep(0.02)
        raw = (ctypes.c_uint8 * n).from_address(ptr)
        out.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape))

    backend().current_stream(0).enqueue(kernel)


def _synchronize_current() -> None:
    """Wait for this thread's queued GPU work (``torch.cuda.synchronize()`` on a real GPU)."""
    if REAL:
        torch.cuda.synchronize()
        return
    from tensorsocket.transport.device import backend

    event = backend().event()
    event.record(backend().current_stream(0))
    event.synchronize()


def _batches_past_modified(consumer: Consumer) -> Iterator[Any]:
    """One epoch of ``consumer``'s batches, and None in place of each BatchModified (raised
    once, at the next() after the release check that found the change); the epoch goes on."""
    from tensorsocket import BatchModified

    it = iter(consumer)
    while True:
        try:
            yield next(it)
        except StopIteration:
            return
        except BatchModified:
            yield None


def _consume_with_queued_reads(name: str, batches: int, results: Any) -> None:
    """Queue a delayed read of each batch's image, drop the batch at once, check the reads."""
    report: dict[str, Any] = {"bad": [], "error": None, "modified": False}
    try:
        with Consumer(name=name, device="cuda:0") as consumer:
            reads: list[torch.Tensor] = []
            for batch in _batches_past_modified(consumer):
                if batch is None:  # its bytes changed while it was held: also a failure
                    report["modified"] = True
                    continue
                _read_later(batch[0], reads)
                del batch
            _synchronize_current()
            report["bad"] = [
                i for i, r in enumerate(reads) if not same(r.cpu(), expected_batch(i, batches)[0])
            ]
            report["reads"] = len(reads)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


@pytest.mark.parametrize(
    "ordered", [True, pytest.param(False, marks=fake_only)], ids=["ordered", "unordered"]
)
def test_a_place_is_released_only_after_the_consumers_queued_work_on_it(name, monkeypatch, ordered):
    if not ordered:
        monkeypatch.setenv("TENSORSOCKET_TEST_UNORDERED", "release")
    batches = 12
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_consume_with_queued_reads, args=(name, batches, results))
    proc.start()
    with serving(Producer(NestedLoader(batches), name=name, device="cuda:0", slots=1, replay=0), epochs=1):
        report = results.get(timeout=90)
    proc.join(timeout=30)
    assert report["error"] is None, report["error"]
    if ordered:
        assert report["reads"] == batches and report["bad"] == [] and not report["modified"]
    else:
        assert report["bad"], "releasing at once lets the producer overwrite batches still being read"


class _Growing:
    """Six small batches, then six 64x larger ones: every place's arena must grow once."""

    def __len__(self) -> int:
        return 12

    def __iter__(self) -> Any:
        for i in range(12):
            n = (64 << 10) if i < 6 else (4 << 20)
            yield torch.full((n,), i, dtype=torch.uint8)


def _count_opens(name: str, results: Any) -> None:
    from tensorsocket.transport.device import backend

    report: dict[str, Any] = {"error": None, "bad": []}
    try:
        with Consumer(name=name, device="cuda:0") as consumer:
            for i, batch in enumerate(consumer):
                if not bool((batch.cpu() == i).all()):
                    report["bad"].append(i)
                del batch
            report["opens"] = backend().open_count
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


def test_grown_arenas_are_reopened_once_each(name):
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_count_opens, args=(name, results))
    proc.start()
    Producer(_Growing(), name=name, device="cuda:0", slots=3, replay=0).serve(epochs=1)
    report = results.get(timeout=90)
    proc.join(timeout=30)
    assert report["error"] is None and report["bad"] == [], report
    assert report["opens"] == 6  # 3 places, each opened at first use and once more after growing


def _modify_first_batch(name: str, results: Any) -> None:
    report: dict[str, Any] = {"error": None, "taken": 0}
    with Consumer(name=name, device="cuda:0") as consumer:
        for batch in _batches_past_modified(consumer):
            if batch is None:
                report["error"] = "BatchModified"
                continue
            if report["taken"] == 0:
                batch[0].mul_(2)  # an in-place op on a shared batch
            report["taken"] += 1
            del batch
    results.put(report)


def test_an_in_place_write_to_gpu_memory_is_reported(name, caplog):
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_modify_first_batch, args=(name, results))
    proc.start()
    Producer(NestedLoader(8, delay=0.02), name=name, device="cuda:0", slots=2).serve(epochs=1)
    report = results.get(timeout=90)
    proc.join(timeout=30)
    assert report["error"] == "BatchModified" and report["taken"] == 8
    assert "changed in shared memory" in caplog.text


def _hold_first_batch(name: str, results: Any) -> None:
    """An innocent consumer: keeps batch 0 for the whole epoch and writes nothing."""
    from tensorsocket import BatchModified

    report: dict[str, Any] = {"error": None, "taken": 0}
    with Consumer(name=name, device="cuda:0", label="innocent") as consumer:
        kept = None
        try:
            for batch in consumer:
                kept = batch if kept is None else kept
                report["taken"] += 1
        except BatchModified as exc:
            report["error"] = str(exc)
        del kept
    results.put(report)


def test_a_changed_gpu_batch_is_logged_with_every_consumer_that_held_it(name, caplog):
    # GPU memory cannot be protected: both holders see the change, so the producer names both.
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=f, args=(name, results)) for f in (_modify_first_batch, _hold_first_batch)]
    for proc in procs:
        proc.start()
    with caplog.at_level(logging.ERROR, logger="tensorsocket"):
        Producer(NestedLoader(8, delay=0.02), name=name, device="cuda:0", slots=3, min_consumers=2).serve(
            epochs=1
        )
    reports = [results.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    writer = procs[0].pid
    assert any(r["error"] == "BatchModified" for r in reports), reports
    line = next(r.getMessage() for r in caplog.records if "changed in shared memory" in r.getMessage())
    assert f"(pid {writer})" in line and "'innocent'" in line and "any of which may have written it" in line


def _serve_forever(name: str, ready: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    producer = Producer(NestedLoader(50, delay=0.05), name=name, device="cuda:0", slots=3, replay=0)
    ready.put(os.getpid())
    producer.serve(epochs=None)


def _hold_with_blocked_stream(name: str, results: Any) -> None:
    """Take two batches, queue a long read, then wait for the producer to vanish."""
    report: dict[str, Any] = {"error": None}
    reads: list[torch.Tensor] = []
    try:
        with Consumer(name=name, device="cuda:0", timeout=2.0) as consumer:
            it = iter(consumer)
            held = [next(it), next(it)]
            for _ in range(10):
                _read_later(held[0][0], reads)  # ~0.2 s of queued work on the current stream
            results.put({"ready": True})
            t0 = time.monotonic()
            try:
                while True:
                    next(it)
            except Exception as exc:
                report["error"] = type(exc).__name__
                report["raised_after"] = time.monotonic() - t0
            t1 = time.monotonic()
            _synchronize_current()
            report["synchronized_in"] = time.monotonic() - t1
    except Exception as exc:
        report["error"] = report["error"] or f"outside: {type(exc).__name__}: {exc}"
    results.put(report)


def test_a_sigkilled_producer_leaves_gpu_consumers_raising_and_their_streams_free(name):
    ready, results = SPAWN.Queue(), SPAWN.Queue()
    producer = SPAWN.Process(target=_serve_forever, args=(name, ready, {}))
    producer.start()
    pid = ready.get(timeout=60)
    consumer = SPAWN.Process(target=_hold_with_blocked_stream, args=(name, results))
    consumer.start()
    assert results.get(timeout=60) == {"ready": True}
    os.kill(pid, signal.SIGKILL)
    report = results.get(timeout=60)
    consumer.join(timeout=30)
    producer.join(timeout=30)
    assert report["error"] == "ProducerLost", report
    assert report["raised_after"] < 3.0
    assert report["synchronized_in"] < 10.0


def _consumer_on(name: str, results: Any, visible: str, device: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    report: dict[str, Any] = {"error": None, "bad": []}
    try:
        with Consumer(name=name, device=device) as consumer:
            report["delivery"] = consumer.delivery
            for i, batch in enumerate(consumer):
                if i == 3:
                    break
                if not same(batch, expected_batch(i, 50)):
                    report["bad"].append(i)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


@fake_only
def test_devices_are_matched_by_uuid_not_by_ordinal(name):
    # The producer sees only physical GPU 1, as its cuda:0. A consumer that sees both GPUs
    # finds it as cuda:1 (views); its cuda:0 is another GPU (a copy); one that sees only
    # physical GPU 0 cannot read it and says so.
    ready, results = SPAWN.Queue(), SPAWN.Queue()
    producer = SPAWN.Process(target=_serve_forever, args=(name, ready, {"CUDA_VISIBLE_DEVICES": "1"}))
    producer.start()
    ready.get(timeout=60)
    try:
        for visible, device in (("0,1", "cuda:1"), ("0,1", "cuda:0"), ("0", "cuda:0")):
            proc = SPAWN.Process(target=_consumer_on, args=(name, results, visible, device))
            proc.start()
            report = results.get(timeout=60)
            proc.join(timeout=30)
            if visible == "0":
                assert report["error"].startswith("GpuPathError")
                assert "not visible" in report["error"] and "CUDA_VISIBLE_DEVICES=0" in report["error"]
            else:
                assert report["error"] is None and report["bad"] == [], report
                assert report["delivery"] == ("views" if device == "cuda:1" else "copy")
    finally:
        producer.kill()
        producer.join(timeout=30)


def test_gpu_path_errors_are_tensorsocket_errors():
    from tensorsocket import TensorSocketError

    assert issubclass(GpuPathError, TensorSocketError)


# ----------------------------------------------------------- a consumer in another PID namespace


needs_unshare = pytest.mark.skipif(
    not unshare_pid_works(), reason="unshare --pid needs root (CI runs as root)"
)
# The consumer in the other namespace gets host memory; on a real GPU it copies it there.
OTHER_NS_DEVICE = "cuda:0" if REAL else "cpu"


def _consumer_in_new_pid_namespace(
    name: str, epochs: int, batches: int, go: str | None = None, **options: Any
) -> subprocess.Popen:
    """``run_consumer`` in a new PID namespace (as in another container), reporting on stdout;
    with ``go``, it makes ``go + '.ready'`` once its imports are done (wait for it: under load
    they take seconds), then joins as soon as ``go`` exists."""
    script = (
        "import json, os, time\n"
        "import tensorsocket\n"
        "from tests.support import run_consumer\n"
        "class Out:\n"
        "    def put(self, report):\n"
        "        print('REPORT ' + json.dumps(report), flush=True)\n"
        "class Go:\n"
        "    def wait(self, timeout):\n"
        f"        open({go!r} + '.ready', 'w').close()\n"
        "        end = time.monotonic() + timeout\n"
        f"        while not os.path.exists({go!r}) and time.monotonic() < end:\n"
        "            time.sleep(0.005)\n"
        f"run_consumer({name!r}, {epochs}, {batches}, Out(), options={options!r}, go=Go() if {go!r} else None)\n"
    )
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report_of(proc: subprocess.Popen) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert lines, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])
    report["seen"] = [tuple(s) for s in report["seen"]]
    assert report["pid"] == 1  # it did run in a namespace of its own
    return report


@needs_unshare
def test_a_consumer_in_another_pid_namespace_reads_a_host_mirror(name, caplog):
    batches = 7  # ragged batches: the places grow, and both transports hear of it
    local, results = start_consumers(name, 1, EPOCHS, batches, options={"device": "cuda:0"})
    other = _consumer_in_new_pid_namespace(name, EPOCHS, batches, device=OTHER_NS_DEVICE)
    with caplog.at_level(logging.WARNING, logger="tensorsocket"):
        Producer(NestedLoader(batches), name=name, device="cuda:0", slots=3, min_consumers=2).serve(
            epochs=EPOCHS
        )
    assert_exact(collect(local, results, 1)[0], batches)
    assert_exact(_report_of(other), batches)
    assert "runs in another PID namespace" in caplog.text
    assert "host shared-memory copy of every batch" in caplog.text


@needs_unshare
def test_a_late_joiner_in_another_pid_namespace_replays_batches_written_before_the_mirror(name, tmp_path):
    # The mirror starts when the joiner arrives, mid-epoch: the batches already in the places
    # are copied into it, and the joiner replays the whole epoch from them.
    batches = 8
    go = str(tmp_path / "go")
    other = _consumer_in_new_pid_namespace(
        name, EPOCHS, batches, go=go, device=OTHER_NS_DEVICE, late_join="replay"
    )
    wait_until(lambda: os.path.exists(go + ".ready"), 120, "the other namespace's consumer to import")
    local, results = start_consumers(name, 1, EPOCHS, batches, options={"device": "cuda:0"}, step=0.3)
    producer = Producer(
        NestedLoader(batches), name=name, device="cuda:0", slots=3, replay=64 << 20, min_consumers=1
    )
    with serving(producer, epochs=EPOCHS):
        deadline = time.monotonic() + 60
        while producer.status()["published"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        open(go, "w").close()
        while len(producer.status()["consumers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status = producer.status()
        assert len(status["consumers"]) == 2 and status["epoch"] == 0, status  # it joined mid-epoch 0
        late = _report_of(other)
        first = collect(local, results, 1)[0]
    assert_exact(first, batches)
    assert_exact(late, batches)


def test_a_gpu_batch_saves_with_torch_save_leaf_by_leaf(name):
    """Leaves of several dtypes: torch.save refused a GPU batch whose leaves were slices of
    one storage as other dtypes, and a leaf saved alone wrote its whole region. Each leaf has
    a storage of its own, and the batch is released all the same once they are gone."""
    batches = 3
    with serving(Producer(NestedLoader(batches), name=name, device="cuda:0", slots=2, replay=0), epochs=1):
        with Consumer(name=name, device="cuda:0") as consumer:
            for i, batch in enumerate(consumer):
                saved = io.BytesIO()
                torch.save(batch, saved)
                saved.seek(0)
                loaded = torch.load(saved, weights_only=False, map_location="cpu")
                assert same(loaded, expected_batch(i, batches))
                image = batch[0][0]
                alone = io.BytesIO()
                torch.save(image, alone)
                assert alone.tell() < image.nbytes + 4096
            assert i == batches - 1


def test_a_stream_that_is_not_a_cuda_stream_is_refused_at_construction(name):
    """Before: accepted, then every release failed in a finalizer (printed, ignored) and the
    consumer ran out of places after `slots` batches with a misleading Hoarding."""
    from tensorsocket.transport.device import backend

    producer = Producer(NestedLoader(3), name=name, device="cuda:0", slots=2)
    with serving(producer, epochs=1):
        with pytest.raises(ValueError, match="stream must be a CUDA stream"):
            Consumer(name=name, device="cuda:0", stream="bogus", timeout=10)
        with Consumer(name=name, device="cuda:0", stream=backend().current_stream(0), timeout=10) as consumer:
            assert [batch[1]["meta"][2] for batch in consumer] == [0, 1, 2]
