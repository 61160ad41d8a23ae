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


class FileSplitLoaders:
    """``train_dataloader`` / ``val_dataloader`` of a datamodule whose ``setup`` builds ``train_dataset``
    and (when ``val_files`` is given) ``val_dataset``, with ``batch_size``, ``seed`` and ``num_workers``."""

    train_dataset: Dataset | None
    val_dataset: Dataset | None
    val_files: object
    batch_size: int
    seed: int
    num_workers: int

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return train_loader(self.train_dataset, batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_files is None:
            return []
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        return eval_loader(self.val_dataset, batch_size=self.batch_size, num_workers=self.num_workers)
