"""ResumableLoader on its own (one process): the position within the epoch survives a state_dict round trip."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_seqpar.data import ResumableLoader


def _loader(num_workers: int = 0, replicas: int = 1, batch_size: int = 2) -> DataLoader:
    data = torch.arange(12)
    sampler = DistributedSampler(data, num_replicas=replicas, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers)


def _epoch(loader: ResumableLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_the_same_order(num_workers):
    full = ResumableLoader(_loader(num_workers))
    expected = _epoch(full, 0), _epoch(full, 1)
    stopped = ResumableLoader(_loader(num_workers))
    stopped.sampler.set_epoch(1)
    it = iter(stopped)
    seen = [next(it).tolist() for _ in range(2)]
    state = stopped.state_dict()
    assert state == {"batches": 2, "epoch": 1, "samples_per_batch": 2}
    resumed = ResumableLoader(_loader(num_workers))  # a fresh process: sampler at epoch 0
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]  # the sampler's epoch comes from the state
    assert seen + rest == expected[1]
    assert resumed.state_dict()["batches"] == len(resumed) == 6
    assert _epoch(resumed, 2) == _epoch(ResumableLoader(_loader(num_workers)), 2)  # later epochs: whole


def test_end_of_epoch_state_starts_the_next_epoch_whole():
    loader = ResumableLoader(_loader())
    loader.load_state_dict({"batches": 6, "epoch": 0, "samples_per_batch": 2})
    loader.sampler.set_epoch(1)
    assert [b.tolist() for b in loader] == _epoch(ResumableLoader(_loader()), 1)


def test_another_global_batch_cannot_resume_mid_epoch():
    loader = ResumableLoader(_loader(batch_size=3))
    loader.load_state_dict({"batches": 1, "epoch": 0, "samples_per_batch": 2})
    with pytest.raises(ValueError, match=r"global batch of 2 samples .* this run's global batch is 3"):
        iter(loader)


def test_iterables_without_a_sampler_are_skipped_by_reading():
    loader = ResumableLoader([torch.tensor([i]) for i in range(5)])
    loader.load_state_dict({"batches": 3, "epoch": None, "samples_per_batch": None})
    assert [int(b) for b in loader] == [3, 4]
    assert loader.state_dict() == {"batches": 5, "epoch": None, "samples_per_batch": None}
