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
from collections.abc import Callable
from typing import Any

from .. import endpoint as endpoints
from .. import keys
from ..status import ConsumerStatus, ProducerStatus, bottleneck, same_producer, time_shares
from .common import (
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
from .gpu import gpu_usage
from .query import NoProducer, query_status

MIB = 1 << 20


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
    p.add_argument(
        "--json",
        action="store_true",
        help="print the raw status as JSON (with --watch, one line per report: null when no producer answered)",
    )
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)")
    p.set_defaults(run=cmd_status)


# ---------------------------------------------------------------------------- the table


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _number(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(
            v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()
        for cells in [header, *rows]
    ]


def _memory_line(s: ProducerStatus) -> str:
    places, replay, slots, used = s["places"], s["replay_batches"], s["slots"], s["slot_bytes"]
    allocated = min(places, s["published"])  # a place gets memory when first used
    slots_text = f"{places} slots" if places == slots else f"{slots} slots + {places - slots} for stragglers"
    text = f"shared memory {fmt_bytes(used)} in use"
    text += f" (~{fmt_bytes(used / allocated)} a batch): {slots_text}" if allocated else f": {slots_text}"
    budget = fmt_bytes(s["replay_budget_bytes"])
    if replay:
        text += f"; replay: {s['kept_batches']} of up to {replay} batches kept where the loader made them"
        text += f" (budget {budget}), {s['restaged']} written again for joiners"
    else:
        text += f"; no replay (budget {budget})"
    return text + f"; {s['resident_batches']} batches resident"


def _stragglers_line(s: ProducerStatus) -> str:
    if s["stragglers"] == "skip":
        return f"stragglers: skip (a consumer more than {s['max_lag']} batches behind the leader skips ahead)"
    if s["stragglers"] == "stall":
        return "stragglers: stall (the slowest consumer sets the pace; every consumer sees every batch)"
    return "stragglers: unknown"


def _gpu_bytes(c: ConsumerStatus, gpu_by_pid: dict[int, int]) -> float | None:
    """A consumer's GPU memory: the producer's figure (on its GPU, from NVML there) when the
    status has one, else this host's NVML reading by pid (all its GPUs), else None."""
    mib = c.get("gpu_mib")  # .get: a producer of an earlier version does not send it
    return mib * MIB if mib is not None else gpu_by_pid.get(c["pid"])


def _row(c: ConsumerStatus, gpu_by_pid: dict[int, int] | None) -> list[str]:
    """One consumer's cells; with ``gpu_by_pid``, its GPU memory column too."""
    cursor = c["cursor"]
    note = []
    if c.get("group") is not None:  # .get: a producer of an earlier version does not send it
        note.append(f"rank {c['rank']} of {c['group']}")
    if cursor is None:
        note.append("waits for the next epoch")
    if c["catching_up"]:
        note.append("catching up")
    if c["late_join"] != "replay":
        note.append(f"late_join={c['late_join']}")
    row = [
        str(c["label"]),
        str(c["pid"]),
        c["device"] or "-",
        "-" if c["batch_size"] is None else str(c["batch_size"]),
        fmt_duration(c["joined_s_ago"]),
        "-" if cursor is None else str(cursor),
        "-" if cursor is None else str(c["lag"]),
        str(c["held"]),
        str(c["received"]),
        str(c["skipped"]),
        _number(c["samples_per_s"]),
        _percent(c["waiting_share"]),
    ]
    if gpu_by_pid is not None:
        used = _gpu_bytes(c, gpu_by_pid)
        row.append("-" if used is None else fmt_bytes(used))
    return row + [", ".join(note)]


def format_status(
    status: ProducerStatus,
    previous: ProducerStatus | None = None,
    gpu: tuple[list[str], dict[int, int]] | None = None,
) -> str:
    """The status as text. Given the previous snapshot of the same producer, rates and time
    shares are over the time between the two (by the producer's clock); else over its
    uptime. ``gpu`` is :func:`~tensorsocket.cli.gpu.gpu_usage`'s answer (asked here when None)."""
    s = status
    if not same_producer(s, previous):
        previous = None
    shares = time_shares(s, previous)
    since = "since start" if previous is None else f"last {shares['span']:.1f} s"
    published = s["published"]
    done = published - (previous["published"] if previous is not None else 0)
    rate = done / shares["span"] if shares["span"] > 0 else 0.0
    state = "stream ended" if s["ended"] else f"epoch {s['epoch']}"
    per_epoch = s["batches_per_epoch"]
    lines = [
        f"producer {s['endpoint']}  pid {s['pid']}  up {fmt_duration(s['uptime_s'])}  {state}",
        f"  published {published} batches"
        + (f" ({per_epoch} an epoch)" if per_epoch else "")
        + f", {rate:.1f} batches/s ({since})",
        f"  time ({since}): {_percent(shares['loader'])} in next(loader), {_percent(shares['slot'])} "
        f"waiting for a free slot, {_percent(shares['write'])} writing, {_percent(shares['idle'])} other",
        f"  bottleneck: {bottleneck(s, previous)}",
        f"  {_stragglers_line(s)}",
        f"  {_memory_line(s)}",
    ]
    producer_gpu = s.get("gpu_mib")
    if producer_gpu is not None:
        lines.append(f"  GPU memory of the producer on {s['device']}: {fmt_bytes(producer_gpu * MIB)}")
    if s["bad_messages"]:
        lines.append(f"  bad messages received: {s['bad_messages']}")
    if s.get("dropped_replies"):
        lines.append(f"  messages dropped for peers that read nothing: {s['dropped_replies']}")
    gpu_text, gpu_by_pid = gpu if gpu is not None else gpu_usage()
    lines += ["  " + line for line in gpu_text]
    consumers = s["consumers"]
    lines.append("")
    if not consumers:
        lines.append("no consumers connected")
        return "\n".join(lines)
    with_gpu = any(_gpu_bytes(c, gpu_by_pid) is not None for c in consumers)
    header = ["consumer", "pid", "device", "batch", "joined", "cursor", "lag", "held", "received"]
    header += ["skipped", "samples/s", "waiting"] + (["gpu mem"] if with_gpu else []) + ["note"]
    lines += _table(header, [_row(c, gpu_by_pid if with_gpu else None) for c in consumers])
    groups = s.get("groups") or []
    if groups:
        lines.append("")
        header = ["group", "size", "state", "ranks", "shares", "lag", "tail"]
        rows = [
            [
                g["name"],
                str(g["size"]),
                g["state"],
                ",".join(map(str, g["ranks"])) or "-",
                ",".join(map(str, g["received"])) or "-",
                str(g["lag"]),
                g["tail"],
            ]
            for g in groups
        ]
        lines += _table(header, rows)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command


def cmd_status(args: argparse.Namespace) -> int:
    endpoint = resolve(args)
    try:
        endpoints.connect_address(endpoint)
    except ValueError:  # tcp://host:* : a producer binds it, nobody can connect to it
        raise UsageError(
            f"--endpoint {endpoint}: status needs the port the producer picked (serve logs it)"
        ) from None
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.watch is None and args.count is not None:
        args.watch = 1.0
    if args.watch is not None and not (args.watch > 0 and math.isfinite(args.watch)):
        raise UsageError(f"--watch must be > 0 seconds, got {args.watch}")
    label = args.name
    if label is None and args.endpoint is None and not os.environ.get(endpoints.ENV):
        label = endpoints.DEFAULT_NAME

    def missing() -> str:  # (a stopped or stuck producer still holds the name: say so)
        served = f"{label} ({endpoint})" if label else endpoint
        where = keys.client_folder(endpoint)
        keyed = f" that admits the CURVE keys in {where}" if where is not None else ""
        return endpoints.silent_holder(endpoint, args.timeout) or f"no producer{keyed} is serving {served}"

    def once() -> ProducerStatus | None:
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
            print(missing(), file=sys.stderr)
            return EXIT_FAIL
        print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
        return EXIT_OK
    return _watch(args, once, missing)


def _watch(args: argparse.Namespace, once: Any, missing: Callable[[], str]) -> int:
    # SIGINT stops the watch however it was started: a process started in the background by
    # a shell without job control inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler of its own (a CI run once waited 90 s on exactly that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tty = sys.stdout.isatty()
    previous: ProducerStatus | None = None
    reports = 0
    found = False
    try:
        while True:
            started = time.monotonic()
            try:
                status, text = once(), ""
            except RuntimeError as exc:
                status, text = None, f"tensorsocket: error: {exc}"
            found = status is not None
            if status is None:
                previous, text = None, text or missing()
                if args.json:  # every line stays JSON (a producer restarting, say): null
                    print(text, file=sys.stderr, flush=True)
                    text = "null"
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
