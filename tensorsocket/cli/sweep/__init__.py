"""``tensorsocket sweep``: one producer, one trainer process per grid point.

    tensorsocket sweep --pipeline producer/imagefolder.py:make_loader --pipeline-arg root=data/jpeg-1024 \\
        --trainer "python consumer/train.py --shared" --grid lr=0.1,0.01 --grid seed=0,1

Every combination of the ``--grid`` values is a trial: the trainer command with ``--key value``
appended for each grid key (the key verbatim: ``--grid batch_size=...`` appends
``--batch_size``), run with ``TENSORSOCKET_ENDPOINT`` set to the sweep's producer (and
``TENSORSOCKET_TRIAL`` to the trial's name). A leading ``python`` / ``python3`` in the trainer
command is replaced by this interpreter, so trainers run in the sweep's environment.

Design:

* The producer runs in a child process (``python -m tensorsocket.cli.sweep _serve ...``), so a
  pipeline that crashes or hangs never takes the launcher with it. It waits until every
  trial it serves has joined or exited, then serves ``--epochs`` epochs from the first batch.
  Trials that exit before joining (a typo in a grid value, an import error) are reported to
  it on its stdin, so it never waits for them; one that dies mid-stream is evicted by the
  producer (it watches consumer pids), and the others go on.
* ``--parallel N`` smaller than the number of trials runs the trials in *waves* of N, each
  wave with its own producer run of ``--epochs`` epochs. That keeps every trial's data exact
  and simple to reason about: each sees the whole stream, every epoch from its first batch.
  (One long-running producer with late joiners would make a trial that starts later join at
  an epoch boundary, and see fewer epochs, or more, than its neighbours.) The price: a wave
  ends with its slowest trial.
* Each trial's stdout and stderr go to ``<logs>/<trial>.log``; the producer's to
  ``<logs>/producer.log``. Progress: on a terminal, one line per trial (waiting / running /
  done / failed, elapsed, the last line of its log) redrawn every second; otherwise one plain
  line whenever a trial changes state.
* A trainer reports its outcome with one line ``RESULT {json}`` (``consumer/train.py`` prints
  ``{"loss", "samples_per_s", "samples", "epochs"}``); the last such line of its log goes
  into the summary: a table on stdout, ``<logs>/summary.json`` and ``<logs>/summary.csv``.
* Ctrl-C (or SIGTERM, or SIGHUP when its terminal closes): the trainers are terminated (their
  process groups: SIGTERM, then SIGKILL after 5 s), the producer is told to end the stream and
  free its shared memory, the summary is written with the interrupted trials marked
  ``stopped``, and the exit code is 130 (143 for SIGTERM, 129 for SIGHUP). If the sweep dies
  without that (SIGKILL), its producer ends the stream with that reason, so trainers still
  running raise ``ProducerLost`` instead of taking the cut-short stream for a finished run.

Modules, each importing only those after it: this one (the subcommand and ``python -m
tensorsocket.cli.sweep``); ``launcher`` (the run); ``processes`` (one wave's processes);
``report`` (the live progress and the summary); ``trials`` (options, trials, RESULT lines);
``producer`` (the producer child, imported only in that child).

Exit codes: 0 every trial succeeded; 1 at least one failed; 2 a usage error (a bad
``--grid``, ``--pipeline`` or ``--trainer``), or the producer could not start (the pipeline
raised, say: the end of ``producer.log`` is printed); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..common import EXIT_USAGE
from .launcher import run
from .trials import add_arguments, parse_result

__all__ = ["add_arguments", "add_parser", "main", "parse_result", "run"]

_DESCRIPTION = "Start one producer and one trainer per grid point, with live progress and a summary."


def add_parser(sub: Any) -> None:
    """Add ``sweep`` to the ``tensorsocket`` command's subparsers."""
    p = sub.add_parser("sweep", help="one producer, one trainer per grid point", description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorsocket.cli.sweep``: the same as ``tensorsocket sweep``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_serve"]:
        from . import producer  # the child of a wave: imports torch, so only here

        return producer.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tensorsocket.cli.sweep", description=_DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    return run(args)
