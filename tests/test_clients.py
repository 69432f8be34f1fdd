"""Code nobody here wrote, used as its users use it, reading batches from read-only shared
memory: Lightning's Trainer fitting a model over a Consumer, and torchrun (gloo) running a
DistributedDataParallel job whose ranks are consumers (in a network namespace of its own
where one can be made, so its store and gloo listen on loopback only). Both run in processes of their own: a
write into a shared batch would be a segmentation fault, and must show as a failed run, not
take pytest down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from tensorsocket import Producer
from tests.support import SPAWN, free_port, permissions, private_network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = 6


class Features:
    """``BATCHES`` batches of (float32 8x16 features, int64 8 labels), a pure function of the index."""

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self) -> Any:
        for i in range(BATCHES):
            g = torch.Generator().manual_seed(i)
            yield torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)


def _checksum(x: torch.Tensor, y: torch.Tensor) -> float:
    return round(float(x.double().sum()) + float(y.sum()), 6)


EXPECTED = [_checksum(x, y) for x, y in Features()]


def _fit_with_lightning(name: str, epochs: int, out: Any) -> None:
    import lightning as L

    from tensorsocket import Consumer

    seen: list[float] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 2)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            assert permissions(x.data_ptr()) == "r--s"  # a view of the producer's memory, read-only
            seen.append(_checksum(x, y))
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    report: dict[str, Any] = {"error": None}
    try:
        with Consumer(name=name) as consumer:
            trainer = L.Trainer(
                max_epochs=epochs,
                accelerator="cpu",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(Model(), train_dataloaders=consumer)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seen"] = seen
    out.put(report)


def test_lightning_trainer_fits_over_read_only_shared_batches(name):
    pytest.importorskip("lightning")
    epochs = 2
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=_fit_with_lightning, args=(name, epochs, out))
    proc.start()
    Producer(Features(), name=name, slots=3, replay=0).serve(epochs=epochs)
    proc.join(timeout=120)  # its report is small: the queue's feeder has flushed it by exit
    assert proc.exitcode == 0, f"the Lightning process exited with {proc.exitcode}"
    report = out.get(timeout=10)
    assert report["error"] is None, report
    assert report["seen"] == EXPECTED * epochs


DDP_RANK = """\
import json, os, sys
import torch
import torch.distributed as dist
from tensorsocket import Consumer
from tests.support import permissions

name, epochs, report = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
with Consumer(name=name, label=f"rank {rank}") as consumer:
    for _ in range(epochs):
        for x, y in consumer:
            assert permissions(x.data_ptr()) == "r--s"
            seen.append(round(float(x.double().sum()) + float(y.sum()), 6))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()  # gradients all-reduced
            optimizer.step()
weights = [float(p.detach().double().sum()) for p in model.parameters()]
with open(f"{report}.{rank}", "w") as f:
    json.dump({"seen": seen, "weights": weights}, f)
dist.destroy_process_group()
# Leave without the interpreter's teardown: gloo's worker threads can abort it now and then
# ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291 describes
# the teardown race), after the report above is written.
sys.stdout.flush()
os._exit(0)
"""


def test_a_torchrun_ddp_job_trains_over_read_only_shared_batches(name, tmp_path):
    epochs, ranks = 2, 2
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(DDP_RANK))
    report = tmp_path / "report"
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(script), name, str(epochs), str(report),
    ]  # fmt: skip
    if private_network():  # torchrun's store and gloo then cannot listen beyond loopback
        command = [*private_network(), *command]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        Producer(Features(), name=name, slots=3, replay=0, min_consumers=ranks).serve(epochs=epochs)
        output, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    import json

    reports = [json.loads((tmp_path / f"report.{r}").read_text()) for r in range(ranks)]
    for r in reports:
        assert r["seen"] == EXPECTED * epochs  # every rank, every batch (no groups: each sees all)
    assert reports[0]["weights"] == pytest.approx(reports[1]["weights"])  # DDP kept them in step
