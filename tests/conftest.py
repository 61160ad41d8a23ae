import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import close_pools  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; recorded from runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_pools()
