"""The DataLoaders every datamodule of the package builds.

Training: shuffled with a generator seeded by the datamodule's seed (Lightning swaps in a
DistributedSampler over the data-parallel ranks; all ranks of one sequence-parallel group then read
the same samples), last partial batch dropped. Evaluation: in order, nothing dropped.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset


def train_loader(dataset: Dataset, *, batch_size: int, seed: int, num_workers: int = 0) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def eval_loader(dataset: Dataset, *, batch_size: int, num_workers: int = 0) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, num_workers=num_workers)
