"""Character-level text in the enwik8 format: one file read as bytes (vocabulary 256).

Note [enwik8 splits and windows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
enwik8 is the first 10^8 bytes of an English Wikipedia XML dump (LSS Transformer: Wang et al.,
arXiv:2311.02382, §5.1).
Its standard split (Transformer-XL's ``prep_enwik8.py``, as in Al-Rfou et al. 2019) is
90M / 5M / 5M bytes: the last 10M bytes are held out, 5M for validation and then 5M for test. A
file of n bytes is split in the same proportions, h = n // 20 bytes each (h = 5M for enwik8):

    | train: [0, n - 2h) | validation: [n - 2h, n - h) | test: [n - h, n) |

Each split is cut into fixed windows of seq_len + 1 bytes at stride seq_len (window i starts at
i * seq_len): the inputs are its first seq_len bytes and the labels its last seq_len, shifted on
the full window before any sharding, so every byte of a split but the first is a label exactly
once. No window crosses a split boundary; a tail shorter than a window is left out. Batches are
``{"input_ids", "labels", "position_ids"}`` as for every datamodule of ``lightning_seqpar.data``
(Note [Samples under sequence and data parallelism] in ``tokens.py``).

Bits per character = cross entropy in nats per byte / ln 2 (enwik8 counts bytes as characters):
:class:`BitsPerCharacter` accumulates token-loss sums and counts, so a rank's sequence shard and a
data-parallel replica's batches add up to the bpc of every token.
"""

from __future__ import annotations

import math
import os
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from lightning_seqpar.data.loaders import eval_loader, train_loader
from torchmetrics import Metric

from lightning_seqpar.checks import ANY, AT_LEAST_ONE, NON_NEGATIVE, Range, check_options, check_ranges, option_hints
from lightning_seqpar.data.tokens import make_example

__all__ = ["BitsPerCharacter", "CharDataModule", "CharWindowDataset", "bits_per_character", "char_splits"]

SPLITS: tuple[str, ...] = ("train", "val", "test")


def char_splits(num_bytes: int) -> dict[str, tuple[int, int]]:
    """Byte ranges ``[start, end)`` of the train / val / test splits of a file of ``num_bytes`` bytes
    (Note [enwik8 splits and windows]): enwik8's 10^8 bytes give 90M / 5M / 5M."""
    if not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}")
    held_out = num_bytes // 20
    return {"train": (0, num_bytes - 2 * held_out), "val": (num_bytes - 2 * held_out, num_bytes - held_out),
            "test": (num_bytes - held_out, num_bytes)}


def bits_per_character(loss: torch.Tensor | float) -> torch.Tensor | float:
    """Bits per character of a mean cross entropy ``loss`` in nats per byte: ``loss / ln 2``."""
    return loss / math.log(2)


class CharWindowDataset(Dataset):
    """Fixed windows of ``seq_len + 1`` bytes of ``path[start:end]``; item ``i`` is a dict of LongTensors (S,).

    Args:
        path: any file, read as raw bytes (token ids 0..255).
        seq_len: S, input bytes per sample; windows start every S bytes.
        start, end: the byte range to cut (``end=None``: the end of the file).
    """

    def __init__(self, *, path: str | os.PathLike, seq_len: int, start: int = 0, end: int | None = None) -> None:
        self.path = os.fspath(path)
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not os.path.isfile(self.path):
            raise ValueError(f"text file path={self.path!r} does not exist")
        size = os.path.getsize(self.path)
        end = size if end is None else end
        if not 0 <= start <= end <= size:
            raise ValueError(
                f"byte range start={start}, end={end} must satisfy 0 <= start <= end <= {size} (the size of {self.path!r})"
            )
        self.seq_len, self.start, self.end = seq_len, start, end
        self.num_windows = max(0, (end - start - 1) // seq_len)
        self._bytes: np.memmap | None = None

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"index {index} out of range for {self.num_windows} windows")
        if self._bytes is None:  # opened lazily, once per worker process
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r")
        offset = self.start + index * self.seq_len
        return make_example(np.asarray(self._bytes[offset : offset + self.seq_len + 1]))

    def __getstate__(self) -> dict:
        # Pickling a memmap would copy the whole file into each worker: reopen it there instead.
        return {**self.__dict__, "_bytes": None}


