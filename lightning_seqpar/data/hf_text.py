"""Local text / jsonl / parquet documents through Hugging Face ``datasets``, tokenized and packed.

Note [Packed documents]
~~~~~~~~~~~~~~~~~~~~~~~
Documents of mixed length are tokenized (with the tokenizer's special tokens, plus EOS at the end
of each document with ``append_eos``) and laid end to end in one token stream. Sequence ``i`` is
the window of the stream that starts at ``i * seq_len`` and holds ``seq_len + 1`` tokens (inputs:
the first ``seq_len``; labels: the next tokens, shifted on the full window before any sharding);
no padding, and a document longer than a window continues in the next one:

    stream  | doc 0 .......... | doc 1 .... | doc 2 ............................ |
    seq 0   [ 0 0 0 0 0 0 0 0 0 1 1 1 1 1 1 2 2 ]        document_ids
    seq 1                                       [ 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 ]   (doc 2 continues)

Each sample is a dict of LongTensors ``(seq_len,)``:

* ``input_ids``;
* ``labels``: the next token when it belongs to the same document, else -100. The last token of
  every document (its EOS) never predicts the first token of the next one;
* ``position_ids``: ``0 .. seq_len-1``, the GLOBAL positions that the strategy and the models
  expect (RoPE / learned positions over the whole packed sequence), as every datamodule of
  ``lightning_seqpar.data`` gives;
* ``document_ids``: the index of each token's document within this sequence (0, 1, 2, ...);
* ``document_position_ids``: the position of each token within its document's piece of this
  sequence (restarting at 0 at every document start and at the start of the sequence) — the
  positions a document would have if it were run alone.

The strategy's batch hook sees ``document_ids``: it splits the batch with the per-document zigzag,
replaces ``position_ids`` with the positions inside each document and masks attention by document
(Note [Packed documents and per-document zigzag] in ``lightning_seqpar.sharding.documents``), so every
document is trained as if it were alone; the loss never crosses documents either (labels).

Every rank builds the same index (documents in file order, or in the seeded order of Note [Long
documents], fixed windows), so sample ``i`` is the same everywhere (Note [Samples under sequence
and data parallelism] in ``tokens.py``).
Tokenization runs through ``datasets.Dataset.map`` and is cached by ``datasets`` under a
fingerprint of the files (path, size, mtime), the tokenizer and the options: ``prepare_data``
(one process per node) fills the cache, ``setup`` on every rank reads it.

Note [Long documents]
~~~~~~~~~~~~~~~~~~~~~
Teaching a model to use a longer context needs documents that are long (a packed window of short
documents has no long-range dependency: attention stops at each document), and keeping its
short-context quality needs short ones too (long-context recipes train on a mix). With
``min_doc_tokens=N`` a document is *long* when it has at least N tokens (after tokenization,
special tokens and EOS included), *short* otherwise, and :func:`select_documents` picks the
documents of the stream:

* ``long_doc_ratio=None`` (or 1.0): the long documents only, in file order;
* ``long_doc_ratio=r`` in (0, 1): long and short documents such that a fraction r of the
  stream's tokens comes from long documents. Every long document is kept and short ones are
  added in a seeded random order until their tokens reach ``T_long * (1 - r) / r``; when the
  short documents run out first, every short one is kept and long ones are taken (seeded) until
  ``T_short * r / (1 - r)``. Whole documents only, so the ratio reached can be above the target
  by at most one document; it is logged. The chosen documents are then shuffled together (same
  seed), so that long and short ones alternate through the stream.

Only the training split is mixed; validation keeps its long documents only (so that
``lightning_seqpar.training.metrics.LossByPosition`` measures far positions). The counts (documents and
tokens, long and short, kept and available, the ratio reached) are logged once at ``setup``
(rank 0) and kept in :attr:`HFTextDataModule.document_counts`. Deterministic given ``seed``: every
rank selects the same documents. A document longer than a window still continues in the next
window, whose positions restart at 0 (Note [Packed documents]).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from lightning.pytorch.utilities import rank_zero_info

from lightning_seqpar.checks import ANY, AT_LEAST_ONE, NON_NEGATIVE, Range, check_options, check_ranges, option_hints
from lightning_seqpar.data.loaders import FileSplitLoaders
from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX

__all__ = ["DATA_FORMATS", "HFTextDataModule", "PackedDocumentDataset", "load_tokenizer", "pack_window", "select_documents"]

DataFormat = Literal["auto", "text", "json", "parquet"]
DATA_FORMATS: dict[str, str] = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""File suffix -> ``datasets`` builder used by ``data_format="auto"``."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "HFTextDataModule reads files through Hugging Face `datasets`: pip install datasets "
            "(or pip install 'lightning-seqpar[hf]')"
        ) from error
    return datasets


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A tokenizer from a local folder (``AutoTokenizer.from_pretrained``) or a ``tokenizer.json`` file
    (``PreTrainedTokenizerFast``). Nothing is downloaded."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError("HFTextDataModule needs `transformers` for the tokenizer: pip install 'transformers>=4.56'") from error
    path = os.fspath(path)
    if os.path.isdir(path):
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if os.path.isfile(path) and path.endswith(".json"):
        return transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    raise ValueError(f"tokenizer_path={path!r} is neither a local tokenizer folder nor a tokenizer.json file")


def pack_window(documents: Sequence[np.ndarray], *, offset: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One packed sample (Note [Packed documents]) from the documents that overlap its window.

    Args:
        documents: token arrays of the consecutive documents that the window touches, in order
            (empty documents are allowed and skipped).
        offset: where the window starts inside ``documents[0]``.
        seq_len: S; the documents must hold at least ``offset + S + 1`` tokens.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``, ``document_ids``, ``document_position_ids``:
        LongTensors ``(S,)``.
    """
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents])[offset : offset + seq_len + 1]
    doc = np.repeat(np.arange(len(documents)), lengths)[offset : offset + seq_len + 1]
    if tokens.shape[0] != seq_len + 1:
        raise ValueError(f"the documents hold {int(lengths.sum())} tokens; a window at offset {offset} needs {offset + seq_len + 1}")
    doc = np.unique(doc, return_inverse=True)[1].reshape(-1)  # 0, 1, 2, ... within this window
    labels = np.where(doc[1:] == doc[:-1], tokens[1:], IGNORE_INDEX)
    starts = np.flatnonzero(np.r_[True, doc[1:seq_len] != doc[: seq_len - 1]])  # first token of each piece
    piece_start = starts[np.searchsorted(starts, np.arange(seq_len), side="right") - 1]
    return {
        "input_ids": torch.from_numpy(tokens[:-1].copy()),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.arange(seq_len),
        "document_ids": torch.from_numpy(doc[:-1].copy()),
        "document_position_ids": torch.from_numpy(np.arange(seq_len) - piece_start),
    }


