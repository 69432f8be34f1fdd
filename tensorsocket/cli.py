"""The ``tensorsocket`` command (also ``python -m tensorsocket``).

    tensorsocket serve PIPELINE [--name N | --endpoint E] [--slots 8] [--epochs N] ...
    tensorsocket status [--name N | --endpoint E] [--watch [SECONDS]] [--json]
    tensorsocket sweep ...            (see tensorsocket sweep --help)
    tensorsocket demo [--trainers 3] [--images 1024] [--epochs 2]

Exit codes: 0 success (a graceful stop of ``serve`` included), 1 a runtime failure (nothing
serves the name, the name is already served, the loader failed mid-stream), 2 a usage error
(bad arguments, a PIPELINE that cannot be loaded or whose function raises).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import endpoint as endpoints
from .pipeline import PipelineError
from .pipeline import call as call_pipeline
from .pipeline import describe as _describe
from .pipeline import keyvalue as _keyvalue
from .pipeline import load as load_pipeline

log = logging.getLogger("tensorsocket")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

try:  # provided by tensorsocket/sweep.py: add_arguments(parser) and run(args) -> int
    from . import sweep as _sweep_cmd
except Exception as exc:  # not there (yet), one of its imports is missing, or it is broken
    _sweep_cmd = None
    _sweep_missing = f"{type(exc).__name__}: {exc}"


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one message, exit code 2."""


# ---------------------------------------------------------------------------- helpers


def _error(message: str) -> None:
    print(f"tensorsocket: error: {message}", file=sys.stderr)


def _bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--name",
        help="producer name (an ipc socket in the per-user runtime directory); "
        f"default: ${endpoints.ENV}, then '{endpoints.DEFAULT_NAME}'",
    )
    group.add_argument("--endpoint", help="an explicit endpoint: ipc:///path or tcp://127.0.0.1:5555")


def _resolve(args: argparse.Namespace) -> str:
    try:
        return endpoints.resolve(args.name, args.endpoint)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ---------------------------------------------------------------------------- serve


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a data pipeline to consumers (runs in the foreground)",
        description="Serve the batches of PIPELINE to every consumer that connects. Runs in the "
        "foreground; Ctrl-C or SIGTERM ends the stream cleanly (consumers see a normal end) and "
        "frees the shared memory.",
        epilog="examples:\n  tensorsocket serve producer.synthetic:make_loader --name demo --arg batches=50\n"
        "  tensorsocket serve ./pipeline.py:make_loader --epochs 3 --arg root=data/jpeg-1024",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "pipeline",
        metavar="PIPELINE",
        help="module:function or path/to/file.py:function; called with the --arg values, returns the loader",
    )
    _add_endpoint_options(p)
    p.add_argument("--slots", type=int, default=8, help="batches held in shared memory at once (default 8)")
    p.add_argument("--epochs", type=int, default=None, help="epochs to serve (default: until stopped)")
    p.add_argument(
        "--min-consumers",
        type=int,
        default=1,
        help="consumers to wait for before the first batch (default 1)",
    )
    p.add_argument("--device", default="cpu", help="where batches are shared (this version: cpu)")
    p.add_argument(
        "--linger",
        type=float,
        default=10.0,
        help="seconds to wait for consumers to take the end of the stream when stopping (default 10)",
    )
    p.add_argument(
        "--arg",
        dest="args",
        action="append",
        type=_keyvalue,
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the pipeline function (repeatable; numbers become int/float)",
    )
    p.add_argument(
        "--progress",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="log a progress line this often (default 60; 0: never)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default INFO",
    )
    p.set_defaults(run=cmd_serve)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _progress(producer: Any, every: float, stop: threading.Event) -> None:
    """Log a line every ``every`` seconds while something changes."""
    last, t_last, seen = 0, time.monotonic(), 0
    while not stop.wait(every):
        try:
            s = producer.status()
        except Exception:
            return
        now = time.monotonic()
        rate = (s["published"] - last) / (now - t_last)
        if s["published"] == last and len(s["consumers"]) == seen:
            continue
        last, t_last, seen = s["published"], now, len(s["consumers"])
        log.info(
            "epoch %d, %d batches published (%.1f/s), %d consumer(s)",
            s["epoch"],
            s["published"],
            rate,
            len(s["consumers"]),
        )


