"""``tensorsocket status``: ask a producer for its state and print it as a table.

Imports neither torch nor the producer: a status query costs a zmq round trip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from typing import Any

from . import endpoint as endpoints
from .cli_common import (
    EXIT_FAIL,
    EXIT_OK,
    UsageError,
    add_endpoint_options,
    error,
    fmt_bytes,
    fmt_duration,
    positive_int,
    resolve,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show a producer's consumers, rates, bottleneck and memory",
        description="Ask the producer serving a name for its state and print it: one row per "
        "consumer (cursor, lag, rate, share of time waiting for data, skipped and held batches) "
        "and the producer's rate, where its time goes, the bottleneck in plain words, and its "
        "shared memory. With nvidia-ml-py installed, GPU memory and utilisation too.",
    )
    add_endpoint_options(p)
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    p.add_argument(
        "--count",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --watch (implied): stop after N reports; the exit code is then 1 if the last "
        "found no producer",
    )
    p.add_argument("--json", action="store_true", help="print the raw status as JSON (one line per report)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)")
    p.set_defaults(run=cmd_status)


# ---------------------------------------------------------------------------- the query


class NoProducer(Exception):
    pass


def _ipc_listening(path: str) -> bool:
    """False when nothing can be listening on the ipc socket ``path``: no such file, or a
    file left behind that refuses connections. True otherwise (ask to know for sure)."""
    import socket

    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # something else: let the query decide
    finally:
        probe.close()
    return True


def query_status(endpoint: str, timeout: float) -> dict[str, Any]:
    """Send STATUS to the producer at ``endpoint`` and return its status dict.

    Raises NoProducer when nothing answers within ``timeout`` (at once when the ipc socket
    file does not exist)."""
    import zmq

    from . import protocol
    from .errors import ProtocolError
    from .protocol import Kind

    if endpoint.startswith("ipc://") and not _ipc_listening(endpoint[len("ipc://") :]):
        raise NoProducer(endpoint)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_BYTES)
        sock.connect(endpoints.connect_address(endpoint))
        sock.send(protocol.encode(Kind.STATUS, status=None))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise NoProducer(endpoint)
            try:
                kind, msg = protocol.decode(sock.recv(), protocol.MAX_REPLY_BYTES)
            except ProtocolError as exc:
                raise RuntimeError(f"the producer at {endpoint} sent a malformed reply: {exc}") from None
            if kind is Kind.STATUS and isinstance(msg["status"], dict):
                return msg["status"]
            if kind in (Kind.ERROR, Kind.EVICTED):
                raise RuntimeError(f"the producer at {endpoint} refused the query: {msg['reason']}")
            # anything else (a heartbeat) is not for us: keep waiting
    finally:
        sock.close(0)


# ---------------------------------------------------------------------------- GPUs


def gpu_usage() -> tuple[list[str], dict[int, int]]:
    """Per GPU a line of memory and utilisation, and the GPU memory of each process by pid,
    through nvidia-ml-py; nothing without it or without a GPU."""
    try:
        import pynvml
    except Exception:
        return [], {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return [], {}
    lines: list[str] = []
    by_pid: dict[int, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            lines.append(
                f"gpu {i} {name}: memory {fmt_bytes(mem.used)} / {fmt_bytes(mem.total)}, "
                f"utilisation {util.gpu}%"
            )
            try:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    if isinstance(used, int):  # None where the driver does not tell
                        by_pid[proc.pid] = by_pid.get(proc.pid, 0) + used
            except Exception:
                pass
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return lines, by_pid


def gpu_lines() -> list[str]:
    """GPU memory and utilisation through nvidia-ml-py; [] without it or without a GPU."""
    return gpu_usage()[0]


# ---------------------------------------------------------------------------- analysis


def _same_producer(status: dict[str, Any], previous: dict[str, Any] | None) -> bool:
    return (
        previous is not None
        and previous.get("pid") == status.get("pid")
        and previous.get("published", 0) <= status.get("published", 0)
        and previous.get("uptime_s", 0.0) < status.get("uptime_s", 0.0)
    )


def time_shares(status: dict[str, Any], previous: dict[str, Any] | None = None) -> dict[str, float]:
    """Where the producer's time went, as shares of its uptime (or, given the previous
    snapshot of the same producer, of the time since): ``loader`` (in next(loader)),
    ``slot`` (waiting for the slowest consumer to free a slot), ``write`` (writing and
    announcing batches) and ``idle`` (the rest: waiting for consumers to join, or a wait
    still in progress, which is counted once it ends). Plus ``span``, the seconds covered."""
    keys = ("loader_wait", "slot_wait", "publish_time", "uptime_s")
    now = {k: float(status.get(k) or 0.0) for k in keys}
    if _same_producer(status, previous):
        assert previous is not None
        now = {k: now[k] - float(previous.get(k) or 0.0) for k in keys}
    span = now["uptime_s"]
    if span <= 0:
        return {"span": 0.0, "loader": 0.0, "slot": 0.0, "write": 0.0, "idle": 0.0}
    loader = now["loader_wait"] / span
    slot = now["slot_wait"] / span
    write = max(0.0, now["publish_time"] - now["slot_wait"]) / span
    return {
        "span": span,
        "loader": loader,
        "slot": slot,
        "write": write,
        "idle": max(0.0, 1.0 - loader - slot - write),
    }


def _rate(consumer: dict[str, Any]) -> float:
    for key in ("samples_per_s", "batches_per_s"):
        value = consumer.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return math.inf


def behind(consumer: dict[str, Any]) -> int:
    """Published batches a consumer has not released: not yet sent (its lag) plus held. The
    producer may overwrite none of them, so the one furthest behind holds it back."""
    return int(consumer.get("lag") or 0) + int(consumer.get("held") or 0)


def slowest(status: dict[str, Any]) -> dict[str, Any] | None:
    """The consumer holding the producer back: the furthest behind, then the one that
    waits least for data (it is busy, the others wait for it), then the lowest rate. One
    that has not reported its rates yet is not blamed on a tie."""
    consumers = status.get("consumers") or []
    if not consumers:
        return None

    def waiting(c: dict[str, Any]) -> float:
        share = c.get("waiting_share")
        return float(share) if isinstance(share, (int, float)) else 1.0

    return min(consumers, key=lambda c: (-behind(c), waiting(c), _rate(c)))


def bottleneck(status: dict[str, Any], previous: dict[str, Any] | None = None) -> str:
    """The bottleneck in plain words, from where the producer's time went (since the
    previous snapshot when given, else since it started)."""
    if not _same_producer(status, previous):
        previous = None
    if status.get("ended"):
        return "none: the stream has ended"
    if not status.get("published"):
        return "none yet: nothing published (waiting for consumers to join, or for the first batch)"
    consumers = status.get("consumers") or []
    if not consumers:
        return "none: no consumer is connected (the producer waits for one)"
    late = slowest(status)
    assert late is not None
    who = f"the slowest consumer ({late.get('label')})"
    shares = time_shares(status, previous)
    progressed = previous is None or status.get("published", 0) > previous.get("published", 0)
    if not progressed:
        # Nothing published since the last look: the producer is inside a wait that is
        # counted only when it ends. A full window means it waits for a free slot.
        if behind(late) >= status.get("slots", math.inf) or late.get("catching_up"):
            return f"{who}: no batch published for {shares['span']:.1f} s, the window is full"
        return f"the loader: no batch published for {shares['span']:.1f} s"
    parts = {"loader": shares["loader"], "slot": shares["slot"], "write": shares["write"]}
    top = max(parts, key=lambda k: parts[k])
    if top == "slot":
        return who
    if top == "write":
        return "the producer itself (writing batches into shared memory)"
    return "the loader"


# ---------------------------------------------------------------------------- the table


def _percent(share: Any) -> str:
    return "-" if not isinstance(share, (int, float)) else f"{100 * share:.0f}%"


def _number(value: Any, spec: str = ".1f") -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, spec)


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(
            v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()
        for cells in [header, *rows]
    ]


def _memory_line(s: dict[str, Any]) -> str:
    places = int(s.get("places") or s.get("slots") or 0)
    replay = int(s.get("replay_places") or 0)
    window = places - replay
    used = int(s.get("slot_bytes") or 0)
    allocated = min(places, int(s.get("published") or 0))  # a place gets memory when first used
    slots = int(s.get("slots") or window)
    slots_text = f"{window} slots" if window == slots else f"{slots} slots + {window - slots} for stragglers"
    text = f"shared memory {fmt_bytes(used)} in use"
    if allocated:
        each = used / allocated
        text += f" (~{fmt_bytes(each)} a batch): {slots_text} ~{fmt_bytes(each * window)}"
        text += f", {replay} replay places ~{fmt_bytes(each * replay)}" if replay else ", no replay places"
    else:
        text += f": {slots_text}" + (f", {replay} replay places" if replay else "")
    if s.get("replay_budget_bytes") is not None:
        text += f" (replay budget {fmt_bytes(s['replay_budget_bytes'])})"
    if s.get("resident_batches") is not None:
        text += f"; {s['resident_batches']} batches resident"
    return text


def _stragglers_line(s: dict[str, Any]) -> str:
    if s.get("stragglers") == "skip":
        return f"stragglers: skip (a consumer more than {s.get('max_lag')} batches behind the leader skips ahead)"
    if s.get("stragglers") == "stall":
        return "stragglers: stall (the slowest consumer sets the pace; every consumer sees every batch)"
    return "stragglers: unknown"


def format_status(
    status: dict[str, Any],
    previous: dict[str, Any] | None = None,
    gpu: tuple[list[str], dict[int, int]] | None = None,
) -> str:
    """The status as text. Given the previous snapshot of the same producer, rates and time
    shares are over the time between the two (by the producer's clock); else over its
    uptime. ``gpu`` is :func:`gpu_usage`'s answer (asked here when None)."""
    s = status
    if not _same_producer(s, previous):
        previous = None
    shares = time_shares(s, previous)
    since = "since start" if previous is None else f"last {shares['span']:.1f} s"
    published = int(s.get("published") or 0)
    done = published - (int(previous.get("published") or 0) if previous else 0)
    rate = done / shares["span"] if shares["span"] > 0 else 0.0
    state = "stream ended" if s.get("ended") else f"epoch {s.get('epoch', 0)}"
    up = f"  up {fmt_duration(s['uptime_s'])}" if "uptime_s" in s else ""
    per_epoch = s.get("batches_per_epoch")
    lines = [
        f"producer {s.get('endpoint')}  pid {s.get('pid')}{up}  {state}",
        f"  published {published} batches"
        + (f" ({per_epoch} an epoch)" if per_epoch else "")
        + f", {rate:.1f} batches/s ({since})",
        f"  time ({since}): {_percent(shares['loader'])} in next(loader), {_percent(shares['slot'])} "
        f"waiting for a free slot, {_percent(shares['write'])} writing, {_percent(shares['idle'])} other",
        f"  bottleneck: {bottleneck(s, previous)}",
        f"  {_stragglers_line(s)}",
        f"  {_memory_line(s)}",
    ]
    if s.get("bad_messages"):
        lines.append(f"  bad messages received: {s['bad_messages']}")
    gpu_text, gpu_by_pid = gpu if gpu is not None else gpu_usage()
    lines += ["  " + line for line in gpu_text]
    consumers = s.get("consumers") or []
    lines.append("")
    if not consumers:
        lines.append("no consumers connected")
        return "\n".join(lines)
    with_gpu = any(c.get("pid") in gpu_by_pid for c in consumers)
    header = ["consumer", "pid", "device", "batch", "joined", "cursor", "lag", "held", "received"]
    header += ["skipped", "samples/s", "waiting"] + (["gpu mem"] if with_gpu else []) + ["note"]
    rows = []
    for c in consumers:
        cursor = c.get("cursor")
        note = []
        if cursor is None:
            note.append("waits for the next epoch")
        if c.get("catching_up"):
            note.append("catching up")
        if c.get("late_join") not in (None, "replay"):
            note.append(f"late_join={c['late_join']}")
        row = [
            str(c.get("label")),
            str(c.get("pid")),
            str(c.get("device") or "-"),
            "-" if c.get("batch_size") is None else str(c["batch_size"]),
            fmt_duration(c.get("joined_s_ago", 0.0)),
            "-" if cursor is None else str(cursor),
            "-" if cursor is None else str(c.get("lag", "-")),
            str(c.get("held", 0)),
            str(c.get("received", 0)),
            str(c.get("skipped", 0)),
            _number(c.get("samples_per_s")),
            _percent(c.get("waiting_share")),
        ]
        if with_gpu:
            used = gpu_by_pid.get(c.get("pid"))  # type: ignore[arg-type]
            row.append("-" if used is None else fmt_bytes(used))
        row.append(", ".join(note))
        rows.append(row)
    lines += _table(header, rows)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command


def cmd_status(args: argparse.Namespace) -> int:
    endpoint = resolve(args)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.watch is None and args.count is not None:
        args.watch = 1.0
    if args.watch is not None and not (args.watch > 0 and math.isfinite(args.watch)):
        raise UsageError(f"--watch must be > 0 seconds, got {args.watch}")
    label = args.name
    if label is None and args.endpoint is None and not os.environ.get(endpoints.ENV):
        label = endpoints.DEFAULT_NAME
    missing = (
        f"no producer is serving {label} ({endpoint})" if label else f"no producer is serving {endpoint}"
    )

    def once() -> dict[str, Any] | None:
        try:
            return query_status(endpoint, args.timeout)
        except NoProducer:
            return None

    if args.watch is None:
        try:
            status = once()
        except RuntimeError as exc:
            error(str(exc))
            return EXIT_FAIL
        if status is None:
            print(missing, file=sys.stderr)
            return EXIT_FAIL
        print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
        return EXIT_OK
    return _watch(args, once, missing)


def _watch(args: argparse.Namespace, once: Any, missing: str) -> int:
    # SIGINT stops the watch however it was started: a process started in the background by
    # a shell without job control inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler of its own (a CI run once waited 90 s on exactly that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tty = sys.stdout.isatty()
    previous: dict[str, Any] | None = None
    reports = 0
    found = False
    try:
        while True:
            started = time.monotonic()
            try:
                status, text = once(), missing
            except RuntimeError as exc:
                status, text = None, f"tensorsocket: error: {exc}"
            found = status is not None
            if status is None:
                previous = None
            elif args.json:
                text = json.dumps(status)
            else:
                text = format_status(status, previous)
                previous = status
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")
                text = f"{time.strftime('%H:%M:%S')}  every {args.watch:g} s, Ctrl-C to stop\n\n" + text
            elif not args.json:
                text = f"--- {time.strftime('%H:%M:%S')}\n{text}"
            print(text, flush=True)
            reports += 1
            if args.count is not None and reports >= args.count:
                return EXIT_OK if found else EXIT_FAIL
            time.sleep(max(0.0, args.watch - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return EXIT_OK
