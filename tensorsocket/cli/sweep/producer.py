"""The producer process of ``tensorsocket sweep``, one per wave: ``python -m tensorsocket.cli.sweep _serve``.

The sweep starts it; not a command for people.

It binds, writes its endpoint to ``--ready-file``, waits until every trial of the wave has
joined or was reported on stdin as ``exited``, then serves ``--epochs`` epochs. ``stop`` on
stdin, or stdin closing (the sweep is gone), ends the stream early and frees the shared
memory; if it cannot end within a while, it kills itself and its DataLoader workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...pipeline import PipelineError, describe, keyvalue
from ...pipeline import load as load_pipeline
from ..common import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, positive_int

_STUCK_EXIT = 30.0  # this process kills itself if still running this long after a stop
_QUIET_JOINS = 30.0  # no consumer joined for this long while the wave waits for more: said so
# The stream's end reason when stdin closes without "stop": the sweep died (SIGKILL, a closed
# terminal) and its trainers, in sessions of their own, still run. A clean end would let them
# take a cut-short stream for a finished run (and print a RESULT); this makes them fail.
SWEEP_GONE = "the tensorsocket sweep that started this producer is gone (its stdin closed)"


def main(argv: list[str]) -> int:
    """``python -m tensorsocket.cli.sweep _serve``: the sweep's producer process.

    Binds, writes its endpoint to ``--ready-file``, waits until every one of ``--trials``
    trials joined (``--per-trial`` consumers each) or was reported on stdin as ``exited``,
    serves ``--epochs`` epochs and exits. ``stop`` on stdin, or stdin closing (the sweep is
    gone), ends the stream early.
    """
    from ...producer import Producer

    parser = argparse.ArgumentParser(prog="python -m tensorsocket.cli.sweep _serve")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--pipeline-arg", dest="pipeline_args", action="append", type=keyvalue, default=[])
    parser.add_argument("--name", required=True)
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--trials", type=positive_int, required=True)
    parser.add_argument("--per-trial", type=positive_int, default=1)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("tensorsocket.sweep")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:  # (the sweep SIGTERMs a producer stopped before it binds: a stop, not a crash)
        function = load_pipeline(args.pipeline)
        loader = function(**dict(args.pipeline_args))
    except PipelineError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        log.info("stopped while making the pipeline; nothing served")
        return EXIT_INTERRUPTED
    except Exception as exc:
        log.error("the pipeline %s raised %s", args.pipeline, describe(exc), exc_info=True)
        return EXIT_USAGE
    try:
        # Every trial of the wave joins before the first batch: no late joiner to replay to,
        # so no shared memory is spent keeping consumed batches.
        producer = Producer(loader, name=args.name, slots=args.slots, replay=0, min_consumers=1)
    except (TypeError, ValueError) as exc:
        log.error("the pipeline %s returned %s: %s", args.pipeline, type(loader).__name__, exc)
        return EXIT_USAGE
    except RuntimeError as exc:  # the name is served already
        log.error("%s", exc)
        return EXIT_USAGE
    return _WaveServer(producer, args.trials, args.per_trial, log).run(args.epochs, Path(args.ready_file))


class _WaveServer:
    """The producer child once bound: its main thread waits for the wave's trials and
    serves; a second thread reads the sweep's messages on stdin."""

    def __init__(self, producer: Any, trials: int, per_trial: int, log: Any) -> None:
        self.producer = producer
        self.trials, self.per_trial = trials, per_trial
        self.log = log
        self.lock = threading.Lock()  # guards exited, and serving vs stop
        self.exited = 0  # trials the sweep reported as exited
        self.serving = False  # serve() was entered: the stdin thread must close() to end it
        self.stop = threading.Event()  # "stop" or EOF on stdin
        self.reason: str | None = None  # the stream's end reason: SWEEP_GONE on EOF without "stop"
        self.closed = threading.Event()  # the stdin thread is done closing
        self.finished = threading.Event()  # the main thread is done
        self.watcher = threading.Thread(
            target=self._watch_parent, name="tensorsocket-sweep-stdin", daemon=True
        )

    def run(self, epochs: int, ready_file: Path) -> int:
        self.watcher.start()
        self.log.info(
            "producer pid %d on %s: waiting for %d trial(s), %d consumer(s) each",
            os.getpid(),
            self.producer.endpoint,
            self.trials,
            self.per_trial,
        )
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(self.producer.endpoint)
        os.replace(tmp, ready_file)
        try:
            return self._serve(epochs)
        finally:
            self.finished.set()
            # The stdin thread must not hold the producer as the interpreter finalizes: a
            # daemon thread that frees the last reference to a tensor then aborts the process
            # (torch takes the GIL again from C++, Python 3.11 ends the thread with
            # pthread_exit, and unwinding its C++ frames calls std::terminate: SIGABRT, 9 of
            # 70 stops). So the main thread drops it, and waits for a stdin thread that woke.
            with self.lock:
                self.producer, woke = None, self.stop.is_set()
            if woke:
                self.watcher.join(_STUCK_EXIT)

    def _serve(self, epochs: int) -> int:
        from ...host import pid_alive

        producer = self.producer
        total, seen, since = self.trials * self.per_trial, -1, time.monotonic()
        try:
            while True:
                # Joined consumers (whose process still lives) plus those of the trials that
                # exited: once that is every consumer of the wave, nobody else is coming.
                # (Counted as consumers, not trials: torchrun's ranks have sessions of their
                # own, so which trial a consumer belongs to is not known here.)
                joined = sum(pid_alive(c["pid"]) for c in producer.status()["consumers"])
                with self.lock:
                    if self.stop.is_set() or self.exited >= self.trials:
                        why = "told to stop" if self.stop.is_set() else "every trial exited before joining"
                        self.log.info("%s; nothing served", why)
                        producer.close(reason=self.reason)
                        return EXIT_OK
                    counted = joined + self.exited * self.per_trial
                    if counted >= total:
                        self.serving = True
                        break
                if counted != seen:  # (else a wave that waits for a consumer never coming says nothing)
                    self.log.info("%d of %d consumer(s) joined or their trial exited", counted, total)
                    seen, since = counted, time.monotonic()
                elif time.monotonic() - since > _QUIET_JOINS:
                    self.log.warning(
                        "%d of %d consumer(s) joined, none for %g s: each trial must open %d "
                        "(--consumers-per-trial) before its first batch",
                        counted, total, _QUIET_JOINS, self.per_trial,
                    )  # fmt: skip
                    since = time.monotonic()
                time.sleep(0.05)
            self.log.info("%d consumer(s) joined; serving %d epoch(s)", joined, epochs)
            producer.serve(epochs=epochs)
        except KeyboardInterrupt:
            producer.close()
            return EXIT_INTERRUPTED
        except Exception as exc:
            if not self.stop.is_set():
                self.log.exception("serving failed")
                producer.close(reason=f"{type(exc).__name__}: {exc}")
                return EXIT_FAIL
        if self.stop.is_set():  # serve() ended because the stdin thread closed the producer
            self.closed.wait(60.0)  # let that close() finish: it frees the shared memory
            self.log.info("stopped")
        else:
            self.log.info("done")
        return EXIT_OK

    def _watch_parent(self) -> None:
        # Raw reads of fd 0, not sys.stdin: a thread blocked in sys.stdin.readline() holds
        # the buffer's lock, and a DataLoader worker forked meanwhile deadlocks closing its
        # inherited copy of sys.stdin (multiprocessing does that at start).
        pending, gone = b"", False
        while True:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                gone = True  # EOF without "stop": the sweep is gone
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if any(line.strip() == b"stop" for line in lines):
                break
            with self.lock:
                self.exited += sum(line.strip() == b"exited" for line in lines)
        if gone:
            self.log.warning("%s: ending the stream with that reason", SWEEP_GONE)
        with self.lock:
            self.reason = SWEEP_GONE if gone else None
            self.stop.set()
            producer = self.producer if self.serving else None  # (None: the main thread is done)
        if producer is not None:  # serve() runs in the main thread: close() from here ends it
            producer.close(reason=self.reason)
        del producer  # (see run(): before the main thread may finish)
        self.closed.set()
        if not self.finished.wait(_STUCK_EXIT):
            # The main thread is stuck (in the loader, say), and if the sweep is gone nobody
            # else will end this process: take it down, with its DataLoader workers.
            self.log.error("still running %g s after the stop; killing this process", _STUCK_EXIT)
            if os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)
            os._exit(EXIT_FAIL)
