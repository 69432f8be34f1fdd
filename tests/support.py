"""Test support: a nested, ragged, deterministic loader and consumer processes that verify
every batch bit for bit without asking the producer."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch


class _FreshProcess(mp.context.ForkServerProcess):
    """A process as a trainer script started from a shell is (a fresh interpreter's state,
    this process's environment at ``start()``, the platform's default way to start processes
    of its own: a DataLoader's workers), but forked from a server that has torch imported
    already: ~0.03 s to start instead of ~3.5 s on the 2-core VM, for the suite's hundreds."""

    def start(self) -> None:
        self._environ = dict(os.environ)  # (a forkserver child would get the server's)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        # (it would inherit "forkserver", and each loader with workers would start a server of
        # its own that imports torch again)
        mp.set_start_method(None, force=True)
        super().run()


class _FreshContext(mp.context.ForkServerContext):
    Process = _FreshProcess


# Third-party modules only: tensorsocket's own import reads the environment (each child must
# import it with its own).
mp.set_forkserver_preload(["torch", "numpy", "zmq", "msgpack"])
SPAWN = _FreshContext()
# For a script the suite runs in a fresh interpreter (another mount namespace, say) that starts
# its processes first, before it has a thread or a producer: forked from it they start at once,
# where SPAWN would first start a server of their own that imports torch again (~3.5 s).
FORK = mp.get_context("fork")

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.02
) -> T:
    """Poll ``predicate`` every ``interval`` s until it returns something truthy and return
    that; at the deadline raise AssertionError naming ``what`` (a callable is called then, to
    show the state it timed out in), so a test fails with a sentence instead of hanging. The
    predicate is tried once more at the deadline, so a slow poll cannot lose it; an
    AssertionError it raises itself (a peer died, say) ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what() if callable(what) else what}"
            )
        time.sleep(min(interval, remaining))


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def expected_batch(index: int, batches: int, batch_size: int = 8, seed: int = 0) -> Any:
    """Batch ``index``: nested tuple/list/dict, several dtypes, a ragged last batch and a
    leaf whose shape changes every batch. A pure function of its arguments."""
    g = torch.Generator().manual_seed(seed * 100003 + index)
    rows = batch_size if index < batches - 1 else max(1, batch_size // 2 - 1)
    width = 3 + index % 4
    image = torch.rand(rows, 3, 5, width, generator=g)
    image[0, 0, 0, 0] = float("nan") if index % 3 == 0 else -0.0
    return (
        image,
        {
            "label": torch.randint(0, 1000, (rows,), generator=g),
            "half": torch.randn(rows, 2, generator=g).to(torch.bfloat16),
            "mask": torch.rand(rows, generator=g) > 0.5,
            "np": np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + index,
            "meta": [f"batch-{index}", None, index, 0.25 * index, b"\x00\xff"],
            "empty": torch.zeros(0, 7),
        },
    )


class NestedLoader:
    """Re-iterable loader of ``expected_batch``; counts how many batches were pulled."""

    def __init__(self, batches: int = 6, batch_size: int = 8, seed: int = 0, delay: float = 0.0) -> None:
        self.batches, self.batch_size, self.seed, self.delay = batches, batch_size, seed, delay
        self.pulled = 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        for i in range(self.batches):
            if self.delay:
                time.sleep(self.delay)
            self.pulled += 1
            yield expected_batch(i, self.batches, self.batch_size, self.seed)


class HeldFirstEpoch:
    """A re-iterable loader whose first epoch stops before batch ``at`` until
    :meth:`go_once_joined`: a test's late joiner then joins mid-epoch however slow the
    machine, where a paced loader left it a fraction of a second before the epoch ended (and
    it started the next one)."""

    def __init__(self, loader: Any, at: int) -> None:
        self.loader, self.at = loader, at
        self.gate = threading.Event()
        self.epochs = 0

    def __len__(self) -> int:
        return len(self.loader)

    def go_once_joined(self, producer: Any, consumers: int = 2) -> None:
        """Let the first epoch go on once ``producer`` lists ``consumers`` consumers."""
        wait_until(lambda: len(producer.status()["consumers"]) == consumers, 30, "the joiner to join")
        self.gate.set()

    def __iter__(self) -> Any:
        first, self.epochs = self.epochs == 0, self.epochs + 1
        batches = iter(self.loader)
        if first:
            yield from itertools.islice(batches, self.at)
            if not self.gate.wait(60):
                raise TimeoutError(f"the test did not let the loader past batch {self.at} within 60 s")
        yield from batches


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested batches, including NaNs and -0.0, types and dtypes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        a, b = a.cpu(), b.cpu()  # a GPU consumer's batch against the loader's host batch
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            if a.numel()
            else a.dtype == b.dtype and a.shape == b.shape
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def run_consumer(
    name: str,
    epochs: int,
    batches: int,
    results: Any,
    batch_size: int = 8,
    kill_after: int | None = None,
    step: float = 0.0,
    hold: int = 0,
    options: dict[str, Any] | None = None,
    go: Any = None,
) -> None:
    """Consumer process body: iterate ``epochs`` epochs, verify every batch, report.

    Reports ``{"pid", "seen": [(epoch, index)], "bad": [...], "len", "after_end", "finished"}``
    on ``results``. ``kill_after`` SIGKILLs itself after that many batches; ``hold`` keeps
    the last N batches alive and re-verifies them at every step; ``step`` sleeps per batch;
    ``go`` (an Event) is waited for before joining, so a test can time a late join without
    waiting for a process to start.
    """
    from tensorsocket import Consumer

    if go is not None:
        go.wait(60)

    report: dict[str, Any] = {"pid": os.getpid(), "seen": [], "bad": [], "error": None}
    consumer = Consumer(name=name, **(options or {}))
    try:
        report["len"] = len(consumer)
        held: list[tuple[int, Any]] = []
        count = 0
        for epoch in range(epochs):
            index = 0
            for batch in consumer:
                if not same(batch, expected_batch(index, batches, batch_size)):
                    report["bad"].append((epoch, index))
                report["seen"].append((epoch, index))
                if hold:
                    held.append((index, batch))
                    held = held[-hold:]
                    for i, b in held:
                        if not same(b, expected_batch(i, batches, batch_size)):
                            report["bad"].append(("held", epoch, i))
                del batch
                index += 1
                count += 1
                if kill_after is not None and count == kill_after:
                    results.put({"pid": os.getpid(), "killed_at": time.time()})
                    os.kill(os.getpid(), signal.SIGKILL)
                if step:
                    time.sleep(step)
        report["after_end"] = sum(1 for _ in consumer)
        report["finished"] = consumer.finished
    except Exception as exc:  # reported, so the test shows it
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        consumer.close()
        results.put(report)


def start_consumers(name: str, n: int, epochs: int, batches: int, **kwargs: Any) -> tuple[list[Any], Any]:
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=run_consumer, args=(name, epochs, batches, results), kwargs=kwargs)
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    return procs, results


def shm_segments(pid: int | None = None) -> list[str]:
    """tensorsocket segments in /dev/shm of this uid (and of producer ``pid`` if given)."""
    prefix = f"tensorsocket-{os.getuid()}-" + (f"{pid}-" if pid is not None else "")
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def free_port() -> int:
    """A tcp port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_or_fail(thread: Any, timeout: float = 30.0) -> None:
    """Join a test thread; fail (instead of hanging the suite) if it is still running."""
    thread.join(timeout)
    assert not thread.is_alive(), f"thread {thread.name} did not finish within {timeout} s"


