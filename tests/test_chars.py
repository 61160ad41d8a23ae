"""Character-level data in the enwik8 format: 90/5/5 byte splits, fixed windows, bits per character."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed

SEQ = 16


@pytest.fixture
def data_file(tmp_path):
    """2000 bytes covering all 256 values: byte j is (7 * j) % 256."""
    path = tmp_path / "enwik8-like"
    path.write_bytes(bytes((7 * j) % 256 for j in range(2000)))
    return path


def test_enwik8_split_is_90_5_5():
    from lightning_seqpar.data import char_splits

    assert char_splits(100_000_000) == {
        "train": (0, 90_000_000), "val": (90_000_000, 95_000_000), "test": (95_000_000, 100_000_000)}
    assert char_splits(2000) == {"train": (0, 1800), "val": (1800, 1900), "test": (1900, 2000)}
    assert char_splits(2019) == {"train": (0, 1819), "val": (1819, 1919), "test": (1919, 2019)}  # h = n // 20
    with pytest.raises(ValueError, match="num_bytes"):
        char_splits(-1)


def test_windows_are_fixed_shifted_and_inside_their_split(data_file):
    from lightning_seqpar.data import CharWindowDataset

    raw = torch.tensor(list(data_file.read_bytes()), dtype=torch.long)
    start, end = 1800, 1900
    ds = CharWindowDataset(path=data_file, seq_len=SEQ, start=start, end=end)
    assert len(ds) == (end - start - 1) // SEQ == 6
    for i in range(len(ds)):
        item = ds[i]
        offset = start + i * SEQ
        assert offset + SEQ + 1 <= end  # never crosses into the next split
        assert torch.equal(item["input_ids"], raw[offset : offset + SEQ])
        assert torch.equal(item["labels"], raw[offset + 1 : offset + SEQ + 1])  # shifted on the full window
        assert torch.equal(item["position_ids"], torch.arange(SEQ))
        assert item["input_ids"].dtype == torch.long
    # consecutive windows: every byte after the first is a label exactly once
    labels = torch.cat([ds[i]["labels"] for i in range(len(ds))])
    assert torch.equal(labels, raw[start + 1 : start + 1 + len(ds) * SEQ])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="end"):
        CharWindowDataset(path=data_file, seq_len=SEQ, start=0, end=5000)


def test_datamodule_batches(data_file):
    from lightning_seqpar.data import CharDataModule

    dm = CharDataModule(path=str(data_file), seq_len=SEQ, batch_size=4, seed=3)
    dm.setup("fit")
    assert {name: (ds.start, ds.end) for name, ds in dm.datasets.items()} == {
        "train": (0, 1800), "val": (1800, 1900), "test": (1900, 2000)}
    assert len(dm.datasets["train"]) == 1799 // SEQ
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (4, SEQ)
    assert batch["input_ids"].max() < 256 and batch["input_ids"].dtype == torch.long
    # training order is shuffled, reproducibly from the seed; validation and test are in file order
    again = next(iter(CharDataModule(path=str(data_file), seq_len=SEQ, batch_size=4, seed=3).train_dataloader()))
    assert torch.equal(batch["input_ids"], again["input_ids"])
    first_train = [dm.datasets["train"][i]["input_ids"] for i in range(4)]
    assert not torch.equal(batch["input_ids"], torch.stack(first_train))
    for name, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
        batches = list(loader)
        assert sum(len(b["input_ids"]) for b in batches) == len(dm.datasets[name]) == 99 // SEQ
        assert torch.equal(batches[0]["input_ids"][0], dm.datasets[name][0]["input_ids"])


def test_datamodule_errors(tmp_path, data_file):
    from lightning_seqpar.data import CharDataModule

    with pytest.raises(ValueError, match="does not exist"):
        CharDataModule(path=str(tmp_path / "enwik8"), seq_len=SEQ, batch_size=1).setup()
    with pytest.raises(ValueError, match="seq_len"):  # 5% of 2000 bytes holds no window of 129 bytes
        CharDataModule(path=str(data_file), seq_len=128, batch_size=1).setup()
    with pytest.raises(ValueError, match="batch_size"):
        CharDataModule(path=str(data_file), seq_len=SEQ, batch_size=0)


def test_bits_per_character_is_token_weighted_loss_over_ln2():
    from lightning_seqpar.data import BitsPerCharacter, bits_per_character
    from lightning_seqpar.loss import token_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 10, 256, generator=g), torch.randint(0, 256, (3, 10), generator=g)
    labels[2, 4:] = -100  # ignored tokens do not count
    metric = BitsPerCharacter()
    for i in range(3):  # batches with 10, 10 and 4 valid tokens
        metric.update(*token_cross_entropy_sum(logits[i], labels[i]))
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) / math.log(2)
    torch.testing.assert_close(metric.compute().float(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(bits_per_character(torch.tensor(math.log(2) * 1.25)), torch.tensor(1.25))
    with pytest.warns(UserWarning, match="before the ``update``"):  # torchmetrics' own warning
        assert BitsPerCharacter().compute() == 0  # no tokens: 0, not NaN


def _bpc_worker(rank: int, world: int) -> float:
    """Each rank holds one sequence shard (different token counts): the synced bpc is the global one."""
    from lightning_seqpar.data import BitsPerCharacter
    from lightning_seqpar.loss import token_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 12, 256, generator=g), torch.randint(0, 256, (2, 12), generator=g)
    labels[:, 9:] = -100  # the last shard has fewer valid tokens
    shard = slice(rank * 12 // world, (rank + 1) * 12 // world)
    metric = BitsPerCharacter()
    metric.update(*token_cross_entropy_sum(logits[:, shard], labels[:, shard]))
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) / math.log(2)
    torch.testing.assert_close(metric.compute().float(), expected, rtol=1e-6, atol=0)
    return float(metric.compute())


def test_bits_per_character_syncs_over_ranks():
    values = run_distributed(_bpc_worker, 2)
    assert values[0] == values[1]