class PackedDocumentDataset(Dataset):
    """Packed windows of ``seq_len`` tokens over a tokenized ``datasets.Dataset`` (Note [Packed documents]).

    Args:
        documents: a ``datasets.Dataset`` with an ``input_ids`` column (one token list per document).
        seq_len: S, the input tokens per sample.
        num_samples: at most this many windows (all of them when None).
    """

    def __init__(self, documents: Any, *, seq_len: int, num_samples: int | None = None) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if "input_ids" not in documents.column_names:
            raise ValueError(f"documents must have an 'input_ids' column, got {documents.column_names}")
        self.documents = documents.with_format("numpy", columns=["input_ids"])
        lengths = np.asarray(documents.with_format("numpy")["length"] if "length" in documents.column_names
                             else [len(x) for x in documents["input_ids"]], dtype=np.int64)
        self.ends = np.cumsum(lengths)  # document d covers stream [ends[d] - lengths[d], ends[d])
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        available = max(0, (self.num_tokens - 1) // seq_len)
        if available == 0:
            raise ValueError(
                f"the documents hold {self.num_tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}"
            )
        self.seq_len = seq_len
        self.length = available if num_samples is None else min(num_samples, available)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        start = index * self.seq_len
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, start + self.seq_len, side="right"))
        docs = self.documents[first : last + 1]["input_ids"]
        offset = start - (int(self.ends[first - 1]) if first > 0 else 0)
        return pack_window(list(docs), offset=offset, seq_len=self.seq_len)


