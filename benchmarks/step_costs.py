"""What each small step of a consumer's per-batch path costs on this machine, in a hot loop
with nothing else running: decoding a BATCH message, a tensor view over shared memory, a
batch's release finalizer, encoding a RELEASE, a message through zmq, and the same message
over a plain kernel socket pair. Why: a batch costs a consumer ~220 us of CPU on the 2-core
VM (``benchmarks.protocol_cost``) and no single change of thread layout or message count
moved it (issue 18); these say where the microseconds are.

    python3 -m benchmarks.step_costs   # -> benchmarks/results/step_costs-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import zmq

from benchmarks.sharing import RESULTS, machine, write
from tensorsocket import protocol


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median of 5 rounds of ``calls`` calls, in microseconds per call."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return round(sorted(rounds)[2], 2)


def whole_batch() -> tuple[Callable[[], object], Callable[[], None]]:
    """What a consumer's I/O thread does for one BATCH, with no socket and no other thread:
    decode it, lease its place (a real read-only shared-memory mapping), build the views of
    a (float32 32x16, int64 32) batch from its numbered layout, hang the release finalizer,
    count its samples; then drop it, so the finalizer queues the release. And a cleanup."""
    from tensorsocket import layout, layout_table
    from tensorsocket.consumer import delivery
    from tensorsocket.consumer.shared import Shared
    from tensorsocket.transport.shm import ShmReader, ShmStore

    plan = layout.plan((torch.rand(32, 16), torch.arange(32)))
    store, reader, shared = ShmStore(), ShmReader(torch.device("cpu"), writable=False), Shared()
    releases = delivery.Releases(shared)
    arena = store.prepare(0, plan.nbytes)
    for descriptor in store.install(arena) if arena is not None else ():
        reader.announce(descriptor)
    store.write(0, plan, False).wait()
    encoded = plan.encode()
    table, key = layout_table.LayoutTable(), layout_table.key(encoded)
    table.number(encoded, key)  # numbered at its second sight, as a producer does
    number, entry = table.number(encoded, key)
    recipes = layout_table.Recipes([entry])
    frame = protocol.encode_batch(1, 0, 0, 0, number, None)

    def one() -> None:
        fields = protocol.decode_batch(frame)
        recipe = recipes.get(fields[4])
        batch, _, _ = delivery.build(fields, recipe, reader, releases, False)
        recipe.count(batch)
        del batch
        shared.released.clear()

    def close() -> None:
        reader.close()
        store.close()

    return one, close


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batch = protocol.encode_batch(123456, 3, 77, 5, 0, None)
    batch_map = protocol.encode(
        protocol.Kind.BATCH, seq=123456, epoch=3, index=77, place=5, layout=0, fingerprint=None
    )
    region = np.frombuffer(bytearray(4096), dtype=np.uint8)

    class Owner:
        pass

    context = zmq.Context()
    sender, receiver = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    address = f"ipc:///tmp/step-costs-{uuid.uuid4().hex[:8]}.sock"
    receiver.bind(address)
    sender.connect(address)
    release = protocol.encode_release([5])

    def send_and_take() -> None:
        sender.send(release)
        receiver.recv()

    # What a message costs without ZeroMQ's I/O thread between the two ends: a kernel socket
    # pair that keeps message boundaries (the shape a leaner control path could take).
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def send_and_take_unix() -> None:
        near.send(release)
        far.recv(65536)

    def weak_reference() -> None:
        owner = Owner()
        watch = weakref.ref(owner, id)
        del owner  # fires: the callback gets the reference
        del watch

    steps = {
        "decode a BATCH message (compact form + checks)": lambda: protocol.decode(
            batch, protocol.MAX_REPLY_BYTES
        ),
        "a float32 (32, 16) tensor over shared memory": lambda: torch.from_numpy(
            region[:2048].view(np.float32).reshape(32, 16)
        ),
        "weakref.finalize on a batch's owner (made and run)": lambda: weakref.finalize(Owner(), int)(),
        "a weak reference with a callback, as a release uses (made and fired)": weak_reference,
        "decode a BATCH message as a msgpack map (+ checks), its form before": lambda: protocol.decode(
            batch_map, protocol.MAX_REPLY_BYTES
        ),
        "encode a RELEASE": lambda: protocol.encode_release([5]),
        "zmq send + recv of a RELEASE, one thread (no wake-up)": send_and_take,
        "the same over a Unix SEQPACKET socket pair (no I/O thread)": send_and_take_unix,
        "time.monotonic()": time.monotonic,
    }
    one_batch, close_batch = whole_batch()
    steps["a whole BATCH into a batch and its release (the I/O thread's work, no socket)"] = one_batch
    costs = {}
    for label, fn in steps.items():
        costs[label] = per_call_us(fn, args.calls)
        print(f"{costs[label]:8.2f} us  {label}", flush=True)
    sender.close(linger=0)
    receiver.close(linger=0)
    near.close()
    far.close()
    close_batch()
    context.term()
    result = {
        "benchmark": "step_costs",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.step_costs", *(argv or sys.argv[1:])],
        "machine": machine(),
        "config": {"calls_per_round": args.calls, "rounds": 5, "statistic": "median round"},
        "us_per_call": costs,
    }
    print(f"wrote {write(result, 'step_costs', folder=args.out or RESULTS)}")


if __name__ == "__main__":
    main()
