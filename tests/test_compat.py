"""The upstream-compatible aliases: ``TensorProducer(loader, port)`` and
``TensorConsumer(port)`` used exactly as the upstream tensorsocket 0.0.5 examples do."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch

from tensorsocket import Producer, TensorConsumer, TensorProducer
from tests.support import NestedLoader, expected_batch, free_port, join_or_fail, same

EPOCHS = 2


def upstream_producer_loop(producer: TensorProducer, epochs: int, errors: list[BaseException]) -> None:
    """The upstream producer script: iterate the producer once per epoch, then join()."""
    try:
        for _ in range(epochs):
            for _ in producer:
                pass
        producer.join()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("as_str", [False, True], ids=["int-port", "str-port"])
def test_upstream_usage_pattern_two_epochs_exact(as_str):
    batches = 5
    port: Any = free_port()
    if as_str:
        port = str(port)
    producer = TensorProducer(NestedLoader(batches), port)
    assert isinstance(producer, Producer) and producer.endpoint == f"tcp://127.0.0.1:{int(port)}"
    errors: list[BaseException] = []
    thread = threading.Thread(target=upstream_producer_loop, args=(producer, EPOCHS, errors), name="producer")
    consumer = None
    try:
        consumer = TensorConsumer(port)
        thread.start()
        seen = []
        for epoch in range(EPOCHS):
            for index, batch in enumerate(consumer):
                assert same(batch, expected_batch(index, batches)), (epoch, index)
                seen.append((epoch, index))
                del batch
        assert seen == [(e, i) for e in range(EPOCHS) for i in range(batches)]
        join_or_fail(thread)
        assert errors == []
        assert list(consumer) == [] and consumer.finished
    finally:
        if consumer is not None:
            consumer.close()
        producer.close()
        thread.join(10)


def test_upstream_positional_arguments_are_accepted():
    port, ack_port = free_port(), free_port()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted arguments that change nothing do not warn
        producer = TensorProducer(NestedLoader(2), str(port), str(ack_port), rubber_band_pct=0.02)
    try:
        assert producer.endpoint == f"tcp://127.0.0.1:{port}"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            consumer = TensorConsumer(str(port), str(ack_port), timeout=10)
        consumer.close()
    finally:
        producer.close()


def test_batch_size_recuts_as_upstream_does():
    port = free_port()
    loader = [(torch.arange(16).view(8, 2), torch.arange(8)), (torch.arange(6).view(3, 2), torch.arange(3))]
    producer = TensorProducer(loader, port)
    errors: list[BaseException] = []
    thread = threading.Thread(target=upstream_producer_loop, args=(producer, 1, errors), name="producer")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            consumer = TensorConsumer(port, batch_size=3, timeout=10)
        thread.start()
        try:
            assert len(consumer) == 4
            batches = [batch[1].tolist() for batch in consumer]  # producer batches of 8 and 3 rows
            assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2]] and errors == []
        finally:
            consumer.close()
    finally:
        producer.close()
        thread.join(10)


@pytest.mark.parametrize("port", ["abc", "", None, 0, -1, 65536, "70000", 1.5j])
def test_bad_port_raises_value_error(port):
    with pytest.raises(ValueError, match="port"):
        TensorProducer(NestedLoader(2), port)
    with pytest.raises(ValueError, match="port"):
        TensorConsumer(port)