class CharDataModule(L.LightningDataModule):
    """Character-level language modelling on one local file (enwik8 or any text), 90/5/5 split.

    Batches are ``{"input_ids", "labels", "position_ids"}``, LongTensors (B, S), from fixed
    windows of each split (Note [enwik8 splits and windows]). Training windows are shuffled
    (under the strategy, Lightning's ``DistributedSampler`` over the data-parallel ranks);
    validation and test windows are read in order, all of them.

    enwik8 is not downloaded: pass the path of the unzipped file (100,000,000 bytes, from
    https://mattmahoney.net/dc/enwik8.zip).

    Args:
        path: the text file, read as bytes; vocabulary 256.
        seq_len: S, input bytes per sample (each window reads S + 1 bytes).
        batch_size: samples per batch on each data-parallel replica.
        num_workers: DataLoader worker processes.
        seed: seed of the single-process shuffle.
    """

    option_ranges: ClassVar[dict[str, Range]] = {"seq_len": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE, "num_workers": NON_NEGATIVE,
                                                 "seed": ANY}
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __init__(self, *, path: str, seq_len: int, batch_size: int, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        values = {k: v for k, v in locals().items() if k in option_hints(CharDataModule)}  # every argument
        check_options(values, option_hints(CharDataModule), owner=type(self).__name__)  # types, finite numbers (ranges: below)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        check_ranges(values, self.option_ranges, owner=type(self).__name__)
        self.save_hyperparameters()
        self.path, self.seq_len, self.batch_size, self.num_workers, self.seed = path, seq_len, batch_size, num_workers, seed
        self.datasets: dict[str, CharWindowDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        """Split the file and cut the windows; ValueError if a split holds no window of S + 1 bytes."""
        if self.datasets:
            return
        if not os.path.isfile(self.path):
            raise ValueError(f"CharDataModule: path={self.path!r} does not exist (enwik8 is not downloaded: give a local file)")
        ranges = char_splits(os.path.getsize(self.path))
        datasets = {
            name: CharWindowDataset(path=self.path, seq_len=self.seq_len, start=a, end=b) for name, (a, b) in ranges.items()
        }
        empty = [name for name, ds in datasets.items() if len(ds) == 0]
        if empty:
            raise ValueError(
                f"CharDataModule: the {'/'.join(empty)} split of {self.path!r} ({os.path.getsize(self.path)} bytes; "
                f"validation and test get 5% each) is shorter than one window of seq_len + 1 = {self.seq_len + 1} bytes; "
                f"use a file of at least {20 * (self.seq_len + 1)} bytes or a smaller seq_len"
            )
        self.datasets = datasets

    def _loader(self, split: str, *, train: bool = False) -> DataLoader:
        self.setup()
        if train:
            return train_loader(self.datasets[split], batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers)
        return eval_loader(self.datasets[split], batch_size=self.batch_size, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


class BitsPerCharacter(Metric):
    """Bits per character over every token seen: ``sum of token losses / token count / ln 2``.

    ``update(loss_sum, n_tokens)`` takes a rank's sum of token cross entropies (nats) and its
    number of valid tokens, e.g. ``lightning_seqpar.loss.token_cross_entropy_sum``; the states are
    summed over all processes on ``compute``, so the shards of a sequence-parallel group and the
    batches of data-parallel replicas weigh by their token counts (not one mean per rank).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor | int) -> None:
        self.loss_sum += loss_sum.detach().to(self.loss_sum.device, torch.float64).sum()
        self.count += torch.as_tensor(n_tokens, device=self.count.device).to(torch.int64).sum()

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.count.clamp(min=1)) / math.log(2)
