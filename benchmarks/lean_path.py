"""What a batch would cost over a leaner control path, measured next to tensorsocket as it is,
in one run: the question issue 18 left open (is 60 us of consumer CPU per batch reachable in
Python, or must the goal change?).

The prototype keeps every per-batch step of tensorsocket's own code and changes only the
wire and the threads:

* the producer plans each batch (``layout.plan``), writes it into a real shared-memory place
  (``ShmStore``), numbers its layout (``LayoutTable``), asks the real ``Flow`` for a place and
  whom to send it to, and encodes BATCH with ``protocol``;
* each consumer decodes it (``protocol.decode``, with its checks), leases the region from a
  real ``ShmReader`` (read-only mapping), builds the views with the layout's ``Recipe``, and
  hangs a release finalizer on the lease that sends RELEASE when the batch is dropped;
* but messages go over one Unix ``SOCK_SEQPACKET`` connection per consumer (the kernel keeps
  message boundaries; no ZeroMQ I/O thread on either side), and each side runs one thread:
  the consumer blocks in ``recv`` itself, the producer reads releases only when it needs a
  place. What it leaves out, so its figures are a floor for that design, not a product:
  heartbeats, liveness checks, STATS, sequence checks, and a loader running in another
  thread than the producer's socket.

Same batches as ``benchmarks.protocol_cost`` (32x16 float32 + 32 int64 labels, slots=8,
replay=0), each consumer dropping every batch at once; each consumer checks one batch in 64
against what the producer's loader made.

    python3 -m benchmarks.lean_path [--batches 5000] [--consumers 1,4] [--repeat 3]
    # -> benchmarks/results/lean_path-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import select
import socket
import sys
import tempfile
import threading
import time
import uuid
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import protocol_cost
from benchmarks.sharing import RESULTS, SPAWN, machine, start_and_collect, write

VARIANTS = ("tensorsocket", "lean", "lean+threads")
_ACCEPT_TIMEOUT = 60.0
_WAIT_MS = 5000  # a producer waiting for releases longer than this: a consumer is gone


def _lean_produce(path: str, batches: int, consumers: int, threads: bool, out: Any) -> None:
    """``threads``: an I/O thread owns the sockets, takes releases as they come and sends
    what the caller's thread queued, waking it when a place frees (tensorsocket's producer
    layout); otherwise this thread sends, and reads releases only when it needs a place."""
    from tensorsocket import layout, layout_table, protocol
    from tensorsocket.flow import Deliver, Flow
    from tensorsocket.protocol import Kind
    from tensorsocket.transport.shm import ShmStore
    from tensorsocket.wakeup import Wakeup

    torch.set_num_threads(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(consumers)
    listener.settimeout(_ACCEPT_TIMEOUT)
    socks = [listener.accept()[0] for _ in range(consumers)]
    listener.close()
    os.unlink(path)
    by_fd = {s.fileno(): cid for cid, s in enumerate(socks)}
    wakeup, changed, outbox = Wakeup(), threading.Condition(), collections.deque()
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    poller.register(wakeup.fd, select.POLLIN)
    flow, store, layouts = Flow(window=8, places=8), ShmStore(), layout_table.LayoutTable()
    for cid in range(consumers):
        flow.join(cid, prefetch=8)

    def send(actions: list[Any]) -> None:
        """Send what the flow decided (threads: queue it for the I/O thread; lock held)."""
        for action in actions:
            assert isinstance(action, Deliver)
            outbox.append((action.consumer, action.entry.payload))
        if not threads:
            flush()

    def flush() -> None:
        while outbox:
            cid, frame = outbox.popleft()
            socks[cid].send(frame)

    def take_releases(wait_ms: int) -> None:
        ready = poller.poll(wait_ms)
        if not ready and not threads:
            raise TimeoutError(f"no release for {_WAIT_MS} ms: a consumer is gone")
        for fd, _ in ready:
            if fd == wakeup.fd:
                wakeup.drain()
                continue
            while fd in by_fd:
                try:
                    frame = socks[by_fd[fd]].recv(protocol.MAX_REQUEST_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if not frame:  # the consumer closed its end (after END)
                    poller.unregister(fd)
                    del by_fd[fd]
                    break
                kind, msg = protocol.decode(frame)
                assert kind is Kind.RELEASE, kind
                with changed:
                    send(flow.release(by_fd[fd], msg["seqs"]))
                    changed.notify()

    done = threading.Event()

    def serve() -> None:  # the I/O thread
        while by_fd:
            take_releases(50)
            with changed:
                flush()
            if done.is_set() and not outbox and not by_fd:
                break

    io = threading.Thread(target=serve, daemon=True)
    if threads:
        io.start()

    def publish(index: int, batch: Any) -> None:
        plan = layout.plan(batch)
        encoded = plan.encode()
        key = layout_table.key(encoded)
        with changed:
            while (place := flow.reserve()) is None:
                if threads:
                    if not changed.wait(_WAIT_MS / 1000):
                        raise TimeoutError(f"no release for {_WAIT_MS} ms: a consumer is gone")
                else:
                    take_releases(_WAIT_MS)
        arena = store.prepare(place, plan.nbytes)
        with changed:
            if arena is not None:
                for descriptor in store.install(arena):
                    outbox.extend(
                        (cid, protocol.encode(Kind.ARENA, arena=descriptor)) for cid in range(consumers)
                    )
        store.write(place, plan, False).wait()
        with changed:
            ref, new = layouts.number(encoded, key)
            if new is not None:
                frame = protocol.encode(Kind.LAYOUT, number=new[0], layout=new[1])
                outbox.extend((cid, frame) for cid in range(consumers))
            frame = protocol.encode_batch(flow.next_seq, flow.epoch, index, place, ref, None)
            send(flow.publish(place, frame))
        if threads:
            wakeup.wake()

    loader = protocol_cost.Tiny(batches)
    cpu0 = wall0 = 0.0
    try:
        for index, batch in enumerate(loader):
            if index == 1:  # from the first batch on, as protocol_cost counts
                cpu0, wall0 = time.process_time(), time.perf_counter()
            publish(index, batch)
        with changed:
            send(flow.end_stream(protocol.encode(Kind.END, seq=flow.next_seq, epoch=flow.epoch, reason=None)))
        wakeup.wake()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        done.set()
        if threads:
            io.join(timeout=_WAIT_MS / 1000)
        while by_fd:  # each consumer releases all it took, then closes: then the places go
            take_releases(_WAIT_MS)
    finally:
        for s in socks:
            s.close()
        store.close()
    out.put({"role": "producer", "cpu_s": cpu, "wall_s": wall})


def _lean_consume(path: str, threads: bool, out: Any) -> None:
    """``threads``: an I/O thread owns the socket and hands each batch to this thread through
    a queue, and a dropped batch's finalizer wakes it to send the RELEASE (tensorsocket's
    consumer layout); otherwise this thread blocks in ``recv`` and the finalizer sends."""
    from tensorsocket import protocol
    from tensorsocket.layout_table import Recipes
    from tensorsocket.protocol import Kind
    from tensorsocket.transport.shm import ShmReader
    from tensorsocket.wakeup import Wakeup

    torch.set_num_threads(1)
    made = protocol_cost.Tiny(4).made
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + _ACCEPT_TIMEOUT
    while True:  # the producer binds meanwhile
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    reader, recipes = ShmReader(torch.device("cpu")), Recipes()
    wakeup, released, handed = Wakeup(), collections.deque(), queue.SimpleQueue()

    def release(seq: int) -> None:
        if threads:
            released.append(seq)
            wakeup.wake()
        else:
            sock.send(protocol.encode_release([seq]))

    def handle(frame: bytes) -> tuple[Any, dict[str, Any]] | None:
        """A BATCH's (batch, message), END's (None, message); None for anything else."""
        kind, msg = protocol.decode(frame, protocol.MAX_REPLY_BYTES)
        if kind is Kind.BATCH:
            recipe = recipes.get(msg["layout"])
            lease = reader.lease(msg["place"], recipe.nbytes)
            weakref.finalize(lease.owner, release, msg["seq"]).atexit = False
            return reader.deliver(recipe.build(lease.region), copy=False), msg
        if kind is Kind.ARENA:
            reader.announce(msg["arena"])
        elif kind is Kind.LAYOUT:
            recipes.define(msg["number"], msg["layout"])
        elif kind is Kind.END:
            return None, msg
        return None

    def serve() -> None:  # the I/O thread
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(wakeup.fd, select.POLLIN)
        going = True
        while going:
            events = dict(poller.poll(50))
            if wakeup.fd in events:
                wakeup.drain()
            while going and sock.fileno() in events:
                try:
                    item = handle(sock.recv(protocol.MAX_REPLY_BYTES, socket.MSG_DONTWAIT))
                except BlockingIOError:
                    break
                if item is not None:
                    handed.put(item)
                    going = item[0] is not None
            seqs = [released.popleft() for _ in range(len(released))]
            if seqs:
                sock.send(protocol.encode_release(seqs))

    def next_item() -> tuple[Any, dict[str, Any]]:
        if threads:
            return handed.get(timeout=_WAIT_MS / 1000)
        while (item := handle(sock.recv(protocol.MAX_REPLY_BYTES))) is None:
            pass
        return item

    io = threading.Thread(target=serve, daemon=True)
    if threads:
        io.start()
    taken, wrong, cpu0 = 0, 0, 0.0
    while True:
        batch, msg = next_item()
        if batch is None:  # END
            break
        if taken == 0:
            cpu0 = time.process_time()
        if msg["index"] % 64 == 0:
            expected = made[msg["index"] % 4]
            wrong += not (torch.equal(batch[0], expected[0]) and torch.equal(batch[1], expected[1]))
        taken += 1
        del batch  # the finalizer releases it now
    cpu = time.process_time() - cpu0
    io.join(timeout=5) if threads else None
    sock.close()
    reader.close()
    out.put({"role": "consumer", "cpu_s": cpu, "taken": taken, "wrong": wrong})


def run_lean(variant: str, consumers: int, batches: int, timeout: float) -> dict[str, Any]:
    path = os.path.join(tempfile.gettempdir(), f"lean-{uuid.uuid4().hex[:8]}.sock")
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_lean_consume, args=(path, variant == "lean+threads", out))
        for _ in range(consumers)
    ]
    procs.append(
        SPAWN.Process(target=_lean_produce, args=(path, batches, consumers, variant == "lean+threads", out))
    )
    reports = start_and_collect(procs, out, len(procs), timeout)
    producer = next(r for r in reports if r["role"] == "producer")
    taken = [r for r in reports if r["role"] == "consumer"]
    n = batches - 1
    return {
        "variant": variant,
        "consumers": consumers,
        "producer_cpu_us_per_batch": round(producer["cpu_s"] / n * 1e6, 1),
        "consumer_cpu_us_per_batch": [round(r["cpu_s"] / n * 1e6, 1) for r in taken],
        "batches_per_s": round(n / producer["wall_s"], 1),
        "every_batch": all(r["taken"] == batches for r in taken),
        "wrong_batches": sum(r["wrong"] for r in taken),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--consumers", default="1,4", help="consumer counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (variant, count), round-robin")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.consumers.split(",")]
    runs = []
    for rep in range(args.repeat):
        for consumers in counts:
            for variant in VARIANTS:
                if variant != "tensorsocket":
                    r = run_lean(variant, consumers, args.batches, args.timeout)
                else:
                    r = protocol_cost.run_once("read-only", consumers, args.batches, args.timeout)
                    r["variant"] = variant
                runs.append(r | {"run": rep + 1})
                print(protocol_cost.line(r), flush=True)
    summary = []
    for consumers in counts:
        row: dict[str, Any] = {"consumers": consumers, **protocol_cost.medians(runs, consumers, VARIANTS)}
        for variant in VARIANTS[1:]:
            row[f"{variant}_over_tensorsocket"] = ratios = protocol_cost.ratios(
                row[variant], row["tensorsocket"]
            )
            print(f"x{consumers}: {variant} / tensorsocket: {ratios}")
        summary.append(row)
    result = {
        "benchmark": "lean_path",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.lean_path", *(argv or sys.argv[1:])],
        "machine": machine(),
        "config": {"batches": args.batches, "batch": "(float32 32x16, int64 32)", "slots": 8, "replay": 0},
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write(result, 'lean_path', folder=args.out or RESULTS)}")


if __name__ == "__main__":
    main()
