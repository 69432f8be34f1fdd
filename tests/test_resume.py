"""Resumable consumers: a trainer restored from its checkpoint (Consumer.state_dict /
load_state_dict, StatefulDataLoader's shape) rejoins at its position, exactly, in real
processes; Lightning saves and restores that state in its checkpoints unchanged."""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import pytest
import torch

from tensorsocket import Consumer, Producer
from tests.support import SPAWN, serving, wait_until

BATCHES, ROWS = 8, 4


class Ids:
    """``BATCHES`` batches of ``ROWS`` sample ids each, epoch after epoch the same."""

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self) -> Any:
        for i in range(BATCHES):
            yield torch.arange(i * ROWS, (i + 1) * ROWS)


def _life(name: str, state_file: str, epochs: int, kill_after: int | None, options: dict, out: Any) -> None:
    """One life of a trainer: restore from ``state_file`` if there is one, iterate, save the
    state after every batch (as a checkpoint would), SIGKILL itself after ``kill_after``."""
    seen: list[list[int]] = []
    with Consumer(name=name, timeout=10.0, **options) as consumer:
        if os.path.exists(state_file):
            with open(state_file) as f:
                consumer.load_state_dict(json.load(f))
        taken = 0
        while not consumer.finished:  # the rest of its epoch, then the others, to the end
            for batch in consumer:
                seen.append(batch.tolist())
                taken += 1
                with open(state_file + ".tmp", "w") as f:
                    json.dump(consumer.state_dict(), f)
                os.replace(state_file + ".tmp", state_file)
                if taken == kill_after:
                    out.put(seen)
                    out.close()
                    out.join_thread()  # the queue's feeder has sent it
                    os.kill(os.getpid(), signal.SIGKILL)
        out.put(seen)


