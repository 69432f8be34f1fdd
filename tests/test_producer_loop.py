"""The producer's I/O thread serves control traffic while the loader is busy."""

from __future__ import annotations

import threading
import time

import zmq

from tensorsocket import Consumer, Producer, protocol
from tensorsocket.endpoint import connect_address
from tensorsocket.protocol import Kind


class _SlowSecondBatch:
    """Yields batch 0 at once, then blocks in the loader for ``hold`` seconds."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.blocked = threading.Event()

    def __iter__(self):
        yield 0
        self.blocked.set()
        time.sleep(self.hold)
        yield 1


def test_status_and_joins_are_served_while_the_loader_blocks(name):
    loader = _SlowSecondBatch(hold=3.0)
    producer = Producer(loader, name=name, slots=2)
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
            start = time.monotonic()
            raw.connect(connect_address(producer.endpoint))
            raw.send(protocol.encode(Kind.STATUS, status=None))
            assert raw.poll(1000), "no STATUS reply while the loader was busy"
            kind, msg = protocol.decode(raw.recv(), protocol.MAX_REPLY_BYTES)
            assert kind is Kind.STATUS and len(msg["status"]["consumers"]) == 1
            with Consumer(name=name, timeout=2) as second:  # the handshake needs the I/O thread
                assert time.monotonic() - start < 1.5  # well before the loader's 3 s are up
                assert [int(b) for b in it] == [1]
                assert [int(b) for b in second] == [0, 1]  # batch 0 still resident: whole epoch
    finally:
        raw.close(0)
        producer.close()
        server.join(timeout=10)
