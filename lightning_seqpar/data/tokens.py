"""Pre-tokenised corpora: a flat binary file of token ids read through ``np.memmap``.

Note [Samples under sequence and data parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank of a sequence-parallel group must see the SAME full sequences (the strategy's batch
hook then keeps its shard); ranks of different data-parallel replicas must see different ones.
The datasets here are map-style with a fixed length, and sample ``i`` depends only on
``(seed, i)``. Lightning's sampler injection replaces the loader's sampler by a
``DistributedSampler`` built from the strategy's ``distributed_sampler_kwargs``
(num_replicas = DP size, rank = DP rank), so SP ranks of one replica draw the same indices and
replicas draw disjoint ones; the sampler reshuffles the order every epoch (``set_epoch``).
Labels are the next tokens of the FULL window (``window[1:]``), shifted before any sharding.

Note [A token file read with another dtype]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A flat file of ids carries no dtype: a uint32 file read as uint16 yields every id split in its two
halves (70000, 70001, 5 -> 4464, 1, 4465, 1, 5, 0) and trains. So when a dataset opens a file it
reads a sample (the first :data:`SAMPLE_TOKENS` ids) and refuses, naming the file and the dtype:

* with ``vocab_size`` (the model's): any id >= vocab_size;
* uint16: the ids at odd positions look like the high halves of uint32 ids (all 0 where the even
  ones are not, or all < 256 while >= 1% of the even ones are >= 256): one id distribution seen at
  even and odd positions alike is what a real uint16 file gives;
* uint32: an id >= 2^24 (no tokenizer has 16M ids; two uint16 ids read as one are that large).

``CausalLMModule`` checks the first batch's ids against the model's vocabulary as well, naming
the datamodule (``_check_vocabulary``).
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_seqpar.checks import ANY, AT_LEAST_ONE, NON_NEGATIVE, Range, check_options, check_ranges, option_hints
from lightning_seqpar.data.loaders import eval_loader, train_loader

__all__ = ["SAMPLE_TOKENS", "TOKEN_DTYPES", "TokenFileDataModule", "TokenWindowDataset", "check_token_sample", "make_example"]

TOKEN_DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}
"""Supported on-disk token dtypes: uint16 for vocabularies up to 65536 ids, uint32 above."""

SAMPLE_TOKENS = 1 << 16
"""The ids read from the start of a token file to check its dtype (Note [A token file read with another dtype])."""
_LARGEST_VOCABULARY = 1 << 24


def check_token_sample(path: str, dtype: str, *, vocab_size: int | None = None) -> None:
    """Refuse a token file whose first ids do not fit ``dtype`` or ``vocab_size`` (Note [A token file read with another
    dtype]); a ValueError naming the file."""
    np_dtype = _check_dtype(dtype)
    count = min(os.path.getsize(path) // np_dtype.itemsize, SAMPLE_TOKENS) // 2 * 2
    if count == 0:
        return
    sample = np.fromfile(path, dtype=np_dtype, count=count).astype(np.int64)
    largest = int(sample.max())
    if vocab_size is not None and largest >= vocab_size:
        raise ValueError(
            f"token file {path!r} (read as dtype={dtype!r}) holds id {largest} in its first {count} tokens, but vocab_size="
            f"{vocab_size}: was it written with another dtype{' (uint16?)' if dtype == 'uint32' else ' (uint32?)'} or for "
            "another tokenizer?"
        )
    even, odd = sample[0::2], sample[1::2]
    if dtype == "uint16" and count >= 64 and (
            (odd.max() == 0 and even.max() > 0) or (odd.max() < 256 and float((even >= 256).mean()) >= 0.01)):
        raise ValueError(
            f"token file {path!r} read as dtype='uint16' looks like a uint32 file: the ids at odd positions are all "
            f"{'0' if odd.max() == 0 else '< 256'} (the high halves of uint32 ids) while those at even positions are not; "
            "pass dtype='uint32' (or write the file with the dtype you read)"
        )
    if dtype == "uint32" and largest >= _LARGEST_VOCABULARY:
        raise ValueError(
            f"token file {path!r} read as dtype='uint32' holds id {largest} in its first {count} tokens, more than any "
            f"vocabulary (2^24 = {_LARGEST_VOCABULARY}): it looks like a uint16 file (two ids read as one); pass dtype='uint16'"
        )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_dtype(dtype: str) -> np.dtype:
    if not isinstance(dtype, str) or dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(TOKEN_DTYPES)}")
    return np.dtype(TOKEN_DTYPES[dtype])


def make_example(window: np.ndarray) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels", "position_ids"}`` (each LongTensor (S,)) from S + 1 consecutive tokens."""
    tokens = torch.from_numpy(window.astype(np.int64))
    seq_len = tokens.numel() - 1
    return {"input_ids": tokens[:-1], "labels": tokens[1:], "position_ids": torch.arange(seq_len)}


class TokenWindowDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens of a token file; item ``i`` is a dict of LongTensors (S,).

    Args:
        path: flat binary file of token ids.
        dtype: on-disk dtype of the ids.
        seq_len: S, the number of input tokens per sample.
        num_samples: with ``mode="random"``, the length of the dataset.
        seed: with ``mode="random"``, sample ``i`` starts at an offset drawn from ``(seed, i)``.
        mode: ``"random"``: windows at random offsets (training); ``"sequential"``: consecutive
            non-overlapping windows of the file, ``min(num_samples, available)`` of them (validation).
        vocab_size: the model's vocabulary: the file's first ids are checked against it (Note [A token file read with
            another dtype]); None checks them against the dtype only.
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike,
        dtype: Literal["uint16", "uint32"] = "uint16",
        seq_len: int,
        num_samples: int | None = None,
        seed: int = 0,
        mode: Literal["random", "sequential"] = "random",
        vocab_size: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.np_dtype = _check_dtype(dtype)
        _check_positive(seq_len=seq_len)
        if mode not in ("random", "sequential"):
            raise ValueError(f"mode={mode!r} is not supported; expected 'random' or 'sequential'")
        if not os.path.isfile(self.path):
            raise ValueError(f"token file path={self.path!r} does not exist")
        nbytes = os.path.getsize(self.path)
        if nbytes % self.np_dtype.itemsize:
            raise ValueError(
                f"token file {self.path!r} has {nbytes} bytes, not a multiple of {self.np_dtype.itemsize} "
                f"(dtype={dtype!r}); was it written with another dtype?"
            )
        self.num_tokens = nbytes // self.np_dtype.itemsize
        check_token_sample(self.path, dtype, vocab_size=vocab_size)
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} is too long for {self.path!r}: a sample needs seq_len + 1 = {seq_len + 1} "
                f"tokens and the file holds {self.num_tokens}"
            )
        self.seq_len = seq_len
        if mode == "random":
            if num_samples is None:
                raise ValueError("num_samples is required with mode='random'")
            _check_positive(num_samples=num_samples)
            # Offsets depend only on (seed, i): every rank computes the same table.
            rng = np.random.default_rng(seed)
            self.offsets = rng.integers(0, self.num_tokens - seq_len, size=num_samples, dtype=np.int64)
        else:
            available = (self.num_tokens - 1) // seq_len
            n = available if num_samples is None else min(num_samples, available)
            self.offsets = np.arange(n, dtype=np.int64) * seq_len
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:  # opened lazily, once per worker process
            self._tokens = np.memmap(self.path, dtype=self.np_dtype, mode="r")
        start = int(self.offsets[index])
        return make_example(np.asarray(self._tokens[start : start + self.seq_len + 1]))

    def __getstate__(self) -> dict:
        # Pickling a memmap would copy the whole file into each worker: reopen it there instead.
        return {**self.__dict__, "_tokens": None}


class TokenFileDataModule(L.LightningDataModule):
    """Random windows of a pre-tokenised file for training, fixed windows of another for validation.

    Batches are ``{"input_ids", "labels", "position_ids"}``, LongTensors (B, S), with
    ``labels = next tokens`` and ``position_ids = arange(S)``
    (Note [Samples under sequence and data parallelism]).

    Args:
        train_path: flat binary file of token ids (e.g. written with ``np.ndarray.tofile``).
        val_path: the same for validation; no validation when None.
        dtype: on-disk dtype of the token ids, "uint16" (vocabularies <= 65536) or "uint32".
        seq_len: S, input tokens per sample (each sample reads S + 1 tokens).
        batch_size: samples per batch on each data-parallel replica.
        num_workers: DataLoader worker processes.
        seed: seed of the training window offsets and of the single-process shuffle.
        samples_per_epoch: number of training windows (the length of an epoch).
        val_samples: at most this many validation windows (all consecutive windows when None).
        vocab_size: the model's vocabulary size: the files' first ids are checked against it when they are opened
            (Note [A token file read with another dtype]); None: against the dtype only (``CausalLMModule`` still
            checks the first batch against the model).
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "seq_len": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE, "num_workers": NON_NEGATIVE, "seed": ANY,
        "samples_per_epoch": AT_LEAST_ONE, "val_samples": AT_LEAST_ONE, "vocab_size": AT_LEAST_ONE,
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __init__(
        self,
        *,
        train_path: str,
        val_path: str | None = None,
        dtype: Literal["uint16", "uint32"] = "uint16",
        seq_len: int,
        batch_size: int,
        num_workers: int = 0,
        seed: int = 0,
        samples_per_epoch: int = 10_000,
        val_samples: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        values = {k: v for k, v in locals().items() if k in option_hints(TokenFileDataModule)}  # every argument
        _check_dtype(dtype)
        check_options(values, option_hints(TokenFileDataModule), owner=type(self).__name__)  # types, finite numbers (ranges: below)
        _check_positive(seq_len=seq_len, batch_size=batch_size, samples_per_epoch=samples_per_epoch)
        if val_samples is not None:
            _check_positive(val_samples=val_samples)
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        check_ranges(values, self.option_ranges, owner=type(self).__name__)
        self.save_hyperparameters()
        self.train_path, self.val_path, self.dtype = train_path, val_path, dtype
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.seed, self.samples_per_epoch, self.val_samples = seed, samples_per_epoch, val_samples
        self.vocab_size = vocab_size
        self.train_dataset: TokenWindowDataset | None = None
        self.val_dataset: TokenWindowDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Open the files (checks their sizes against ``seq_len``)."""
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = TokenWindowDataset(
                path=self.train_path, dtype=self.dtype, seq_len=self.seq_len,
                num_samples=self.samples_per_epoch, seed=self.seed, mode="random", vocab_size=self.vocab_size,
            )
        if self.val_dataset is None and self.val_path is not None and stage in (None, "fit", "validate"):
            self.val_dataset = TokenWindowDataset(
                path=self.val_path, dtype=self.dtype, seq_len=self.seq_len,
                num_samples=self.val_samples, mode="sequential", vocab_size=self.vocab_size,
            )

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        return train_loader(self.train_dataset, batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_path is None:
            return []
        if self.val_dataset is None:
            self.setup("validate")
        return eval_loader(self.val_dataset, batch_size=self.batch_size, num_workers=self.num_workers)
