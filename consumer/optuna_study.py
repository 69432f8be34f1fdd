"""An Optuna study of consumer/train.py's model on the JPEG image folder: each trial with its own
DataLoader or, with ``--shared``, reading one tensorsocket producer; a median pruner stops poor
trials mid-epoch, and a pruned trial's consumer leaves without holding the others back.

Switching the trials to the shared loader is two lines, marked ``[tensorsocket 1/2]`` and
``[tensorsocket 2/2]`` below, as in consumer/train.py.

    python3 consumer/optuna_study.py --trials 4 --jobs 2                    # own DataLoaders, 2 threads
    python3 consumer/optuna_study.py --trials 4 --jobs 2 --shared --serve   # one producer in this process
    # or trials as processes sharing a storage, over a producer of their own:
    tensorsocket serve producer/imagefolder.py:make_loader --arg root=data/jpeg-256 --name optuna &
    python3 consumer/optuna_study.py --shared --storage sqlite:///study.db --trials 2 &  # twice, or more
    python3 consumer/optuna_study.py --shared --storage sqlite:///study.db --trials 2

Prints one line per trial of this process.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from consumer.train import make_model, train_step  # noqa: E402
from producer.imagefolder import make_dataset, make_loader  # noqa: E402
from tensorsocket import Consumer  # noqa: E402  [tensorsocket 1/2] the import


def objective(trial: Any, args: argparse.Namespace) -> float:
    """Train for ``--epochs`` epochs at the trial's learning rate; report the loss every few
    batches so the pruner can stop the trial mid-epoch."""
    import optuna

    lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    label = f"trial-{trial.number}"  # how `tensorsocket status` shows this trial
    if args.shared:  # the line that was make_loader(...), below
        loader = Consumer(name=args.name, batch_size=args.batch_size, label=label)  # [tensorsocket 2/2]
    else:
        loader = make_loader(args.data, batch_size=args.batch_size, num_workers=args.workers)
    step, loss_sum, seen, last = 0, 0.0, 0, float("nan")
    try:
        for epoch in range(args.epochs):
            for batch, (images, labels) in enumerate(loader):
                loss_sum += train_step(model, optimizer, loss_fn, images, labels)
                seen += len(labels)
                del images, labels  # a shared batch's slot is freed once nothing holds it
                step += 1
                if step % args.report_every == 0:
                    last, loss_sum, seen = loss_sum / seen, 0.0, 0
                    trial.report(last, step)
                    if trial.should_prune():  # leaving here closes the consumer (finally below)
                        raise optuna.TrialPruned(f"pruned at epoch {epoch}, batch {batch}")
                if args.max_batches and batch + 1 >= args.max_batches:
                    break
    finally:
        close = getattr(loader, "close", None)  # a Consumer leaves its producer; a DataLoader has none
        if close is not None:
            close()
    return loss_sum / seen if seen else last  # the mean loss over the last batches


@contextlib.contextmanager
def in_process_producer(args: argparse.Namespace) -> Any:
    """``--serve``: a producer in a thread of this process, serving until the study is done."""
    from tensorsocket import Producer

    loader = make_loader(args.data, batch_size=32, num_workers=args.workers)
    if args.workers:
        # The trials are threads of this process: a worker forked while one of them holds an
        # import lock (numpy's lazy attributes, say) would wait for it forever.
        loader.multiprocessing_context = "forkserver"
    producer = Producer(loader, name=args.name)
    thread = threading.Thread(target=producer.serve, kwargs={"epochs": None}, name="producer", daemon=True)
    thread.start()
    try:
        yield producer
    finally:
        producer.close()
        thread.join(timeout=30)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", action="store_true", help="read the tensorsocket producer --name")
    parser.add_argument(
        "--serve", action="store_true", help="with --shared: run that producer in this process"
    )
    parser.add_argument("--name", default="optuna", help="the producer's name (default: %(default)s)")
    parser.add_argument(
        "--data", default=str(ROOT / "data" / "jpeg-256"), help="image folder (made if missing)"
    )
    parser.add_argument("--images", type=int, default=256, help="images to generate when --data is missing")
    parser.add_argument("--trials", type=int, default=4, help="trials this process runs")
    parser.add_argument("--jobs", type=int, default=2, help="trials at once, as threads (Optuna's n_jobs)")
    parser.add_argument("--storage", default=None, help="an Optuna storage URL shared by several processes")
    parser.add_argument("--study", default="tensorsocket-optuna", help="study name in --storage")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="each trial's batch size (re-cut when shared)"
    )
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    parser.add_argument("--report-every", type=int, default=4, help="batches between reports to the pruner")
    parser.add_argument("--max-batches", type=int, default=0, help="stop each epoch after N batches (0: all)")
    args = parser.parse_args(argv)
    if args.serve and not args.shared:
        parser.error("--serve needs --shared")
    return args


def main(argv: list[str] | None = None) -> int:
    import optuna

    args = parse_args(argv)
    if args.serve or not args.shared:
        make_dataset(args.data, count=args.images)
    torch.set_num_threads(1)  # trials are threads: one intra-op thread each
    study = optuna.create_study(
        study_name=args.study if args.storage else None,
        storage=args.storage,
        load_if_exists=True,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=2),
    )
    producer = in_process_producer(args) if args.serve else contextlib.nullcontext()
    start = time.perf_counter()
    with producer:
        study.optimize(lambda t: objective(t, args), n_trials=args.trials, n_jobs=args.jobs)
    for t in study.trials:
        value = "-" if t.value is None else f"{t.value:.4f}"
        print(f"trial {t.number}: {t.state.name:<8} lr={t.params.get('lr', float('nan')):.4g}  loss {value}")
    print(f"{len(study.trials)} trial(s) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