@pytest.mark.parametrize(
    "options, kill_after",
    [({}, 11), ({"batch_size": 3}, 13)],  # mid-epoch 1; the re-cut one inside a producer batch
    ids=["producer-batches", "re-cut"],
)
def test_a_killed_trainer_restored_from_its_state_sees_every_epoch_exactly_once(
    name, tmp_path, options, kill_after
):
    epochs = 3
    state = str(tmp_path / "state.json")
    out = SPAWN.Queue()
    with Producer(Ids(), name=name, slots=2) as producer:  # default replay keeps the epoch
        with serving(producer, epochs=epochs) as (thread, errors):
            first = SPAWN.Process(target=_life, args=(name, state, epochs, kill_after, options, out))
            first.start()
            before = out.get(timeout=60)
            first.join(timeout=30)
            assert first.exitcode == -signal.SIGKILL
            second = SPAWN.Process(target=_life, args=(name, state, epochs, None, options, out))
            second.start()
            after = out.get(timeout=60)
            second.join(timeout=30)
            thread.join(timeout=30)
        assert not errors, errors
    samples = [i for _ in range(epochs) for i in range(BATCHES * ROWS)]
    assert [i for b in before + after for i in b] == samples  # the two lives: each sample once, in order
    size = options.get("batch_size", ROWS)
    per_epoch = [size] * (BATCHES * ROWS // size) + ([BATCHES * ROWS % size] if BATCHES * ROWS % size else [])
    assert [len(b) for b in before + after] == per_epoch * epochs  # the re-cut went on where it was


def test_a_state_saved_before_anything_was_taken_starts_afresh_and_states_are_checked(name):
    with Producer(Ids(), name=name, slots=2) as producer:
        with serving(producer, epochs=1):
            with Consumer(name=name) as consumer:
                fresh = consumer.state_dict()
                assert "stream" not in fresh
                consumer.load_state_dict(fresh)
                for bad, needle in [
                    ({}, "not a tensorsocket Consumer state"),
                    ({**fresh, "tensorsocket": 99}, "not a tensorsocket Consumer state"),
                    ({**fresh, "batch_size": 3}, "saved by a consumer with batch_size=3"),
                    ({**fresh, "group": ["job", 2]}, r"group=\[.job., 2\]"),
                    (
                        {**fresh, "stream": "s", "epoch": -1, "index": 0, "offset": 0},
                        "epoch must be a non-negative",
                    ),
                    ({**fresh, "stream": "s", "epoch": 0, "index": 0, "offset": 2}, "offset is 2"),
                    ({**fresh, "stream": 5, "epoch": 0, "index": 0, "offset": 0}, "stream must be a string"),
                ]:
                    with pytest.raises(ValueError, match=needle):
                        consumer.load_state_dict(bad)
                first = next(iter(consumer))
                assert first.tolist() == [0, 1, 2, 3]
                with pytest.raises(ValueError, match="must come before"):
                    consumer.load_state_dict(consumer.state_dict())


@pytest.mark.parametrize("more", [4, 6], ids=["same-epoch", "into-the-next-epoch"])
def test_a_position_the_producer_no_longer_has_is_missed_and_counted(name, caplog, more):
    with Producer(Ids(), name=name, slots=2, replay=0) as producer:
        with serving(producer, epochs=2):
            with Consumer(name=name, label="ahead") as ahead:
                it = iter(ahead)
                for _ in range(2):
                    next(it)
                saved = ahead.state_dict()  # at batch 2 of epoch 0
                assert (saved["epoch"], saved["index"]) == (0, 2)
                for _ in range(more):
                    next(it)  # batches 2.. taken and dropped: with replay=0 they are gone
            with Consumer(name=name, late_join="now", label="restored") as restored:
                restored.load_state_dict(saved)
                batch = next(iter(restored), None)  # the rest of epoch 0: maybe nothing, only its end
                if batch is None:
                    batch = next(iter(restored))
                now = restored.state_dict()  # after its first batch: where it went on
                start = now["epoch"] * BATCHES + now["index"] - 1  # (maybe in the next epoch)
                assert batch[0].item() // ROWS == start % BATCHES
                assert start > 2 and restored.missed == start - 2
                assert "no longer has" in caplog.text and f"{start - 2} batches missed" in caplog.text
                del batch


def test_a_state_whose_offset_is_past_its_batch_is_refused_by_name(name):
    """A re-cutting consumer's state names a sample offset in a producer batch, which only the
    batch's arrival can check: past its end (a state edited, or from another loader on a
    stream of the same id), next() says so instead of failing deep in the re-cut."""
    with Producer(Ids(), name=name, slots=2) as producer:
        with serving(producer, epochs=1):
            with Consumer(name=name, batch_size=3) as first:
                next(iter(first))  # 3 of batch 0's 4 samples
                saved = first.state_dict()
            assert (saved["epoch"], saved["index"], saved["offset"]) == (0, 0, 3)
            with Consumer(name=name, batch_size=3) as restored:
                restored.load_state_dict({**saved, "offset": ROWS + 1})
                with pytest.raises(ValueError, match="is 5 samples into batch 0 of epoch 0, which has 4"):
                    next(iter(restored))


def test_a_state_from_another_stream_joins_as_a_late_joiner(name, caplog):
    with Producer(Ids(), name=name, slots=2) as producer:
        with serving(producer, epochs=1):
            with Consumer(name=name) as consumer:
                next(iter(consumer))
                saved = consumer.state_dict()
    with Producer(Ids(), name=name, slots=2) as producer:  # a new producer: a new stream
        with serving(producer, epochs=1):
            with Consumer(name=name) as consumer:
                consumer.load_state_dict(saved)
                assert next(iter(consumer)).tolist() == [0, 1, 2, 3]  # this stream, from its start
                assert "saved on another stream" in caplog.text and consumer.missed is None


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "one-loads-before-the-other-joins"])
def test_a_restored_group_resumes_together(name, stagger):
    """Both ranks save their state after 2 steps and stop (as a job killed after a
    checkpoint); the restarted ranks construct, load and iterate, in any order. (Two epochs
    served: releasing what they held as they left, the first ranks may let the producer
    publish the rest of the first epoch before they are gone; its end must not end the stream.)"""
    with Producer(Ids(), name=name, slots=2) as producer:
        with serving(producer, epochs=2):
            states: dict[int, Any] = {}
            seen: dict[tuple[int, int], list[int]] = {}
            saved = threading.Barrier(2, timeout=30)  # neither leaves (breaking the group) before both saved
            loaded = threading.Event()

            def life(rank: int, life: int, steps: int | None) -> None:
                if life and stagger and rank == 1:
                    loaded.wait(30)  # rank 0 constructed and loaded before rank 1 even joins
                with Consumer(name=name, group="job", rank=rank, world_size=2, label=f"{rank}/{life}") as c:
                    if life:
                        c.load_state_dict(states[rank])
                        loaded.set()
                    got = []
                    for batch in c:
                        got.append(batch[0].item() // ROWS)
                        if steps is not None and len(got) == steps:
                            states[rank] = c.state_dict()
                            del batch
                            saved.wait()
                            break
                    seen[rank, life] = got

            for life_number, steps in ((0, 2), (1, None)):
                threads = [threading.Thread(target=life, args=(r, life_number, steps)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=30)
    assert seen[0, 0] + seen[0, 1] == [0, 2, 4, 6] and seen[1, 0] + seen[1, 1] == [1, 3, 5, 7]


# ---------------------------------------------------------------------- Lightning


def _fit(name: str, ckpt_dir: str, resume: str | None, crash_at: int | None, out: Any) -> None:
    import lightning as L

    seen: list[int] = []

    class Crash(Exception):
        pass

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(ROWS, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            seen.append(int(batch[0]) // ROWS)
            if crash_at is not None and len(seen) == crash_at:
                raise Crash
            return self.layer(batch.float()).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[checkpoints],
    )  # fmt: skip
    try:
        with Consumer(name=name) as consumer:
            trainer.fit(Model(), train_dataloaders=consumer, ckpt_path=resume)
    except Crash:
        pass
    out.put(seen)


def test_lightning_resumes_mid_epoch_from_its_checkpoint_exactly(name, tmp_path):
    pytest.importorskip("lightning")
    out = SPAWN.Queue()
    ckpt = str(tmp_path / "ckpt")
    with Producer(Ids(), name=name, slots=2) as producer:
        with serving(producer, epochs=None):  # a daemon: the trainer restarts under it
            p = SPAWN.Process(target=_fit, args=(name, ckpt, None, 5, out))
            p.start()
            before = out.get(timeout=120)
            p.join(timeout=30)
            last = os.path.join(ckpt, "epoch=0-step=3.ckpt")
            wait_until(lambda: os.path.exists(last), 5, "the checkpoint")
            p = SPAWN.Process(target=_fit, args=(name, ckpt, last, None, out))
            p.start()
            after = out.get(timeout=120)
            p.join(timeout=30)
    assert before == [0, 1, 2, 3, 4]  # it crashed at its 5th step; the checkpoint is after step 3
    assert before[:3] + after == list(range(BATCHES)) * 2  # one uninterrupted run of 2 epochs


def test_a_re_cut_state_saved_after_its_short_last_batch_resumes_at_that_epochs_end(name):
    """A re-cut epoch whose last batch is short: the re-cut reads the epoch's end to make that
    batch, but a state saved after it (still inside the loop, as a checkpoint callback saves
    it) is the end of that epoch, as without a re-cut: the first ``for`` of the restored
    trainer yields nothing (the rest of that epoch), the next one the next epoch."""
    size = 3
    assert BATCHES * ROWS % size  # (a short last batch)
    with Producer(Ids(), name=name, slots=2) as producer:  # default replay keeps the epoch
        with serving(producer, epochs=2):
            with Consumer(name=name, batch_size=size, label="first") as first:
                taken = 0
                for batch in first:
                    taken += len(batch)
                    saved = first.state_dict()
                    del batch
                assert taken == BATCHES * ROWS
            assert (saved["epoch"], saved["index"], saved["offset"]) == (0, BATCHES, 0)
            with Consumer(name=name, batch_size=size, label="restored") as restored:
                restored.load_state_dict(saved)
                assert [b.tolist() for b in restored] == []  # the rest of epoch 0
                assert [i for b in restored for i in b.tolist()] == list(range(BATCHES * ROWS))  # epoch 1


def test_a_consumer_restored_after_the_last_epoch_was_published_says_what_it_missed(name, caplog):
    """Restored while the stream was still open (another consumer not yet sent its end) but
    after the last epoch was published: it got nothing and said nothing (``missed`` None, no
    log: 14 batches lost in silence, the exactness audit's case). The stream's end now counts
    as where it went on: the rest of its run is counted and logged as missed."""
    producer = Producer(Ids(), name=name, slots=2, replay=0, min_consumers=2)

    def publish() -> None:
        for _ in range(2):
            for _ in producer:
                pass
        joined = lambda: any(c["label"] == "restored" for c in producer.status()["consumers"])  # noqa: E731
        wait_until(joined, 30, "the restored consumer to join")
        producer.close()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    with Consumer(name=name, label="leader") as leader:
        with Consumer(name=name, label="saver") as saver:
            it = iter(saver)
            next(it), next(it)
            saved = saver.state_dict()
            assert (saved["epoch"], saved["index"]) == (0, 2)
            del it
        assert sum(1 for _ in range(2) for _ in leader) == 2 * BATCHES
        with Consumer(name=name, label="restored") as restored:
            restored.load_state_dict(saved)
            assert list(restored) == [] and restored.finished
            assert restored.missed == 2 * BATCHES - 2
            assert "the stream ended before epoch 2" in caplog.text and "14 batches missed" in caplog.text
    thread.join(timeout=30)
