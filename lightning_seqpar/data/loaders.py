"""The DataLoaders every datamodule of the package builds.

Training: shuffled with a generator seeded by the datamodule's seed (Lightning swaps in a
DistributedSampler over the data-parallel ranks; all ranks of one sequence-parallel group then read
the same samples), last partial batch dropped. Evaluation: in order, nothing dropped.
"""

from __future__ import annotations

from collections.abc import Callable

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
    and (when ``val_files`` is given) ``val_dataset``, with ``batch_size``, ``seed`` and ``num_workers``.

    Without ``val_files`` the datamodule has no ``val_dataloader`` hook (the attribute is None): Lightning
    then runs no validation loop, rather than warning at every fit that the validation list is empty, and
    ``Trainer.validate`` says that there is no ``val_dataloader``. ``LightningDataModule.from_datasets``
    leaves out the hooks of the data it is not given the same way."""

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

    @property
    def val_dataloader(self) -> Callable[[], DataLoader] | None:  # type: ignore[override]
        """The validation loader hook; None without ``val_files`` (no validation)."""
        return None if self.val_files is None else self._val_loader

    def _val_loader(self) -> DataLoader:
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        return eval_loader(self.val_dataset, batch_size=self.batch_size, num_workers=self.num_workers)