def run_consumer_and_die(
    name: str,
    batches: int,
    results: Any,
    kill_after: int,
    go: Any = None,
    options: dict[str, Any] | None = None,
) -> None:
    """Consumer process body: take ``kill_after`` batches of epoch 0, keep every one of them
    alive, wait for ``go`` (if given: the test saw them held), report ``{"pid", "killed_at",
    "held", "bad"}`` and SIGKILL itself while holding them. The report is flushed before the
    kill (a plain ``Queue.put`` is sent by a feeder thread that the kill could beat)."""
    from tensorsocket import Consumer

    consumer = Consumer(name=name, **(options or {}))
    held, bad = [], []
    for index, batch in enumerate(consumer):
        if not same(batch, expected_batch(index, batches)):
            bad.append(index)
        held.append(batch)
        if len(held) == kill_after:
            break
    if go is not None and not go.wait(60):
        raise TimeoutError("the test never said go")
    results.put({"pid": os.getpid(), "killed_at": time.time(), "held": len(held), "bad": bad})
    results.close()
    results.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def serve_producer(
    name: str, batches: int, ready: Any, delay: float = 0.0, slots: int = 3, epochs: int | None = None
) -> None:
    """Producer process body: serve ``NestedLoader(batches, delay=delay)`` for ``epochs``
    epochs (None: forever); put this process's pid on ``ready`` once it is bound."""
    from tensorsocket import Producer

    producer = Producer(NestedLoader(batches, delay=delay), name=name, slots=slots, replay=0)
    ready.put(os.getpid())
    producer.serve(epochs=epochs)


