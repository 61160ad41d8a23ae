import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import close_pools  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if config.pluginmanager.hasplugin("rerunfailures"):
        # A test whose gloo worker died from a signal (dist_utils.WorkerCrashed: a native crash, not
        # an assertion or a Python error) runs once more on a fresh pool; pytest reports the rerun.
        rerun = pytest.mark.flaky(reruns=1, only_rerun=["WorkerCrashed"])
        for item in items:
            item.add_marker(rerun)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; recorded from runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def nccl_world() -> int:
    """The NCCL world of a ``torchrun --nproc_per_node=N -m pytest`` run (GPU tests); skips elsewhere."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("needs CUDA and torchrun with WORLD_SIZE > 1")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    yield dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_pools()
