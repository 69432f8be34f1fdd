"""An Optuna study over one producer: trials run as threads of one process (``n_jobs=2``), each
with its own Consumer; one trial is pruned mid-epoch and leaves, the others do not wait for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tensorsocket import Consumer, Producer
from tests.ray_pipeline import IndexLoader
from tests.support import serving, wait_until

optuna = pytest.importorskip("optuna", reason="the ray extra (optuna) is not installed")

SAMPLES, BATCH, EPOCHS = 64, 8, 2
PRUNED, PRUNE_AT = 1, 3  # trial 1 is pruned after its 4th batch of epoch 0


class PruneOne(optuna.pruners.BasePruner):
    """Prunes trial ``PRUNED`` once it reported step ``PRUNE_AT``; nobody else."""

    def prune(self, study: Any, trial: Any) -> bool:
        step = trial.last_step
        return trial.number == PRUNED and step is not None and step >= PRUNE_AT


def test_study_with_threads_and_a_pruned_trial(name: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    producer = Producer(IndexLoader(SAMPLES, BATCH), name=name, slots=4, min_consumers=2, grace=10)
    seen: dict[int, list[list[int]]] = {}
    left_at: dict[int, float] = {}
    finished_at: dict[int, float] = {}
    threads: set[str] = set()
    lock = threading.Lock()

    def objective(trial: Any) -> float:
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        with lock:
            threads.add(threading.current_thread().name)
        epochs: list[list[int]] = []
        try:
            with Consumer(name=name, label=f"trial-{trial.number}", timeout=60.0) as loader:
                step = 0
                for epoch in range(EPOCHS):
                    ids: list[int] = []
                    epochs.append(ids)
                    for batch_ids, features in loader:
                        assert features.shape == (len(batch_ids), 4)
                        ids += batch_ids.tolist()
                        del batch_ids, features
                        time.sleep(0.02)
                        trial.report(lr * step, step)
                        if trial.should_prune():
                            raise optuna.TrialPruned(f"pruned at epoch {epoch}, step {step}")
                        step += 1
        finally:
            with lock:
                seen[trial.number] = epochs
                (left_at if trial.number == PRUNED else finished_at)[trial.number] = time.monotonic()
        return lr

    study = optuna.create_study(pruner=PruneOne())
    with serving(producer, None):
        study.optimize(objective, n_trials=4, n_jobs=2, timeout=120)
        # The pruned consumer left the producer when its `with` block closed it.
        wait_until(
            lambda: all(c["label"] != f"trial-{PRUNED}" for c in producer.status()["consumers"]),
            5,
            "the pruned trial's consumer to be gone from the producer",
        )

    states = {t.number: t.state for t in study.trials}
    assert states == {
        0: optuna.trial.TrialState.COMPLETE,
        1: optuna.trial.TrialState.PRUNED,
        2: optuna.trial.TrialState.COMPLETE,
        3: optuna.trial.TrialState.COMPLETE,
    }
    assert len(threads) == 2, f"n_jobs=2 ran the trials in threads {threads}"
    for number in (0, 2, 3):
        assert [sorted(e) for e in seen[number]] == [list(range(SAMPLES))] * EPOCHS, (
            f"trial {number} did not see every sample of each epoch once"
        )
    assert len(seen[PRUNED]) == 1 and len(seen[PRUNED][0]) == (PRUNE_AT + 1) * BATCH
    # Trial 0 ran beside the pruned one and went on without it. Had the pruned consumer stayed
    # (not closed), the producer would have stalled on it until it was evicted after its 60 s
    # timeout: trial 0's remaining ~12 batches take well under a second.
    assert left_at[PRUNED] < finished_at[0] < left_at[PRUNED] + 30
    assert seen[0][0] == seen[PRUNED][0] + seen[0][0][len(seen[PRUNED][0]) :]  # the same stream