def run_frozen_victim(name: str, ready: Any, go: Any, results: Any) -> None:
    """Take two batches, signal ``ready``, spin until ``go.value`` (the test freezes us
    meanwhile), then ask for one more batch at once and report what happened. ``go`` is a
    lock-free RawValue: an Event's lock could be held by us when we are frozen."""
    from tensorsocket import Consumer

    report: dict[str, Any] = {"error": None, "stale": None}
    consumer = Consumer(name=name, timeout=1.0)
    try:
        it = iter(consumer)
        held = [next(it), next(it)]
        ready.set()
        while not go.value:
            pass  # no sleep: after SIGCONT, next() runs before the I/O thread gets far
        batch = next(it)
        report["stale"] = not same(batch, expected_batch(2, 50))
    except Exception as exc:
        report["error"] = type(exc).__name__
    finally:
        del held
        consumer.close()
        results.put(report)


@contextlib.contextmanager
def serving(producer: Any, epochs: int | None) -> Iterator[tuple[threading.Thread, list[BaseException]]]:
    """Run ``producer.serve(epochs)`` in a thread; close the producer and join it on the way out."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            producer.serve(epochs=epochs)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=body, name="test-serve", daemon=True)
    thread.start()
    try:
        yield thread, errors
    finally:
        producer.close()
        thread.join(timeout=30)


def permissions(address: int) -> str | None:
    """The permissions of this process's mapping that holds ``address``, as /proc/self/maps
    shows them ("r--s": read-only, shared), or None if no mapping holds it."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(v, 16) for v in span.split("-"))
            if start <= address < end:
                return perms
    return None


def small_shm_works() -> bool:
    """Can this process give a child a private 64 MiB /dev/shm (a mount namespace: root)?"""
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except FileNotFoundError:
        return False


def run_in_64_mib_dev_shm(
    script: str, args: list[str], tmp_path: Any, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Run ``script`` (Python source) with ``args`` in a mount namespace whose /dev/shm is a
    64 MiB tmpfs, as Docker gives a container by default; the JSON it printed on its last
    ``REPORT `` line, and its output."""
    path = tmp_path / "in_small_shm.py"
    path.write_text(script)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inner = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    command = ["unshare", "-m", "sh", "-c", inner, "sh", sys.executable, str(path), *args]
    env = os.environ | {"PYTHONPATH": root} | (env or {})
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("REPORT ") :]), done.stdout


@functools.cache
def unshare_pid_works() -> bool:
    """Can this process start one in a PID namespace of its own (as in another container)?
    (root, as on CI)"""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@functools.cache
def private_network() -> list[str] | None:
    """The command prefix that runs a command (its arguments follow) in a fresh network
    namespace with only loopback up (``unshare -n``: root, as on CI), where a server bound to
    every interface reaches loopback only; None where that is not permitted."""
    prefix = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:  # no unshare here
        return None
    return prefix if probe.returncode == 0 else None
