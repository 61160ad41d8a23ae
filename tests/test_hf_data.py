"""HFTextDataModule: local text / jsonl / parquet through `datasets`, a local tokenizer, packed documents."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import fit_on_text, save_tiny_model, tiny_tokenizer  # noqa: E402

from lightning_seqpar.data import HFTextDataModule, PackedDocumentDataset  # noqa: E402
from lightning_seqpar.data.hf_text import pack_window  # noqa: E402

WORDS = "the cat sat on a mat while dog ran far away from home and then came back to sleep".split()


def _documents(n: int = 12, seed: int = 0) -> list[str]:
    """Mixed lengths: one-word documents, short ones, and one longer than several windows."""
    rng = np.random.default_rng(seed)
    lengths = [1, 3, 1, 40, 2, 7, 1, 12, 5, 1, 9, 4][:n]
    return [" ".join(rng.choice(WORDS, size=k)) for k in lengths]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-text")
    docs = _documents()
    tokenizer = tiny_tokenizer(docs + [" ".join(WORDS)], str(root / "tokenizer"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return root, docs, tokenizer


def _module(root, tokenizer, files, **kwargs):
    return HFTextDataModule(train_files=files, tokenizer_path=tokenizer, seq_len=kwargs.pop("seq_len", 8), batch_size=2,
                            cache_dir=str(root / "cache"), **kwargs)


def test_pack_window():
    docs = [np.array([10, 11, 12]), np.array([20]), np.array([], dtype=np.int64), np.array([30, 31, 32, 33, 34])]
    out = {k: v.tolist() for k, v in pack_window(docs, offset=1, seq_len=6).items()}
    assert out == {
        "input_ids": [11, 12, 20, 30, 31, 32],
        "labels": [12, -100, -100, 31, 32, 33],  # no prediction across a document boundary
        "position_ids": [0, 1, 2, 3, 4, 5],  # global positions
        "document_ids": [0, 0, 1, 2, 2, 2],
        "document_position_ids": [0, 1, 0, 0, 1, 2],  # a continued document restarts at the window start
    }
    with pytest.raises(ValueError, match="needs 11"):
        pack_window(docs, offset=4, seq_len=6)


def test_windows_cover_the_stream_with_boundaries(corpus):
    root, docs, tokenizer_path = corpus
    dm = _module(root, tokenizer_path, str(root / "docs.jsonl"))
    dm.prepare_data()
    dm.setup("fit")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    encoded = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    stream = np.concatenate(encoded)
    doc_of = np.repeat(np.arange(len(encoded)), [len(e) for e in encoded])
    data = dm.train_dataset
    assert len(data) == (len(stream) - 1) // 8
    samples = [data[i] for i in range(len(data))]
    assert all(set(s) == {"input_ids", "labels", "position_ids", "document_ids", "document_position_ids"} for s in samples)
    assert all(s[k].dtype == torch.int64 and s[k].shape == (8,) for s in samples for k in s)
    ids = torch.cat([s["input_ids"] for s in samples]).numpy()
    np.testing.assert_array_equal(ids, stream[: len(ids)])
    n = len(ids)
    expected_labels = np.where(doc_of[1 : n + 1] == doc_of[:n], stream[1 : n + 1], -100)
    np.testing.assert_array_equal(torch.cat([s["labels"] for s in samples]).numpy(), expected_labels)
    for i, s in enumerate(samples):
        assert s["position_ids"].tolist() == list(range(8))
        d = doc_of[i * 8 : i * 8 + 8]
        np.testing.assert_array_equal(s["document_ids"].numpy(), d - d[0])
        for t in range(8):  # position within the document's piece of this window
            assert s["document_position_ids"][t] == t - np.flatnonzero(d == d[t])[0]
    assert any((s["document_ids"] >= 2).any() for s in samples)  # windows with several (one-token) documents
    assert any(s["document_ids"].max() == 0 and s["document_position_ids"][0] == 0 for s in samples[2:])
    # the EOS of every document predicts nothing
    eos = tokenizer.eos_token_id
    for s in samples:
        assert (s["labels"][s["input_ids"] == eos] == -100).all()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 8) and batch["document_ids"].shape == (2, 8)


def test_text_and_parquet_files(corpus, tmp_path):
    root, docs, tokenizer = corpus
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.txt").write_text("\n\n".join(docs[:6]))
    (tmp_path / "b.txt").write_text("\n\n".join(docs[6:]))
    pq.write_table(pa.table({"body": docs}), str(tmp_path / "docs.parquet"))
    as_json = _module(root, tokenizer, str(root / "docs.jsonl")).tokenized(str(root / "docs.jsonl"))
    by_paragraph = _module(root, tokenizer, [], text_sample_by="paragraph").tokenized(str(tmp_path / "*.txt"))
    by_file = _module(root, tokenizer, [], text_sample_by="document").tokenized(str(tmp_path / "*.txt"))
    parquet = _module(root, tokenizer, [], text_field="body").tokenized(str(tmp_path / "docs.parquet"))
    assert as_json["input_ids"] == by_paragraph["input_ids"] == parquet["input_ids"]
    assert len(by_file) == 2 and sum(by_file["length"]) == sum(as_json["length"]) - (len(docs) - 2)  # fewer EOS


def test_errors_name_the_argument(corpus, tmp_path, monkeypatch):
    root, docs, tokenizer = corpus
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        _module(root, tokenizer, "x", seq_len=0)
    with pytest.raises(ValueError, match="data_format='csv'"):
        _module(root, tokenizer, "x", data_format="csv")
    with pytest.raises(ValueError, match="no data file matches"):
        _module(root, tokenizer, "x").tokenized(str(tmp_path / "missing*.jsonl"))
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="data_format='auto' needs files of one kind"):
        _module(root, tokenizer, "x").tokenized(str(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match="text_field='content'"):
        _module(root, tokenizer, "x", text_field="content").tokenized(str(root / "docs.jsonl"))
    with pytest.raises(ValueError, match="tokenizer_path="):
        HFTextDataModule(train_files="x", tokenizer_path=str(tmp_path / "none"), seq_len=8, batch_size=1).tokenized(str(root / "docs.jsonl"))
    tokens = _module(root, tokenizer, "x").tokenized(str(root / "docs.jsonl"))
    with pytest.raises(ValueError, match="fewer than one sample"):
        PackedDocumentDataset(tokens, seq_len=10_000)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        _module(root, tokenizer, "x").tokenized(str(root / "docs.jsonl"))


def test_packed_batches_train_under_the_strategy(corpus, tmp_path):
    """The five fields are sharded together; the loss of the first step is the unmodified model's on each document alone."""
    root, docs, tokenizer = corpus
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    path = save_tiny_model("llama", str(tmp_path / "llama"), vocab_size=vocab)
    kwargs = dict(train_files=str(root / "docs.jsonl"), tokenizer_path=tokenizer, seq_len=16, batch_size=2,
                  cache_dir=str(root / "cache"))
    result = run_distributed(fit_on_text, 2, path, kwargs, timeout=300)[0]
    batch = result["batch"]
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids", "document_position_ids"}
    # packed documents: the strategy gives the model the positions inside each document
    assert torch.equal(batch["position_ids"], batch["document_position_ids"])
    # packed documents are masked: the reference runs the unmodified model on each document alone
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    rows = []
    for ids, doc in zip(batch["input_ids"], batch["document_ids"]):
        lengths = torch.unique_consecutive(doc, return_counts=True)[1].tolist()
        rows.append(torch.cat([model(input_ids=part[None], position_ids=torch.arange(len(part))[None]).logits[0]
                               for part in ids.split(lengths)]))
    assert len(rows[0]) == 16
    logits = torch.stack(rows)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
