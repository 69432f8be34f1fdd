"""The producer's I/O thread serves control traffic while the loader is busy."""

from __future__ import annotations

import os
import threading
import time

import torch
import zmq

from tensorsocket import Consumer, Producer, protocol
from tensorsocket.endpoint import connect_address
from tensorsocket.protocol import Kind


class _SlowSecondBatch:
    """Yields batch 0 at once, then blocks in the loader until ``go`` is set (or ``hold``
    seconds passed)."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.blocked, self.go = threading.Event(), threading.Event()

    def __iter__(self):
        yield 0
        self.blocked.set()
        self.go.wait(self.hold)
        yield 1


def test_status_and_joins_are_served_while_the_loader_blocks(name):
    loader = _SlowSecondBatch(hold=60.0)
    producer = Producer(loader, name=name, slots=2, replay=0)
    server = threading.Thread(target=producer.serve, kwargs={"epochs": 1}, daemon=True)
    server.start()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        with Consumer(name=name, timeout=10) as first:
            it = iter(first)
            assert int(next(it)) == 0
            assert loader.blocked.wait(5)
            raw.connect(connect_address(producer.endpoint))
            raw.send(protocol.encode(Kind.STATUS, status=None))
            assert raw.poll(10_000), "no STATUS reply while the loader was busy"
            kind, msg = protocol.decode(raw.recv(), protocol.MAX_REPLY_BYTES)
            assert kind is Kind.STATUS and len(msg["status"]["consumers"]) == 1
            # The handshake needs the I/O thread; the loader stays blocked until it is done.
            with Consumer(name=name, timeout=10) as second:
                loader.go.set()
                assert [int(b) for b in it] == [1]
                assert [int(b) for b in second] == [0, 1]  # batch 0 still resident: whole epoch
    finally:
        raw.close(0)
        producer.close()
        server.join(timeout=10)


def test_a_hello_with_an_extreme_pid_does_not_stop_the_producer(name):
    from tensorsocket.host import boot_id, pid_namespace

    producer = Producer([torch.zeros(3)], name=name, slots=2, replay=0)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(connect_address(producer.endpoint))
        for pid in ((1 << 31) - 1, 1 << 31):  # the largest valid pid, then one out of range
            raw.send(
                protocol.encode(
                    Kind.HELLO,
                    version=protocol.VERSION,
                    pid=pid,
                    boot_id=boot_id(),
                    pidns=pid_namespace(),
                    label="x",
                    prefetch=2,
                    timeout=5.0,
                )
            )
            assert raw.poll(2000)
            raw.recv()
        time.sleep(0.2)  # a few liveness ticks: the first peer's pid is checked and evicted
        with Consumer(name=name, timeout=2) as consumer:  # the I/O thread still serves
            assert consumer.slots == 2
    finally:
        raw.close(0)
        producer.close()


def test_a_batch_too_big_to_describe_fails_clearly_and_consumers_get_the_reason(name):
    from tensorsocket import ProducerLost

    loader = [(torch.zeros(2), b"x" * (protocol.MAX_REPLY_BYTES + 1))]
    producer = Producer(loader, name=name, slots=2, replay=0)
    errors: list[BaseException] = []

    def body() -> None:
        try:
            producer.serve(epochs=1)
        except BaseException as exc:
            errors.append(exc)

    server = threading.Thread(target=body, daemon=True)
    server.start()
    with Consumer(name=name, timeout=5) as consumer:
        try:
            list(consumer)
        except ProducerLost as exc:
            assert "put large data in tensors" in str(exc)
        else:
            raise AssertionError("the consumer was not told why the stream ended")
    server.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], TypeError)


def test_close_from_another_thread_ends_a_producer_loop_quietly(name):
    producer = Producer([torch.zeros(1)] * 100, name=name, slots=2, replay=0)
    with Consumer(name=name, prefetch=2) as consumer:  # joins and never iterates: stalls the loop
        closer = threading.Timer(0.5, producer.close)
        closer.start()
        published = sum(1 for _ in producer)  # must end, not raise
        closer.join()
        assert published <= 3
        del consumer


def test_a_producer_script_that_dies_without_close_leaves_no_segments(name, tmp_path):
    import subprocess
    import sys

    from tests.support import shm_segments

    script = tmp_path / "crash.py"
    script.write_text(
        "import sys, torch\n"
        "from tensorsocket import Producer\n"
        f"p = Producer([torch.zeros(1000)] * 5, name={name!r}, slots=2, replay=0)\n"
        "print(p.endpoint, flush=True)\n"
        "for i, batch in enumerate(p):\n"
        "    print('published', flush=True)\n"
        "    sys.stdin.readline()\n"
        "    raise RuntimeError('the training step crashed')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        proc.stdout.readline()
        with Consumer(name=name, timeout=5):
            assert proc.stdout.readline().strip() == "published"
            assert shm_segments(proc.pid)  # the slot's segment exists while it runs
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        assert proc.returncode == 1
        assert shm_segments(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_consumer_process_exiting_mid_epoch_without_close_exits_cleanly(name, tmp_path):
    """The consumer's daemon I/O thread is stopped before zmq is torn down at exit; without
    that the process sometimes aborted (SIGABRT, 'terminate called without an active exception')."""
    import subprocess
    import sys

    script = tmp_path / "exit_mid_epoch.py"
    script.write_text(
        "import sys\n"
        "from tensorsocket import Consumer\n"
        "for batch in Consumer(name=sys.argv[1]):\n"
        "    sys.exit(0)\n"
    )
    producer = Producer([torch.zeros(1000)] * 1000, name=name, slots=4, replay=0)
    server = threading.Thread(target=producer.serve, kwargs={"epochs": None}, daemon=True)
    server.start()
    runs: list[subprocess.Popen[str]] = []
    try:
        # (six at once: the abort came sometimes; two cores start six as fast as three in turn)
        for _ in range(6):
            command = [sys.executable, str(script), name]
            runs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for run in runs:
            _, err = run.communicate(timeout=60)
            assert run.returncode == 0, (run.returncode, err[-2000:])
    finally:
        for run in runs:
            run.kill()
            run.wait()
        producer.close()
        server.join(timeout=10)


def test_a_closed_producer_and_its_dataloader_go_with_their_last_references(name):
    """Nothing keeps a closed producer alive (its I/O thread let go of it): dropped, it and a
    DataLoader with persistent workers go at once, not at some later garbage collection, where
    torch's iterator would wait 5 s for each worker (its queues are closed before it)."""
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from tests.support import serving

    data = DataLoader(list(range(64)), batch_size=8, num_workers=2, persistent_workers=True)
    producer = Producer(data, name=name, slots=2)
    with serving(producer, 1) as (thread, errors):
        with Consumer(name=name, timeout=30) as consumer:
            assert sum(len(batch) for batch in consumer) == 64
        thread.join(30)
    assert errors == [], errors
    workers = [w.pid for w in data._iterator._workers]
    gone = [weakref.ref(producer), weakref.ref(data), weakref.ref(data._iterator)]
    gc.disable()  # (so that only reference counts can free them)
    try:
        del producer, data, thread
        alive = [ref() is not None for ref in gone]
    finally:
        gc.enable()
    assert alive == [False, False, False], alive
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in workers), workers


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
