"""The GPU path under stress, on a real GPU only (``scripts/gpu.sh``; skipped without CUDA).

* Stream ordering: a consumer whose current stream is not the default one checks each batch
  with a kernel queued behind GPU work that makes it lag, with ``slots=2``, over 1,000
  rounds: every check must pass. The same run with the ordering disabled
  (``TENSORSOCKET_TEST_UNORDERED=release``) counts how many checks it breaks, to show the ordering
  is what makes them pass (recorded in the JUnit XML, not asserted: the hardware decides).
* The allocator's expandable segments on both sides, and ``CUDA_VISIBLE_DEVICES=GPU-<uuid>``.
* Batches made on the GPU by the loader (device-to-device writes).
* In-place write detection: no false positive over 10,000 batches, then a real write caught.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tensorsocket import BatchModified, Consumer, Producer
from tests.support import SPAWN, serving

pytestmark = pytest.mark.gpu
ROUNDS = 1000


class _Pattern:
    """Batch i: 1 MiB of bytes (i * 7 + k) % 251 and the index; on the host or the GPU."""

    def __init__(self, rounds: int, on_gpu: bool, nbytes: int = 1 << 20) -> None:
        self.rounds, self.on_gpu, self.nbytes = rounds, on_gpu, nbytes

    def __len__(self) -> int:
        return self.rounds

    def __iter__(self) -> Any:
        device = "cuda" if self.on_gpu else "cpu"
        base = torch.arange(self.nbytes, dtype=torch.int64, device=device)
        for i in range(self.rounds):
            yield ((base + i * 7) % 251).to(torch.uint8), torch.tensor([i], device=device)


def _check_on_side_stream(name: str, results: Any, env: dict[str, str], lag_cycles: int) -> None:
    os.environ.update(env)
    report: dict[str, Any] = {"error": None}
    try:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)  # a non-default current stream for every next()
        base = torch.arange(1 << 20, dtype=torch.int64, device="cuda")
        failures = torch.zeros((), dtype=torch.int64, device="cuda")
        rounds = 0
        with Consumer(name=name, device="cuda:0", timeout=30) as consumer:
            for data, index in consumer:
                torch.cuda._sleep(lag_cycles)  # the check runs well after next() returned
                expected = ((base + index * 7) % 251).to(torch.uint8)
                failures += (data != expected).any().to(torch.int64)
                rounds += 1
                del data, index
        torch.cuda.synchronize()
        report.update(rounds=rounds, failures=int(failures))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


def _run_stress(name: str, env: dict[str, str], on_gpu: bool, lag_cycles: int = 200_000) -> dict[str, Any]:
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_check_on_side_stream, args=(name, results, env, lag_cycles))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc.start()
        producer = Producer(_Pattern(ROUNDS, on_gpu), name=name, device="cuda:0", slots=2, replay=0)
        with serving(producer, epochs=1):
            report = results.get(timeout=240)
        proc.join(timeout=30)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return report


@pytest.mark.parametrize("source", ["host", "gpu"])
def test_stream_ordering_holds_over_1000_rounds_on_a_side_stream(name, source):
    report = _run_stress(name, {}, on_gpu=source == "gpu")
    assert report["error"] is None, report["error"]
    assert report["rounds"] == ROUNDS
    assert report["failures"] == 0


def test_stream_ordering_disabled_breaks_checks(name, record_property):
    report = _run_stress(name, {"TENSORSOCKET_TEST_UNORDERED": "release"}, on_gpu=False, lag_cycles=2_000_000)
    record_property("unordered_failures", report.get("failures"))
    record_property("unordered_rounds", report.get("rounds"))
    print(f"ordering disabled: {report}")
    assert report["error"] is None or "BatchModified" in report["error"], report["error"]


def test_expandable_segments_and_a_uuid_in_cuda_visible_devices(name):
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": uuid}
    report = _run_stress(name, env, on_gpu=False)
    assert report["error"] is None, report["error"]
    assert report["rounds"] == ROUNDS and report["failures"] == 0


def _read_many_then_write(name: str, results: Any, batches: int) -> None:
    report: dict[str, Any] = {"false_positives": 0, "caught": False, "taken": 0}
    with Consumer(name=name, device="cuda:0", timeout=30) as consumer:
        it = iter(consumer)
        while True:
            try:
                data, index = next(it)
            except StopIteration:
                break
            except BatchModified:
                if report["taken"] < batches - 20:
                    report["false_positives"] += 1
                else:
                    report["caught"] = True
                continue
            _ = (data.float() * 0.5).sum()  # read only
            if report["taken"] == batches - 20:
                data.add_(1)  # in place: must be reported
            report["taken"] += 1
            del data, index
    results.put(report)


def test_in_place_writes_no_false_positive_over_10000_batches_then_one_caught(name):
    batches = 10_000
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_read_many_then_write, args=(name, results, batches))
    proc.start()
    producer = Producer(_Pattern(batches, False, nbytes=64 << 10), name=name, device="cuda:0", slots=4)
    with serving(producer, epochs=1):
        report = results.get(timeout=240)
    proc.join(timeout=30)
    assert report["taken"] == batches
    assert report["false_positives"] == 0
    assert report["caught"] is True
