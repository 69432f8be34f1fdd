"""A Ray Tune sweep of consumer/train.py's model on the JPEG image folder: each trial with its
own DataLoader or, with ``--shared``, every trial reading its node's tensorsocket producer.

Switching the trials to the shared loader is two lines, marked ``[tensorsocket 1/2]`` and
``[tensorsocket 2/2]`` below, as in consumer/train.py; the driver starts the producers
(``tensorsocket.ray.producers``, one per node, its CPUs reserved) around ``tuner.fit()``.

    python3 consumer/tune_sweep.py --address auto --data /shared/jpeg --shared   # a running cluster
    python3 consumer/tune_sweep.py --local-nodes 2 --shared                      # 2 simulated nodes here
    python3 consumer/tune_sweep.py --local-nodes 2                               # the same, own DataLoaders

On a cluster, ``--data`` must be readable at the same path on every node. Prints one line per
trial (its node, final loss, samples/s).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from consumer.train import make_model, train_step  # noqa: E402
from producer.imagefolder import make_dataset, make_loader  # noqa: E402
from tensorsocket.ray import consumer as shared_loader  # noqa: E402  [tensorsocket 1/2] the import

PIPELINE = f"{ROOT / 'producer' / 'imagefolder.py'}:make_loader"


def trial(config: dict[str, Any]) -> None:
    """One Tune trial: train the model for ``epochs`` epochs, report loss and samples/s per epoch."""
    import ray
    from ray import train, tune

    report = getattr(tune, "report", None) or train.report  # ray.tune.report from Ray 2.41 on

    sys.path.insert(0, str(ROOT))  # a worker started elsewhere finds the example's modules
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if config["shared"]:  # the line that was make_loader(...), below
        loader = shared_loader(config["fleet"], batch_size=config["batch_size"])  # [tensorsocket 2/2]
    else:
        loader = make_loader(config["data"], batch_size=config["batch_size"], num_workers=config["workers"])
    node = ray.get_runtime_context().get_node_id()[:16]
    samples, start = 0, None
    try:
        for epoch in range(config["epochs"]):
            loss_sum, seen = 0.0, 0
            for batch, (images, labels) in enumerate(loader):
                start = start or time.perf_counter()
                loss_sum += train_step(model, optimizer, loss_fn, images, labels)
                seen += len(labels)
                del images, labels  # a shared batch's slot is freed once nothing holds it
                if config["max_batches"] and batch + 1 >= config["max_batches"]:
                    break
            samples += seen
            rate = samples / max(time.perf_counter() - (start or time.perf_counter()), 1e-9)
            report({"epoch": epoch, "loss": loss_sum / max(seen, 1), "samples_per_s": rate, "node": node})
    finally:
        close = getattr(loader, "close", None)  # a Consumer leaves its producer; a DataLoader has none
        if close is not None:
            close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shared", action="store_true", help="trials read their node's tensorsocket producer"
    )
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: --local-nodes here)")
    parser.add_argument(
        "--local-nodes", type=int, default=2, help="simulated nodes on this machine (default 2)"
    )
    parser.add_argument(
        "--node-cpus", type=int, default=4, help="logical CPUs of each simulated node (default 4)"
    )
    parser.add_argument(
        "--data", default=str(ROOT / "data" / "jpeg-256"), help="image folder (made if missing)"
    )
    parser.add_argument("--images", type=int, default=256, help="images to generate when --data is missing")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, nargs="+", default=[0.1, 0.05, 0.01, 0.005])
    parser.add_argument(
        "--batch-size", type=int, default=32, help="each trial's batch size (re-cut when shared)"
    )
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per loader (default 1)")
    parser.add_argument("--max-batches", type=int, default=0, help="stop each epoch after N batches (0: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import train, tune

    import tensorsocket.ray as tsray

    if args.address is None:
        make_dataset(args.data, count=args.images)
    cluster = None
    if args.address is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus})
        for _ in range(args.local_nodes - 1):
            cluster.add_node(num_cpus=args.node_cpus)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    else:
        ray.init(address=args.address, log_to_driver=False)
    try:
        fleet = (
            # One producer per node; its loader's workers and the producer itself get their CPUs.
            tsray.producers(
                PIPELINE,
                "tune-sweep",
                args={"root": args.data, "num_workers": args.workers},
                cpus=args.workers + 1,
            )
            if args.shared
            else contextlib.nullcontext()
        )
        space = {
            "lr": tune.grid_search(args.lr),
            "shared": args.shared,
            "fleet": "tune-sweep",
            "data": args.data,
            "batch_size": args.batch_size,
            "workers": args.workers,
            "epochs": args.epochs,
            "max_batches": args.max_batches,
        }
        # Each trial takes one CPU, plus its loader's workers when it has its own DataLoader.
        cpus = 1 if args.shared else 1 + args.workers
        with fleet:
            tuner = tune.Tuner(
                tune.with_resources(trial, {"cpu": cpus}),
                param_space=space,
                run_config=(getattr(tune, "RunConfig", None) or train.RunConfig)(
                    name="tensorsocket-tune-sweep", verbose=0
                ),
            )
            results = tuner.fit()
        for result in results:
            m, lr = result.metrics or {}, result.config["lr"]
            if result.error is not None:
                print(f"lr={lr:<8g} failed: {result.error}")
                continue
            print(f"lr={lr:<8g} node {m['node']}  loss {m['loss']:.4f}  {m['samples_per_s']:.1f} samples/s")
        return 0 if not results.errors else 1
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
