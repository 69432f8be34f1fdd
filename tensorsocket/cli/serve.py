"""``tensorsocket serve PIPELINE``: a standalone producer in the foreground, with a progress line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from .. import endpoint as endpoints
from ..errors import GpuPathError, StateFileError
from ..options import STRAGGLERS, default_max_lag
from ..pipeline import call as call_pipeline
from ..pipeline import describe, keyvalue
from ..pipeline import load as load_pipeline
from ..status import ProducerStatus, bottleneck
from .common import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    add_endpoint_options,
    count,
    detach_output,
    fmt_bytes,
    handling,
    positive_int,
    resolve,
    seconds,
    size,
)

log = logging.getLogger("tensorsocket")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a data pipeline to consumers (runs in the foreground)",
        description="Serve the batches of PIPELINE to every consumer that connects. Runs in the "
        "foreground; Ctrl-C, SIGTERM or SIGHUP (a closed terminal) ends the stream cleanly (consumers see a normal end) and "
        "frees the shared memory.",
        epilog="examples:\n  tensorsocket serve producer.synthetic:make_loader --name demo --arg batches=50\n"
        "  tensorsocket serve ./pipeline.py:make_loader --epochs 3 --arg root=data/jpeg-1024\n"
        "  tensorsocket serve ./pipeline.py:make_loader --min-consumers 4 --grace 30 \\\n"
        "      --replay 2G --stragglers skip --max-lag 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "pipeline",
        metavar="PIPELINE",
        help="module:function or path/to/file.py:function; called with the --arg values, returns the loader",
    )
    add_endpoint_options(p)
    p.add_argument(
        "--slots",
        type=positive_int,
        default=8,
        help="batches the producer may run ahead of the slowest consumer, each in its own shared "
        "memory slot (default 8)",
    )
    p.add_argument(
        "--replay",
        type=size,
        default=None,
        metavar="BYTES",
        help="shared memory kept for batches already consumed, so a consumer joining mid-epoch "
        "can start at the epoch's first batch: 512M, 2G (powers of 1024), 0 to disable "
        "(default: 1G, or a quarter of the free /dev/shm if less)",
    )
    p.add_argument("--epochs", type=count, default=None, help="epochs to serve (default: until stopped)")
    p.add_argument(
        "--min-consumers",
        type=positive_int,
        default=1,
        help="consumers to wait for before the first batch (default 1)",
    )
    p.add_argument(
        "--grace",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="start anyway this many seconds after the first consumer joined, even if fewer than "
        "--min-consumers did (default: wait for all of them)",
    )
    p.add_argument(
        "--stragglers",
        choices=STRAGGLERS,
        default=None,
        help="stall: the slowest consumer sets the pace and every consumer sees every batch "
        "(default); skip: a consumer more than --max-lag batches behind the leading one skips ahead",
    )
    p.add_argument(
        "--max-lag",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --stragglers skip (implied): batches a consumer may lag before it skips; "
        "below --slots (default: half of --slots)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where batches are shared: cpu (host shared memory) or cuda / cuda:N (GPU memory, CUDA IPC)",
    )
    p.add_argument(
        "--linger",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="seconds to wait for consumers to take the end of the stream when stopping (default 10)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the stream of the last producer on this name if it died (consumers with "
        "reconnect= ride through), keeping a state file beside the socket; for a supervisor that "
        "restarts this command on failure",
    )
    p.add_argument(
        "--arg",
        dest="args",
        action="append",
        type=keyvalue,
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the pipeline function (repeatable; numbers become int/float)",
    )
    p.add_argument(
        "--progress",
        type=seconds,
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


def producer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Producer keyword arguments the options ask for; UsageError for combinations the
    producer would refuse (checked before the pipeline is loaded)."""
    stragglers = args.stragglers
    if args.max_lag is not None:
        if stragglers == "stall":
            raise UsageError("--max-lag applies to --stragglers skip only")
        stragglers = "skip"
        if args.max_lag >= args.slots:
            raise UsageError(
                f"--max-lag must be below --slots ({args.slots}), got {args.max_lag}: a consumer can only "
                "lag by batches the producer still keeps"
            )
    stragglers = stragglers or "stall"
    if stragglers == "skip" and args.slots < 2:
        raise UsageError("--stragglers skip needs --slots 2 or more")
    from ..transport import parse_device  # (torch: serve needs it anyway)

    try:
        parse_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    return {
        "device": args.device,
        "slots": args.slots,
        "replay": args.replay,
        "min_consumers": args.min_consumers,
        "grace": args.grace,
        "stragglers": stragglers,
        "max_lag": args.max_lag,
        "linger": args.linger,
        "resume": args.resume,
    }


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _progress(producer: Any, every: float, stop: threading.Event) -> None:
    """Log a line every ``every`` seconds while something changes."""
    previous: ProducerStatus | None = None
    while not stop.wait(every):
        try:
            s = producer.status()
        except Exception:
            return
        if previous is None:
            published, consumers, uptime = 0, 0, 0.0
        else:
            published, consumers, uptime = (
                previous["published"],
                len(previous["consumers"]),
                previous["uptime_s"],
            )
        if s["published"] == published and len(s["consumers"]) == consumers:
            continue
        span = max(s["uptime_s"] - uptime, 1e-9)
        log.info(
            "epoch %d, %d batches published (%.1f/s), %d consumer(s); bottleneck: %s",
            s["epoch"],
            s["published"],
            (s["published"] - published) / span,
            len(s["consumers"]),
            bottleneck(s, previous),
        )
        previous = s


