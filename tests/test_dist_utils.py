"""The multi-process test harness itself (dist_utils.py): a worker that dies from a signal is named."""

from __future__ import annotations

import pytest

from dist_utils import WorkerCrashed, run_distributed


def _abort_on_rank_1(rank: int, world_size: int) -> None:
    import os

    import torch.distributed as dist

    if rank == 1:
        os.abort()  # what glibc does on "free(): invalid size"
    dist.barrier()  # rank 0 waits for the dead rank: its error must not be what the test reports


def _ranks(rank: int, world_size: int) -> int:
    return rank


def _frozen(rank: int, world_size: int) -> tuple[int, bool]:
    import gc
    import sys

    return gc.get_freeze_count(), "lightning_seqpar" in sys.modules


def test_a_native_crash_is_reported_as_one():
    with pytest.raises(WorkerCrashed, match="worker rank 1 died from SIGABRT"):
        run_distributed(_abort_on_rank_1, 2, timeout=60, pool="crash")
    assert run_distributed(_ranks, 2, pool="crash") == [0, 1]  # a fresh pool after the crash
    # its workers froze what they imported at start (torch, Lightning, the package: ~450,000 objects),
    # which the collection after every task then skips
    for count, imported in run_distributed(_frozen, 2, pool="crash"):
        assert imported and count > 100_000, count


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("a Python error in a worker")


def test_a_python_error_is_not_a_crash():
    with pytest.raises(AssertionError, match="(?s)failed on rank 1:.*ValueError: a Python error in a worker") as info:
        run_distributed(_raise_on_rank_1, 2, pool="crash")
    assert not isinstance(info.value, WorkerCrashed)