def cmd_serve(args: argparse.Namespace) -> int:
    _configure_logging(args.log_level)
    if args.slots < 1:
        raise UsageError(f"--slots must be >= 1, got {args.slots}")
    if args.epochs is not None and args.epochs < 0:
        raise UsageError(f"--epochs must be >= 0, got {args.epochs}")
    if args.min_consumers < 1:
        raise UsageError(f"--min-consumers must be >= 1, got {args.min_consumers}")
    if not (args.linger >= 0 and math.isfinite(args.linger)):
        raise UsageError(f"--linger must be a number of seconds >= 0, got {args.linger}")
    endpoint = _resolve(args)

    from .producer import Producer

    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stopping.is_set():
            log.warning("already stopping; waiting up to %g s for consumers to take the end", args.linger)
            return
        stopping.set()
        log.info("%s: ending the stream", signal.Signals(signum).name)
        raise KeyboardInterrupt

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    producer = None
    done = threading.Event()
    progress: threading.Thread | None = None
    try:
        function = load_pipeline(args.pipeline)
        # Refuse a served name before calling a possibly slow pipeline function (the Producer
        # takes the lock for real below and refuses too if someone took it in between).
        held = endpoints.lock(endpoint)
        if held is not None:
            held.close()
        loader = call_pipeline(function, args.pipeline, dict(args.args))
        try:
            producer = Producer(
                loader,
                endpoint=endpoint,
                device=args.device,
                slots=args.slots,
                min_consumers=args.min_consumers,
                linger=args.linger,
            )
        except (TypeError, ValueError) as exc:
            raise UsageError(f"pipeline {args.pipeline} returned {type(loader).__name__}: {exc}") from None
        if args.progress > 0:
            progress = threading.Thread(
                target=_progress,
                args=(producer, args.progress, done),
                name="tensorsocket-progress",
                daemon=True,
            )
            progress.start()
        epochs = "until stopped" if args.epochs is None else f"for {args.epochs} epoch(s)"
        log.info(
            "serving %s on %s (pid %d) %s; waiting for %d consumer(s); stop with Ctrl-C or SIGTERM",
            args.pipeline,
            producer.endpoint,
            os.getpid(),
            epochs,
            args.min_consumers,
        )
        try:
            producer.serve(epochs=args.epochs)
        except Exception as exc:
            log.error("serving stopped on an error: %s", _describe(exc))
            log.debug("traceback", exc_info=True)
            return EXIT_FAIL
        log.info("served %d epoch(s); every consumer finished", args.epochs)
        return EXIT_OK
    except KeyboardInterrupt:  # serve() has ended the stream cleanly, or nothing was served yet
        if producer is None:
            log.info("interrupted before serving")
            return 130
        log.info("stopped")
        return EXIT_OK
    finally:
        stopping.set()  # from here a signal is only logged: the cleanup below must run whole
        done.set()
        if progress is not None:
            # Joined: a thread still running at interpreter exit that drops the last reference
            # to the producer (its loader, its tensors) aborts the process.
            progress.join()
        if producer is not None:
            producer.close()  # idempotent; covers an interrupt before serve() began
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------- status


def _add_status(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show a producer's consumers, rates and memory",
        description="Ask the producer serving a name for its state and print it.",
    )
    _add_endpoint_options(p)
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)")
    p.set_defaults(run=cmd_status)


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


def gpu_lines() -> list[str]:
    """GPU memory and utilisation through nvidia-ml-py; [] without it or without a GPU."""
    try:
        import pynvml
    except Exception:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    lines = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            lines.append(
                f"gpu {i} {name}: memory {_bytes(mem.used)} / {_bytes(mem.total)}, utilisation {util.gpu}%"
            )
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return lines


def bottleneck(status: dict[str, Any]) -> str:
    wait, publish = status.get("loader_wait", 0.0), status.get("publish_time", 0.0)
    if not status.get("published"):
        return "no batches yet"
    if wait > publish:
        return "the loader (consumers wait for batches)"
    return "the consumers (the loader waits for free slots)"