def _describe_setup(args: argparse.Namespace, options: dict[str, Any]) -> str:
    waiting = f"waiting for {args.min_consumers} consumer(s)"
    if options["grace"] is not None and args.min_consumers > 1:
        waiting += f" (or {options['grace']:g} s after the first)"
    if options["stragglers"] == "skip":
        lag = options["max_lag"] if options["max_lag"] is not None else default_max_lag(args.slots)
        pace = f"stragglers skip beyond {lag} batches"
    else:
        pace = "the slowest consumer sets the pace"
    replay = "default replay budget" if args.replay is None else f"replay budget {fmt_bytes(args.replay)}"
    return f"{waiting}; {args.slots} slots, {replay}; {pace}"


def check_gpu(device: str) -> None:
    """A GPU ``--device`` (its name checked by :func:`producer_options`) names a GPU this
    process sees, through a GPU path that works here; UsageError in one line. Asked once the
    pipeline was made: a pipeline that needs a GPU says so itself first."""
    from ..transport import parse_device
    from ..transport.device import backend

    parsed = parse_device(device)
    if parsed.type != "cuda":
        return
    try:
        seen = len(backend().visible_uuids())
    except GpuPathError as exc:
        raise UsageError(f"--device {device}: {exc}") from None
    if not seen or (parsed.index or 0) >= seen:
        raise UsageError(f"--device {device}: this process sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES?)")


def cmd_serve(args: argparse.Namespace) -> int:
    options = producer_options(args)  # usage errors first: before logging is set up
    endpoint = resolve(args)
    _configure_logging(args.log_level)

    from ..producer import Producer

    asked = threading.Event()  # a stop signal came
    cleaning = threading.Event()  # the clean-up below runs: a signal is only logged
    serving_pid = os.getpid()

    def on_signal(signum: int, frame: Any) -> None:
        if os.getpid() != serving_pid:  # a loader worker forked with this handler: as if we had none
            signal.default_int_handler(signum, frame)  # (torch's workers set SIGTERM's themselves)
        # The stop is under way where its KeyboardInterrupt is being handled (the producer's
        # close, the ends below): it must run whole. Else a signal after the first means that
        # the first's was swallowed by the code it landed in (an extension module's import):
        # raised again, not ignored, or serve would never stop.
        if cleaning.is_set() or handling(KeyboardInterrupt):
            log.warning("already stopping; waiting up to %g s for consumers to take the end", args.linger)
            return
        if signum == signal.SIGHUP:  # its terminal is gone: writes to it fail
            detach_output()
        name = signal.Signals(signum).name
        if asked.is_set():
            log.warning(
                "%s again: the first one's stop was lost in the code it interrupted; ending the stream", name
            )
        else:
            log.info("%s: ending the stream", name)
        asked.set()
        # The loader's workers got the signal too when it went to the process group (Ctrl-C,
        # `systemctl stop`, `timeout`): their deaths are expected now, and torch's SIGCHLD
        # handler would raise for them in the middle of the clean end.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        raise KeyboardInterrupt

    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGHUP: the terminal serve runs in was closed; killed by it, the producer would leave
        # its consumers ProducerLost, and its socket, lock and shared memory behind
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    producer = None
    done = threading.Event()
    progress: threading.Thread | None = None
    try:
        function = load_pipeline(args.pipeline)
        # Refuse a served name before calling a possibly slow pipeline function, and give the
        # name back with its files at once: a pipeline that then fails leaves no lock file. The
        # Producer takes the lock for real below, and refuses too if someone took it in between.
        try:
            held = endpoints.lock(endpoint)
        except ValueError as exc:  # an ipc path whose folder is missing: a bad --endpoint
            raise UsageError(str(exc)) from None
        endpoints.unlock(endpoint, held)
        loader = call_pipeline(function, args.pipeline, dict(args.args))
        check_gpu(args.device)
        if asked.is_set():  # its KeyboardInterrupt was swallowed in the pipeline (an import)
            raise KeyboardInterrupt
        try:
            producer = Producer(loader, endpoint=endpoint, **options)
        except StateFileError as exc:  # (--resume: not the pipeline's fault)
            raise UsageError(str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"pipeline {args.pipeline} returned {type(loader).__name__}: {exc}") from None
        except OSError as exc:  # (--resume: the loader, running its epoch again, as in serve() below)
            log.error("could not resume: %s", describe(exc))
            log.debug("traceback", exc_info=True)
            return EXIT_FAIL
        if asked.is_set():  # swallowed while it was made (by the loader, say): a stop as it serves
            raise KeyboardInterrupt
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
            "serving %s on %s (pid %d) %s; %s; stop with Ctrl-C or SIGTERM",
            args.pipeline,
            producer.endpoint,
            os.getpid(),
            epochs,
            _describe_setup(args, options),
        )
        try:
            producer.serve(epochs=args.epochs)
        except Exception as exc:
            log.error("serving stopped on an error: %s", describe(exc))
            log.debug("traceback", exc_info=True)
            return EXIT_FAIL
        log.info("served %d epoch(s); every consumer finished", args.epochs)
        return EXIT_OK
    except KeyboardInterrupt:  # serve() has ended the stream cleanly, or nothing was served yet
        cleaning.set()  # (before the traceback goes, which may hold a rerun's loader workers)
        if producer is None:
            log.info("interrupted before serving")
            return EXIT_INTERRUPTED
        log.info("stopped")
        return EXIT_OK
    finally:
        cleaning.set()
        done.set()
        if progress is not None:
            # Joined: a thread still running at interpreter exit that drops the last reference
            # to the producer (its loader, its tensors) aborts the process.
            progress.join()
        if producer is not None:
            producer.close()  # idempotent; covers an interrupt before serve() began
        for sig, handler in previous.items():
            signal.signal(sig, handler)
