"""Datamodules: batch format, shifted labels, determinism, DP sharding, the copy task, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_seqpar.data import CopyTaskDataset, LongRangeDataModule, TokenFileDataModule, TokenWindowDataset
from lightning_seqpar.loss import IGNORE_INDEX


def _write_tokens(path, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    high = 50_000 if dtype == "uint16" else 100_000  # uint32 ids beyond the uint16 range
    tokens = np.random.default_rng(seed).integers(0, high, size=n).astype(dtype)
    tokens.tofile(path)
    return tokens


def _check_batch(batch: dict, B: int, S: int) -> None:
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for value in batch.values():
        assert value.shape == (B, S) and value.dtype == torch.int64
    assert torch.equal(batch["position_ids"], torch.arange(S).expand(B, S))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_datamodule(tmp_path, dtype):
    tokens = _write_tokens(tmp_path / "train.bin", 1000, dtype)
    val = _write_tokens(tmp_path / "val.bin", 100, dtype, seed=1)
    dm = TokenFileDataModule(train_path=str(tmp_path / "train.bin"), val_path=str(tmp_path / "val.bin"), dtype=dtype,
                             seq_len=16, batch_size=4, seed=3, samples_per_epoch=20)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    _check_batch(batch, 4, 16)
    # Every sample is a window of the file; labels are the next tokens of the full window.
    windows = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(tokens, 17).astype(np.int64))
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        assert torch.equal(labels[:-1], ids[1:])
        assert (windows == torch.cat([ids, labels[-1:]])).all(dim=1).any()
    assert len(dm.train_dataloader()) == 5  # 20 samples / 4, drop_last
    # Validation: consecutive windows with stride seq_len, (100 - 1) // 16 = 6 of them.
    vbatches = list(dm.val_dataloader())
    assert sum(len(b["input_ids"]) for b in vbatches) == 6
    first = vbatches[0]
    assert torch.equal(first["input_ids"][1], torch.from_numpy(val[16:32].astype(np.int64)))
    assert torch.equal(first["labels"][1], torch.from_numpy(val[17:33].astype(np.int64)))


def test_token_windows_deterministic_and_dp_sharded(tmp_path):
    _write_tokens(tmp_path / "t.bin", 5000, "uint16")
    a = TokenWindowDataset(path=tmp_path / "t.bin", seq_len=32, num_samples=64, seed=7)
    b = TokenWindowDataset(path=tmp_path / "t.bin", seq_len=32, num_samples=64, seed=7)
    c = TokenWindowDataset(path=tmp_path / "t.bin", seq_len=32, num_samples=64, seed=8)
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(64))
    assert not all(torch.equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(64))
    # The samplers Lightning injects: SP ranks of one DP replica see the same indices, replicas disjoint ones.
    samplers = [DistributedSampler(a, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1, 0)]
    idx = [list(s) for s in samplers]
    assert idx[0] == idx[2] and not set(idx[0]) & set(idx[1]) and len(idx[0]) == 32


def test_token_file_dataloader_is_deterministic(tmp_path):
    _write_tokens(tmp_path / "t.bin", 5000, "uint16")

    def first_batches(seed: int):
        dm = TokenFileDataModule(train_path=str(tmp_path / "t.bin"), seq_len=8, batch_size=2, seed=seed,
                                 samples_per_epoch=8)
        return [b["input_ids"] for b in dm.train_dataloader()]

    assert all(torch.equal(x, y) for x, y in zip(first_batches(1), first_batches(1)))
    assert not all(torch.equal(x, y) for x, y in zip(first_batches(1), first_batches(2)))
    assert TokenFileDataModule(train_path=str(tmp_path / "t.bin"), seq_len=8, batch_size=2).val_dataloader() == []


def test_token_dataset_pickles_without_the_file(tmp_path):
    import pickle

    _write_tokens(tmp_path / "t.bin", 5000, "uint16")
    ds = TokenWindowDataset(path=tmp_path / "t.bin", seq_len=8, num_samples=4)
    ds[0]  # opens the memmap
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._tokens is None and torch.equal(clone[3]["labels"], ds[3]["labels"])


def test_token_file_bad_args(tmp_path):
    _write_tokens(tmp_path / "t.bin", 100, "uint16")
    path = str(tmp_path / "t.bin")
    too_long = "seq_len=100 is too long .* needs seq_len \\+ 1 = 101 tokens and the file holds 100"
    with pytest.raises(ValueError, match=too_long):
        TokenFileDataModule(train_path=path, seq_len=100, batch_size=2).setup("fit")
    with pytest.raises(ValueError, match="dtype='int8' is not supported; expected one of \\['uint16', 'uint32'\\]"):
        TokenFileDataModule(train_path=path, dtype="int8", seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TokenFileDataModule(train_path=path, seq_len=8, batch_size=0)
    with pytest.raises(ValueError, match="does not exist"):
        TokenWindowDataset(path=tmp_path / "missing.bin", seq_len=8, num_samples=4)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        TokenWindowDataset(path=tmp_path / "odd.bin", dtype="uint32", seq_len=1, num_samples=1)


@pytest.mark.parametrize("supervise", ["second_half", "all"])
def test_long_range_copy_task(supervise):
    S, V = 16, 11
    dm = LongRangeDataModule(vocab_size=V, seq_len=S, batch_size=4, num_samples=8, val_samples=4, seed=0,
                             supervise=supervise)
    batch = next(iter(dm.train_dataloader()))
    _check_batch(batch, 4, S)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.min() >= 0 and ids.max() < V
    h = S // 2
    assert torch.equal(ids[:, h:], ids[:, :h])  # the second half repeats the first
    valid = labels != IGNORE_INDEX
    # Labels are the next token of the full sequence: ids shifted, and the last one continues the copy.
    assert torch.equal(labels[:, :-1][valid[:, :-1]], ids[:, 1:][valid[:, :-1]])
    assert torch.equal(labels[:, -1], ids[:, 0])
    if supervise == "second_half":
        assert not valid[:, : h - 1].any() and valid[:, h - 1 :].all()
        # Every supervised target is the input token h positions earlier in the sequence.
        j = torch.arange(h - 1, S)
        assert torch.equal(labels[:, j], ids[:, j + 1 - h])
    else:
        assert valid.all()
    val = next(iter(dm.val_dataloader()))
    assert not torch.equal(val["input_ids"], batch["input_ids"])  # a separate stream


def test_copy_task_deterministic():
    a = CopyTaskDataset(vocab_size=50, seq_len=8, num_samples=4, seed=5)
    b = CopyTaskDataset(vocab_size=50, seq_len=8, num_samples=4, seed=5)
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(4))
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])
    with pytest.raises(IndexError):
        a[4]


def test_long_range_bad_args():
    with pytest.raises(ValueError, match="seq_len must be even"):
        LongRangeDataModule(vocab_size=10, seq_len=7, batch_size=1)
    with pytest.raises(ValueError, match="vocab_size must be >= 2"):
        LongRangeDataModule(vocab_size=1, seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="supervise='first_half' is not supported"):
        LongRangeDataModule(vocab_size=10, seq_len=8, batch_size=1, supervise="first_half")
    assert LongRangeDataModule(vocab_size=10, seq_len=8, batch_size=1, val_samples=0).val_dataloader() == []