def format_status(
    status: dict[str, Any], previous: dict[str, Any] | None = None, interval: float | None = None
) -> str:
    """The status as a table. With the previous snapshot and the time between them, rates."""
    s = status
    rate = ""
    if previous is not None and interval:
        rate = f" ({(s['published'] - previous['published']) / interval:.1f} batches/s)"
    state = "ended" if s.get("ended") else f"epoch {s['epoch']}"
    wait, publish = s.get("loader_wait", 0.0), s.get("publish_time", 0.0)
    lines = [
        f"producer {s['endpoint']}  pid {s['pid']}  {state}  published {s['published']}{rate}",
        f"  slots {s['slots']} using {_bytes(s.get('slot_bytes', 0))} of shared memory",
        f"  loader wait {wait:.3f} s vs publish {publish:.3f} s: bottleneck is {bottleneck(s)}",
    ]
    if s.get("bad_messages"):
        lines.append(f"  bad messages received: {s['bad_messages']}")
    lines += ["  " + line for line in gpu_lines()]
    consumers = s.get("consumers", [])
    lines.append("")
    if not consumers:
        lines.append("no consumers connected")
        return "\n".join(lines)
    before = {(c["pid"], c["label"]): c for c in (previous or {}).get("consumers", [])}
    header = ["label", "pid", "joined", "cursor", "lag", "held", "received"] + (
        ["batches/s"] if interval else []
    )
    rows = []
    for c in consumers:
        cursor = c.get("cursor")
        row = [
            str(c["label"]),
            str(c["pid"]),
            _duration(c.get("joined_s_ago", 0.0)) + " ago",
            "-" if cursor is None else str(cursor),
            "-" if cursor is None else str(max(0, s.get("next_seq", cursor) - cursor)),
            str(c.get("held", 0)),
            str(c.get("received", 0)),
        ]
        if interval:
            old = before.get((c["pid"], c["label"]))
            row.append("-" if old is None else f"{(c['received'] - old['received']) / interval:.1f}")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for cells in [header, *rows]:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(cells, widths, strict=True))
            )
        )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    endpoint = _resolve(args)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
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
            _error(str(exc))
            return EXIT_FAIL
        if status is None:
            print(missing, file=sys.stderr)
            return EXIT_FAIL
        print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
        return EXIT_OK

    tty = sys.stdout.isatty()
    previous: dict[str, Any] | None = None
    t_prev = 0.0
    try:
        while True:
            started = time.monotonic()
            try:
                status, text = once(), missing
            except RuntimeError as exc:
                status, text = None, f"tensorsocket: error: {exc}"
            if status is None:
                previous = None
            elif args.json:
                text = json.dumps(status)
            else:
                interval = started - t_prev if previous is not None else None
                text = format_status(status, previous, interval)
                previous, t_prev = status, started
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")
                text = f"{time.strftime('%H:%M:%S')}  every {args.watch:g} s, Ctrl-C to stop\n\n" + text
            elif not args.json:
                text = f"--- {time.strftime('%H:%M:%S')}\n{text}"
            print(text, flush=True)
            time.sleep(max(0.0, args.watch - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return EXIT_OK


# ---------------------------------------------------------------------------- demo


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="one producer feeding several trainers vs independent DataLoaders (about a minute)",
        description="Generate a small JPEG dataset (Pillow, nothing downloaded), run the trainers with "
        "their own DataLoaders and then on one shared producer, and print what each achieved. "
        "Needs a source checkout (it runs scripts/demo.py).",
    )
    p.add_argument("--trainers", type=int, default=3, help="training processes (default 3)")
    p.add_argument("--images", type=int, default=1024, help="JPEGs in the generated dataset (default 1024)")
    p.add_argument("--epochs", type=int, default=2, help="epochs each trainer runs (default 2)")
    p.set_defaults(run=cmd_demo)


def _source_root() -> Path | None:
    import tensorsocket

    root = Path(tensorsocket.__file__).resolve().parent.parent
    needed = [
        root / "benchmarks" / "sharing.py",
        root / "scripts" / "demo.py",
        root / "producer" / "imagefolder.py",
    ]
    return root if all(p.is_file() for p in needed) else None


def cmd_demo(args: argparse.Namespace) -> int:
    for option in ("trainers", "images", "epochs"):
        if getattr(args, option) < 1:
            raise UsageError(f"--{option} must be >= 1, got {getattr(args, option)}")
    root = _source_root()
    if root is None:
        _error(
            "`tensorsocket demo` needs a source checkout (it runs scripts/demo.py with benchmarks/ "
            "and producer/ beside the package); install tensorsocket with `pip install -e .` from one"
        )
        return EXIT_USAGE
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("tensorsocket_demo_script", root / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = sys.argv
    sys.argv = [
        "tensorsocket demo",
        f"--trainers={args.trainers}",
        f"--images={args.images}",
        f"--epochs={args.epochs}",
    ]
    try:
        module.main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        return 130
    finally:
        sys.argv = saved
    return EXIT_OK


# ---------------------------------------------------------------------------- sweep


def _add_sweep(sub: Any) -> None:
    if _sweep_cmd is not None:
        p = sub.add_parser(
            "sweep",
            help="one producer, one trainer per grid point",
            description="Start one producer and one trainer per grid point, with live progress and a summary.",
        )
        _sweep_cmd.add_arguments(p)
        p.set_defaults(run=_sweep_cmd.run)
    else:
        p = sub.add_parser("sweep", help="one producer, one trainer per grid point (not available)")
        p.set_defaults(run=_sweep_unavailable)


def _sweep_unavailable(args: argparse.Namespace) -> int:
    _error(f"the sweep command is not available in this installation ({_sweep_missing})")
    return EXIT_USAGE


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="tensorsocket",
        description="Share one data loader's batches, zero-copy, with several training processes.",
    )
    parser.add_argument("--version", action="version", version=f"tensorsocket {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_status(sub)
    _add_sweep(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not (args.command == "sweep" and _sweep_cmd is None):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return int(args.run(args))
    except (UsageError, PipelineError) as exc:
        _error(str(exc))
        return EXIT_USAGE
    except (RuntimeError, PermissionError) as exc:  # e.g. "already serving", a bad runtime dir
        _error(str(exc))
        return EXIT_FAIL
    except BrokenPipeError:  # stdout closed (status | head): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