def select_documents(lengths: Sequence[int] | np.ndarray, *, min_doc_tokens: int, long_doc_ratio: float | None = None,
                     seed: int = 0) -> tuple[np.ndarray, dict[str, float]]:
    """The documents of the stream (Note [Long documents]): their indices in stream order, and the counts.

    Args:
        lengths: the token count of every document.
        min_doc_tokens: a document with at least this many tokens is long.
        long_doc_ratio: None: the long documents only (file order); r in (0, 1]: a fraction r of the
            chosen tokens from long documents (seeded choice and order).
        seed: seed of the choice and order.

    Returns:
        ``(indices, counts)``: counts ``long_documents``, ``long_tokens``, ``short_documents``,
        ``short_tokens`` (available), ``kept_long_documents``, ``kept_long_tokens``,
        ``kept_short_documents``, ``kept_short_tokens`` and ``long_token_ratio`` (reached).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    long, short = np.flatnonzero(lengths >= min_doc_tokens), np.flatnonzero(lengths < min_doc_tokens)
    t_long, t_short = int(lengths[long].sum()), int(lengths[short].sum())
    rng = np.random.default_rng(seed)

    def prefix(indices: np.ndarray, tokens: float) -> np.ndarray:  # the seeded documents whose tokens first reach ``tokens``
        order = indices[rng.permutation(len(indices))]
        reach = np.cumsum(lengths[order])
        return order[: int(np.searchsorted(reach, tokens, side="left")) + 1] if tokens > 0 else order[:0]

    if long_doc_ratio is None or long_doc_ratio >= 1:
        kept_long, kept_short = long, short[:0]
        chosen = long
    else:
        r = float(long_doc_ratio)
        if t_long * (1 - r) / r <= t_short:
            kept_long, kept_short = long, prefix(short, t_long * (1 - r) / r)
        else:
            kept_long, kept_short = prefix(long, t_short * r / (1 - r)), short
        both = np.concatenate([kept_long, kept_short])
        chosen = both[rng.permutation(len(both))]
    kl, ks = int(lengths[kept_long].sum()), int(lengths[kept_short].sum())
    counts = {"long_documents": len(long), "long_tokens": t_long, "short_documents": len(short), "short_tokens": t_short,
              "kept_long_documents": len(kept_long), "kept_long_tokens": kl, "kept_short_documents": len(kept_short),
              "kept_short_tokens": ks, "long_token_ratio": kl / max(1, kl + ks)}
    return chosen.astype(np.int64), counts


def _files(spec: str | Sequence[str]) -> list[str]:
    patterns = [spec] if isinstance(spec, str) else list(spec)
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.join(pattern, "*")) if os.path.isdir(pattern) else glob.glob(pattern))
        if not matched:
            raise ValueError(f"no data file matches {pattern!r}")
        files.extend(f for f in matched if os.path.isfile(f))
    empty = [f for f in files if _is_empty(f)]
    if empty:
        raise ValueError(f"the data file{'s' if len(empty) > 1 else ''} {empty[:5]} hold{'' if len(empty) > 1 else 's'} no document "
                         f"(empty, or only blank lines); remove {'them' if len(empty) > 1 else 'it'} or give the files with the text")
    return files


def _is_empty(path: str) -> bool:
    """A file with nothing but whitespace (``datasets`` ends in a bare ``StopIteration`` on an empty .jsonl)."""
    if os.path.getsize(path) == 0:
        return True
    if os.path.splitext(path)[1].lower() == ".parquet":
        return False
    with open(path, "rb") as f:
        return not any(line.strip() for line in f)


def _builder(files: list[str], data_format: str) -> str:
    if data_format != "auto":
        if data_format not in set(DATA_FORMATS.values()):
            raise ValueError(f"data_format={data_format!r} is not supported; expected 'auto' or one of {sorted(set(DATA_FORMATS.values()))}")
        return data_format
    kinds = {DATA_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"data_format='auto' needs files of one kind with suffixes {sorted(DATA_FORMATS)}; got {files[:5]}: "
            "set data_format to 'text', 'json' or 'parquet'"
        )
    return kinds.pop()


class HFTextDataModule(FileSplitLoaders, L.LightningDataModule):
    """Local text / jsonl / parquet documents, tokenized with a local tokenizer and packed into
    sequences of ``seq_len`` tokens with document boundaries kept (Note [Packed documents]).

    Batches are ``{"input_ids", "labels", "position_ids", "document_ids", "document_position_ids"}``,
    LongTensors ``(B, S)``; labels are -100 where the next token starts another document.

    Args:
        train_files: a file, a glob pattern, a folder (its files) or a list of them.
        tokenizer_path: a local tokenizer folder (``AutoTokenizer``) or a ``tokenizer.json`` file.
        seq_len: S, the input tokens per sample.
        batch_size: samples per batch on each data-parallel replica.
        val_files: the same for validation (windows in order); no validation when None.
        data_format: "auto" (from the suffixes: .txt/.text, .json/.jsonl, .parquet), "text", "json" or "parquet".
        text_field: the column / key holding the text (json, parquet).
        text_sample_by: for text files, what one document is: the whole "document" (file),
            a "paragraph" (separated by blank lines) or a "line".
        add_special_tokens: let the tokenizer add its special tokens (e.g. BOS) to each document.
        append_eos: end every document with the tokenizer's EOS token.
        min_doc_tokens: keep only documents of at least this many tokens (long documents; Note [Long
            documents]); None keeps every document.
        long_doc_ratio: with ``min_doc_tokens``, train on long AND short documents, this fraction of the
            training tokens from long ones (e.g. 0.7); None trains on the long documents only.
            Validation always keeps its long documents only.
        samples_per_epoch: at most this many training samples (all windows when None).
        val_samples: at most this many validation samples.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenization (``datasets.Dataset.map``).
        seed: seed of the single-process shuffle.
        cache_dir: ``datasets`` cache folder (default: ``HF_DATASETS_CACHE``).
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "seq_len": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE, "min_doc_tokens": AT_LEAST_ONE,
        "long_doc_ratio": Range(low=0, high=1, low_open=True), "samples_per_epoch": AT_LEAST_ONE, "val_samples": AT_LEAST_ONE,
        "num_workers": NON_NEGATIVE, "num_proc": AT_LEAST_ONE, "seed": ANY,
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __init__(
        self,
        *,
        train_files: str | list[str],
        tokenizer_path: str,
        seq_len: int,
        batch_size: int,
        val_files: str | list[str] | None = None,
        data_format: DataFormat = "auto",
        text_field: str = "text",
        text_sample_by: Literal["document", "paragraph", "line"] = "document",
        add_special_tokens: bool = True,
        append_eos: bool = True,
        min_doc_tokens: int | None = None,
        long_doc_ratio: float | None = None,
        samples_per_epoch: int | None = None,
        val_samples: int | None = None,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        values = {k: v for k, v in locals().items() if k in option_hints(HFTextDataModule)}  # every argument
        check_options(values, option_hints(HFTextDataModule), owner=type(self).__name__)  # types, finite numbers (ranges: below)
        name = type(self).__name__
        for arg, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive integer, got {value!r}")
        for arg, value in (("samples_per_epoch", samples_per_epoch), ("val_samples", val_samples), ("num_proc", num_proc)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: {arg} must be a positive integer or None, got {value!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"{name}: num_workers must be a non-negative integer, got {num_workers!r}")
        if text_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(f"{name}: text_sample_by={text_sample_by!r} is not supported; expected 'document', 'paragraph' or 'line'")
        if data_format not in ("auto", *DATA_FORMATS.values()):
            raise ValueError(f"{name}: data_format={data_format!r} is not supported; expected 'auto', 'text', 'json' or 'parquet'")
        if min_doc_tokens is not None and (not isinstance(min_doc_tokens, int) or isinstance(min_doc_tokens, bool) or min_doc_tokens < 1):
            raise ValueError(f"{name}: min_doc_tokens must be a positive integer (tokens) or None, got {min_doc_tokens!r}")
        if long_doc_ratio is not None:
            if min_doc_tokens is None:
                raise ValueError(f"{name}: long_doc_ratio={long_doc_ratio!r} needs min_doc_tokens (the length from which a "
                                 "document is long)")
            if isinstance(long_doc_ratio, bool) or not isinstance(long_doc_ratio, (int, float)) or not 0 < long_doc_ratio <= 1:
                raise ValueError(f"{name}: long_doc_ratio must be a fraction in (0, 1] of the training tokens from long documents, "
                                 f"got {long_doc_ratio!r}")
        check_ranges(values, self.option_ranges, owner=type(self).__name__)
        self.save_hyperparameters()
        self.train_files, self.val_files, self.tokenizer_path = train_files, val_files, tokenizer_path
        self.seq_len, self.batch_size, self.data_format, self.text_field = seq_len, batch_size, data_format, text_field
        self.text_sample_by, self.add_special_tokens, self.append_eos = text_sample_by, add_special_tokens, append_eos
        self.samples_per_epoch, self.val_samples = samples_per_epoch, val_samples
        self.min_doc_tokens, self.long_doc_ratio = min_doc_tokens, long_doc_ratio
        self.num_workers, self.num_proc, self.seed, self.cache_dir = num_workers, num_proc, seed, cache_dir
        self.train_dataset: PackedDocumentDataset | None = None
        self.val_dataset: PackedDocumentDataset | None = None
        self.document_counts: dict[str, dict[str, float]] = {}
        """With ``min_doc_tokens``: the counts of :func:`select_documents` by split ("train", "val"), filled at setup."""

    # ----------------------------------------------------------------------------------------- tokenization

    def tokenized(self, files: str | list[str]) -> Any:
        """The documents of ``files`` as a ``datasets.Dataset`` with columns ``input_ids`` and ``length`` (cached)."""
        datasets = _datasets()
        name = type(self).__name__
        paths = _files(files)
        builder = _builder(paths, self.data_format)
        tokenizer = load_tokenizer(self.tokenizer_path)
        eos = tokenizer.eos_token_id
        if self.append_eos and eos is None:
            raise ValueError(f"{name}: append_eos=True but the tokenizer at {self.tokenizer_path!r} has no eos_token; set one or append_eos=False")
        kwargs: dict[str, Any] = {"sample_by": self.text_sample_by} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=paths, split="train", cache_dir=self.cache_dir, **kwargs)
        field = "text" if builder == "text" else self.text_field
        if field not in raw.column_names:
            raise ValueError(f"{name}: text_field={field!r} is not a column of {paths[:3]}; columns: {raw.column_names}")
        add_special, append = self.add_special_tokens, self.append_eos

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            ids = tokenizer(batch[field], add_special_tokens=add_special)["input_ids"]
            if append:
                ids = [x + [eos] for x in ids]
            return {"input_ids": ids, "length": [len(x) for x in ids]}

        return raw.map(tokenize, batched=True, remove_columns=raw.column_names, num_proc=self.num_proc,
                       new_fingerprint=self._fingerprint(paths, builder, tokenizer), desc="tokenizing")

    def _fingerprint(self, paths: list[str], builder: str, tokenizer: Any) -> str:
        """Deterministic across processes: files (path, size, mtime), tokenizer and options."""
        h = hashlib.sha256()
        for path in paths:
            stat = os.stat(path)
            h.update(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
        options = [builder, self.text_field, self.text_sample_by, self.add_special_tokens, self.append_eos,
                   tokenizer.eos_token_id, tokenizer.bos_token_id]
        h.update(json.dumps(options).encode())
        return h.hexdigest()[:32]

    # ----------------------------------------------------------------------------------------- Lightning hooks

    def prepare_data(self) -> None:
        """Tokenize once per node (fills the ``datasets`` cache that ``setup`` reads on every rank)."""
        self.tokenized(self.train_files)
        if self.val_files is not None:
            self.tokenized(self.val_files)

    def documents(self, files: str | list[str], split: str) -> Any:
        """The tokenized documents of a split, selected by ``min_doc_tokens`` / ``long_doc_ratio`` (Note [Long documents])."""
        documents = self.tokenized(files)
        if self.min_doc_tokens is None:
            return documents
        name = type(self).__name__
        ratio = self.long_doc_ratio if split == "train" else None
        chosen, counts = select_documents(documents.with_format("numpy")["length"], min_doc_tokens=self.min_doc_tokens,
                                          long_doc_ratio=ratio, seed=self.seed)
        self.document_counts[split] = counts
        c = {k: int(v) for k, v in counts.items() if k != "long_token_ratio"}
        rank_zero_info(
            f"{name} ({split}): documents of >= {self.min_doc_tokens} tokens: {c['long_documents']} ({c['long_tokens']} tokens), "
            f"shorter: {c['short_documents']} ({c['short_tokens']} tokens); kept {c['kept_long_documents']} long "
            f"({c['kept_long_tokens']} tokens) + {c['kept_short_documents']} short ({c['kept_short_tokens']} tokens): "
            f"{counts['long_token_ratio']:.1%} of the tokens from long documents (long_doc_ratio={ratio!r})"
        )
        if len(chosen) == 0:
            raise ValueError(f"{name} ({split}): no document has min_doc_tokens={self.min_doc_tokens} tokens or more (the longest "
                             f"has {int(np.max(documents.with_format('numpy')['length'], initial=0))}); lower min_doc_tokens")
        return documents.select(chosen)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = PackedDocumentDataset(self.documents(self.train_files, "train"), seq_len=self.seq_len,
                                                       num_samples=self.samples_per_epoch)
        if self.val_dataset is None and self.val_files is not None and stage in (None, "fit", "validate"):
            self.val_dataset = PackedDocumentDataset(self.documents(self.val_files, "val"), seq_len=self.seq_len,
                                                     num_samples=self.val_samples)
