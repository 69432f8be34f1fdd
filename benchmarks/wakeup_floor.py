"""The floor a consumer's thread layout sets, with no tensorsocket work at all: CPU per message
of a receiver woken by every message (one sender process, 2,000 messages/s), for the shapes a
consumer can take:

* ``recv``: one thread blocked in ``recv`` (the least any receiver pays per wake-up);
* ``poll``: one thread in ``zmq.Poller.poll`` over the socket and a wake-up pipe, as an I/O loop;
* ``poll+thread``: the poll thread hands each message to another thread through a queue (a
  consumer's I/O thread and the caller's thread);
* ``poll+thread+release``: and the taker pokes the poll thread back once per message (a batch
  released: today's consumer);
* ``zmq-fd-...``: the poll shapes with ``select.poll`` over ZeroMQ's own file descriptor
  (edge-triggered, so ``EVENTS`` is read before each wait) instead of ``zmq.Poller``;
* ``unix-...``: each of these shapes again over a Unix ``SOCK_SEQPACKET`` socket instead of a
  ZeroMQ one (``select.poll`` instead of ``zmq.Poller``): no ZeroMQ I/O thread between sender
  and receiver (what a leaner control path could cost).

Why: on a VM every wake-up costs far more than the work it wakes for (issue 18); this says
what a change of thread layout can win before any code is written.

    python3 -m benchmarks.wakeup_floor   # -> benchmarks/results/wakeup_floor-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import os
import queue
import select
import socket
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq

from benchmarks.sharing import RESULTS, SPAWN, machine, write

SHAPES = ("recv", "poll", "poll+thread", "poll+thread+release")
MODES = SHAPES + tuple(f"zmq-fd-{shape}" for shape in SHAPES[1:]) + tuple(f"unix-{shape}" for shape in SHAPES)


def _send(address: str, count: int, period: float, unix: bool) -> None:
    if unix:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address[len("ipc://") :])
        listener.listen(1)
        listener.settimeout(30)
        sock, _ = listener.accept()
    else:
        sock = zmq.Context().socket(zmq.PUSH)
        sock.bind(address)
        time.sleep(0.5)  # the receiver connects
    frame, due = b"x" * 100, time.perf_counter()
    for _ in range(count + 1):
        while time.perf_counter() < due:
            time.sleep(0)
        sock.send(frame)
        due += period
    sock.send(b"END")
    if unix:
        sock.close()
        listener.close()
        os.unlink(address[len("ipc://") :])
    else:
        sock.close(linger=2000)


class _UnixPuller:
    """The receiving end of a Unix ``SOCK_SEQPACKET`` connection, with the few calls a
    receiver needs (the ZeroMQ socket has them natively): connect, recv, recv without waiting."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        deadline = time.monotonic() + 30
        while True:  # the sender binds meanwhile
            try:
                self.sock.connect(address[len("ipc://") :])
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def recv(self) -> bytes:
        return self.sock.recv(4096)

    def recv_nowait(self) -> bytes | None:
        try:
            return self.sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None


class _ZmqPuller:
    def __init__(self, address: str) -> None:
        self.sock = zmq.Context().socket(zmq.PULL)
        self.sock.connect(address)

    def recv(self) -> bytes:
        return self.sock.recv()

    def recv_nowait(self) -> bytes | None:
        try:
            return self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None


def _receive(address: str, mode: str, out: Any) -> None:
    from tensorsocket.wakeup import Wakeup

    unix, by_fd = mode.startswith("unix-"), mode.startswith("zmq-fd-")
    shape = mode.removeprefix("unix-").removeprefix("zmq-fd-")
    puller = _UnixPuller(address) if unix else _ZmqPuller(address)
    wakeup = Wakeup()
    if unix or by_fd:  # a plain poll(2) over two file descriptors
        poller: Any = select.poll()
        ready = puller.sock.fileno() if unix else puller.sock.getsockopt(zmq.FD)
        poller.register(ready, select.POLLIN)
        poller.register(wakeup.fd, select.POLLIN)
    else:
        poller = zmq.Poller()
        poller.register(puller.sock, zmq.POLLIN)
        poller.register(wakeup.fd, zmq.POLLIN)
        ready = puller.sock
    taken = queue.SimpleQueue()

    def drain() -> bool:
        """Every waiting frame; False at END."""
        while (frame := puller.recv_nowait()) is not None:
            taken.put(frame)
            if frame == b"END":
                return False
        return True

    def poll_loop() -> None:
        going = True
        while going:
            # ZeroMQ's FD is edge-triggered: a frame already queued does not wake poll(2)
            waiting = by_fd and puller.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
            events = dict(poller.poll(0 if waiting else 50))
            if wakeup.fd in events:
                wakeup.drain()
            if ready in events or waiting:
                going = drain()

    puller.recv()  # the first message: start counting after it
    cpu0, count = time.process_time(), 0
    if shape == "recv":
        while puller.recv() != b"END":
            count += 1
    elif shape == "poll":
        poll_loop()
        count = taken.qsize() - 1
    else:
        thread = threading.Thread(target=poll_loop)
        thread.start()
        while taken.get(timeout=30) != b"END":
            count += 1
            if shape == "poll+thread+release":
                wakeup.wake()
        thread.join(30)
    out.put((time.process_time() - cpu0) / count * 1e6)


def measure(mode: str, count: int, period: float) -> float:
    address = f"ipc:///tmp/wakeup-floor-{uuid.uuid4().hex[:8]}.sock"
    out = SPAWN.Queue()
    receiver = SPAWN.Process(target=_receive, args=(address, mode, out))
    sender = SPAWN.Process(target=_send, args=(address, count, period, mode.startswith("unix-")))
    receiver.start()
    sender.start()
    us = out.get(timeout=120)
    for p in (sender, receiver):
        p.join(30)
    return round(us, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=2000.0, help="messages per second")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every mode, round-robin")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            runs[mode].append(measure(mode, args.messages, 1.0 / args.rate))
            print(f"{mode:>20}: {runs[mode][-1]:7.1f} us of receiver CPU per message", flush=True)
    summary = {mode: statistics.median(values) for mode, values in runs.items()}
    result = {
        "benchmark": "wakeup_floor",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.wakeup_floor", *(argv or sys.argv[1:])],
        "machine": machine(),
        "config": {"messages": args.messages, "rate_per_s": args.rate, "frame_bytes": 100},
        "median_us_per_message": summary,
        "runs": runs,
    }
    print(f"medians: {summary}")
    print(f"wrote {write(result, 'wakeup_floor', folder=args.out or RESULTS)}")


if __name__ == "__main__":
    main()
