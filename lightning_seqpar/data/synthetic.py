"""A synthetic long-range task: the loss falls only if attention reaches across sequence shards.

Note [Copy task]
~~~~~~~~~~~~~~~~
Sample ``i`` draws h = S/2 random tokens r from ``(seed, i)`` and repeats them:

    tokens  = r_0 ... r_{h-1} | r_0 ... r_{h-1} | r_0          (S + 1 tokens, t_j = r_{j mod h})
    inputs  = tokens[:-1]                                      (S)
    labels  = tokens[1:]                                       (S, shifted on the full sequence)

The first half is noise (loss log V at best); from position h - 1 on, the next token is the
token h positions back. With ``supervise="second_half"`` the labels of positions < h - 1 are
ignored (-100), so the only learnable signal is copying over a distance of S/2 tokens: under
sequence parallelism (contiguous or zigzag layout) that distance always crosses ranks, and the
loss falls below log V only if the distributed attention is right.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_seqpar.checks import ANY, AT_LEAST_ONE, NON_NEGATIVE, Range, check_options, check_ranges, option_hints
from lightning_seqpar.data.loaders import eval_loader, train_loader

from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX

__all__ = ["CopyTaskDataset", "LongRangeDataModule"]


class CopyTaskDataset(Dataset):
    """Map-style dataset of the copy task (Note [Copy task]); item ``i`` depends only on ``(seed, i)``.

    Args:
        vocab_size: token ids are drawn from [0, vocab_size).
        seq_len: S, input tokens per sample; even.
        num_samples: length of the dataset.
        seed: seed of the random halves.
        supervise: "second_half": labels only where the next token is a copy; "all": every label.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        num_samples: int,
        seed: int = 0,
        supervise: Literal["second_half", "all"] = "second_half",
    ) -> None:
        _check_args(vocab_size=vocab_size, seq_len=seq_len, supervise=supervise)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed, self.supervise = seed, supervise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        half = self.seq_len // 2
        rng = np.random.default_rng([self.seed, index])
        r = torch.from_numpy(rng.integers(0, self.vocab_size, size=half, dtype=np.int64))
        tokens = r[torch.arange(self.seq_len + 1) % half]  # (S + 1,), t_j = r_{j mod h}
        labels = tokens[1:].clone()
        if self.supervise == "second_half":
            labels[: half - 1] = IGNORE_INDEX
        return {"input_ids": tokens[:-1], "labels": labels, "position_ids": torch.arange(self.seq_len)}


def _check_args(*, vocab_size: int, seq_len: int, supervise: str) -> None:
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if seq_len < 2 or seq_len % 2:
        raise ValueError(f"seq_len must be even and >= 2 (the second half copies the first), got {seq_len}")
    if supervise not in ("second_half", "all"):
        raise ValueError(f"supervise={supervise!r} is not supported; expected 'second_half' or 'all'")


class LongRangeDataModule(L.LightningDataModule):
    """Copy task batches ``{"input_ids", "labels", "position_ids"}`` (LongTensors (B, S)); Note [Copy task].

    Args:
        vocab_size: token ids are drawn from [0, vocab_size); at most the model's vocabulary.
        seq_len: S, input tokens per sample; even.
        batch_size: samples per batch on each data-parallel replica.
        num_samples: training samples per epoch.
        val_samples: validation samples (a separate random stream); 0 for no validation.
        seed: seed of the samples and of the single-process shuffle.
        supervise: "second_half" (default): only the copied half has labels; "all": every token.
        num_workers: DataLoader worker processes.
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "vocab_size": Range(low=2), "seq_len": Range(low=2), "batch_size": AT_LEAST_ONE, "num_samples": AT_LEAST_ONE,
        "val_samples": NON_NEGATIVE, "seed": ANY, "num_workers": NON_NEGATIVE,
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        num_samples: int = 10_000,
        val_samples: int = 256,
        seed: int = 0,
        supervise: Literal["second_half", "all"] = "second_half",
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        values = {k: v for k, v in locals().items() if k in option_hints(LongRangeDataModule)}  # every argument
        check_options(values, option_hints(LongRangeDataModule), owner=type(self).__name__)  # types, finite numbers (ranges: below)
        _check_args(vocab_size=vocab_size, seq_len=seq_len, supervise=supervise)
        if batch_size < 1 or num_samples < 1:
            raise ValueError(f"batch_size ({batch_size}) and num_samples ({num_samples}) must be >= 1")
        if val_samples < 0 or num_workers < 0:
            raise ValueError(f"val_samples ({val_samples}) and num_workers ({num_workers}) must be >= 0")
        check_ranges(values, self.option_ranges, owner=type(self).__name__)
        self.save_hyperparameters()
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.num_samples, self.val_samples, self.seed = num_samples, val_samples, seed
        self.supervise, self.num_workers = supervise, num_workers

    def _dataset(self, num_samples: int, stream: int) -> CopyTaskDataset:
        # Training and validation draw from different streams: seed -> (seed, stream).
        return CopyTaskDataset(
            vocab_size=self.vocab_size, seq_len=self.seq_len, num_samples=num_samples,
            seed=self.seed * 2 + stream, supervise=self.supervise,
        )

    def train_dataloader(self) -> DataLoader:
        return train_loader(self._dataset(self.num_samples, 0), batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_samples == 0:
            return []
        return eval_loader(self._dataset(self.val_samples, 1), batch_size=self.batch_size, num_workers=self.num_workers)
