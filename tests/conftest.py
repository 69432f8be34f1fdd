import logging

import pytest
import torch

from tests.support import unique_name


@pytest.fixture
def name() -> str:
    """A producer name no other test uses."""
    return unique_name()


@pytest.fixture(autouse=True)
def _tensorsocket_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorsocket")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
