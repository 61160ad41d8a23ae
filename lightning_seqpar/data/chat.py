"""Instruction / chat data: jsonl conversations, the tokenizer's chat template, loss on the assistant turns only, packed.

Note [Chat data: assistant masks and packing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each row of a jsonl file is ``{"messages": [{"role": "user", "content": ...}, {"role":
"assistant", "content": ...}, ...]}``. The conversation is rendered with the tokenizer's chat
template (``apply_chat_template``), and the loss is kept on the tokens of the assistant turns:

* when the template marks them with ``{% generation %}``, transformers returns the mask itself
  (``return_assistant_tokens_mask=True``);
* otherwise (most templates) the mask is found by rendering prefixes: assistant turn i starts where
  ``messages[:i]`` rendered with ``add_generation_prompt=True`` ends (the assistant header is not
  trained) and ends where ``messages[:i + 1]`` rendered ends (its end-of-turn marker is trained).
  Those are character offsets in the full rendering; a token is an assistant token when its
  characters (the fast tokenizer's ``offset_mapping``) lie in such a span. A template whose
  prefixes are not prefixes of the full rendering is refused (ValueError): no mask is guessed.

Packing: conversations of ``n`` tokens are laid end to end, whole, in file order, into samples of
``seq_len`` tokens (a conversation that does not fit in what is left of the sample starts the
next one); the rest of a sample is padding (its own document, labels -100):

    sample  [ c0 c0 c0 c0 c0 c1 c1 c1 c1 c2 c2 c2 pad pad ]
    labels    .  .  a  a  .  .  .  a  .  .  a  .   .   .      a: the next token is an assistant token
    doc ids   0  0  0  0  0  1  1  1  1  2  2  2   3   3

``labels[t]`` is token ``t + 1`` when that token is an assistant token of the same conversation,
else -100: the last token of a conversation never predicts the next conversation. The batch has
``document_ids``, so the strategy splits it with the per-document zigzag (every rank the same share
of every conversation's causal work) and masks attention by conversation (Note [Packed documents
and per-document zigzag] in ``lightning_seqpar.sharding.documents``): each conversation is trained as if
it were alone. The loss is the sum over the trained tokens of all ranks divided by their GLOBAL
count (``lightning_seqpar.loss.global_mean_loss``), so every trained token weighs the same,
however the conversations fall on ranks, samples and the micro-batches of a step (Note [Loss under
gradient accumulation] in ``lightning_seqpar.training.module``).

Bad rows never stop training half-way: they are found at ``setup`` (every row is rendered then),
counted by reason, and handled by policy: ``on_invalid`` for rows that cannot be trained (broken
JSON, no ``messages`` list, a message without a string ``role`` / ``content``, no assistant turn):
"skip" or "error"; ``on_too_long`` for conversations longer than ``seq_len`` tokens: "skip",
"truncate" (keep the first ``seq_len`` tokens; skipped if no assistant token is left) or "error".
The counts are logged once (rank 0) and kept in :attr:`ChatDataModule.bad_rows`.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from lightning_seqpar.checks import ANY, AT_LEAST_ONE, NON_NEGATIVE, Range, check_options, check_ranges, option_hints
from lightning_seqpar.data.hf_text import load_tokenizer
from lightning_seqpar.data.loaders import FileSplitLoaders
from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX

__all__ = ["ChatDataModule", "Conversation", "PackedChatDataset", "assistant_mask", "pack_conversations", "read_conversations"]

OnInvalid = Literal["skip", "error"]
OnTooLong = Literal["skip", "truncate", "error"]
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Conversation:
    """One tokenized conversation: ``input_ids`` and ``assistant`` (1 on assistant tokens), int64 arrays ``(n,)``."""

    input_ids: np.ndarray
    assistant: np.ndarray


# --------------------------------------------------------------------------------------------- one conversation


def _check_messages(messages: Any) -> str | None:
    """Why ``messages`` cannot be trained (a reason for the counts), or None."""
    if not isinstance(messages, list) or not messages:
        return "no messages list"
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return "a message without string role and content"
    for message in messages:  # "Assistant" would be rendered, never trained (only "assistant" turns are)
        role = message["role"]
        if role != role.strip().lower() and role.strip().lower() in _STANDARD_ROLES:
            return f"a role {role!r} that is not {role.strip().lower()!r} (roles are case-sensitive)"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


_STANDARD_ROLES = ("system", "user", "assistant", "tool", "developer")


def assistant_mask(tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None) -> Conversation:
    """The tokens of ``messages`` rendered with the chat template and the mask of the assistant turns
    (Note [Chat data: assistant masks and packing]).

    Raises:
        ValueError: the template's prefixes are not prefixes of its full rendering (the mask cannot
            be found by rendering prefixes; add ``{% generation %}`` to the template), or the
            tokenizer gives no character offsets (a slow tokenizer).
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise ValueError("the tokenizer has no chat_template; set one (tokenizer_config.json) or pass chat_template")
    if _GENERATION.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return Conversation(np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=np.int64))
    full = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = tokenizer.apply_chat_template(messages[:i], chat_template=template, tokenize=False, add_generation_prompt=True) if i else ""
        end = tokenizer.apply_chat_template(messages[: i + 1], chat_template=template, tokenize=False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ValueError(
                "the chat template renders a conversation's prefixes differently from the conversation (e.g. it changes "
                "earlier turns once later ones exist), so the assistant tokens cannot be found by rendering prefixes; "
                "mark them with {% generation %} ... {% endgeneration %} in the template"
            )
        spans.append((len(start), len(end)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in encoded:
        raise ValueError("assistant masks need a fast tokenizer (offset_mapping); load a tokenizer.json / fast tokenizer")
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.zeros_like(ids)
    for t, (a, b) in enumerate(encoded["offset_mapping"]):
        mask[t] = any(start <= a and b <= end for start, end in spans) and b > a
    return Conversation(ids, mask)


# --------------------------------------------------------------------------------------------- files


def _files(spec: str | Sequence[str]) -> list[str]:
    patterns = [spec] if isinstance(spec, str) else list(spec)
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.join(pattern, "*.jsonl")) if os.path.isdir(pattern) else glob.glob(pattern))
        if not matched:
            raise ValueError(f"no jsonl file matches {pattern!r}")
        files.extend(f for f in matched if os.path.isfile(f))
    return files


def read_conversations(
    files: str | Sequence[str],
    tokenizer: Any,
    *,
    seq_len: int,
    messages_field: str = "messages",
    chat_template: str | None = None,
    on_invalid: OnInvalid = "skip",
    on_too_long: OnTooLong = "skip",
) -> tuple[list[Conversation], Counter]:
    """The trainable conversations of jsonl ``files`` (in file and row order) and the counts of bad rows by reason.

    Raises:
        ValueError: a bad row under policy "error" (naming the file, the line and the reason).
    """
    conversations: list[Conversation] = []
    bad: Counter = Counter()
    for path in _files(files):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    reason = _check_messages(row.get(messages_field)) if isinstance(row, dict) else "not a JSON object"
                except json.JSONDecodeError:
                    reason = "broken JSON"
                if reason is not None:
                    if on_invalid == "error":
                        raise ValueError(f"{path}:{line_no}: {reason} (on_invalid='error'; 'skip' drops such rows)")
                    bad[reason] += 1
                    continue
                conversation = assistant_mask(tokenizer, row[messages_field], chat_template=chat_template)
                if not conversation.assistant[1:].any():  # e.g. empty assistant turns under a template that adds nothing
                    if on_invalid == "error":
                        raise ValueError(f"{path}:{line_no}: no assistant token to train on (on_invalid='error')")
                    bad["no assistant token"] += 1
                    continue
                if len(conversation.input_ids) > seq_len:
                    if on_too_long == "error":
                        raise ValueError(f"{path}:{line_no}: {len(conversation.input_ids)} tokens > seq_len={seq_len} "
                                         "(on_too_long='error'; 'skip' or 'truncate' handle such rows)")
                    if on_too_long == "skip":
                        bad["longer than seq_len (skipped)"] += 1
                        continue
                    conversation = Conversation(conversation.input_ids[:seq_len], conversation.assistant[:seq_len])
                    if not conversation.assistant[1:].any():
                        bad["longer than seq_len and no assistant token left after truncation (skipped)"] += 1
                        continue
                    bad["longer than seq_len (truncated)"] += 1
                conversations.append(conversation)
    return conversations, bad


# --------------------------------------------------------------------------------------------- packing


def pack_conversations(lengths: Sequence[int], *, seq_len: int) -> list[list[int]]:
    """Greedy packing in order: the indices of the conversations of each sample (each fits: ``n <= seq_len``)."""
    samples: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if not 0 < n <= seq_len:
            raise ValueError(f"conversation {i} has {n} tokens; packing needs 1..seq_len={seq_len}")
        if used + n > seq_len:
            samples.append([])
            used = 0
        samples[-1].append(i)
        used += n
    return samples


class PackedChatDataset(Dataset):
    """Samples of ``seq_len`` tokens of whole conversations (Note [Chat data: assistant masks and packing]).

    Each sample is a dict of LongTensors ``(seq_len,)``: ``input_ids``, ``labels`` (-100 but where the
    next token is an assistant token of the same conversation), ``position_ids`` (``0..S-1``: the
    global positions; the strategy restarts them per document), ``document_ids`` (the padding is one
    more document) and ``document_position_ids`` (the positions inside each conversation).
    """

    def __init__(self, conversations: Sequence[Conversation], *, seq_len: int, pad_token_id: int, num_samples: int | None = None) -> None:
        if not conversations:
            raise ValueError("no trainable conversation (see the counts of bad rows in the log)")
        self.conversations = list(conversations)
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self.samples = pack_conversations([len(c.input_ids) for c in self.conversations], seq_len=seq_len)
        if num_samples is not None:
            self.samples = self.samples[:num_samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self.samples):
            raise IndexError(f"index {index} out of range for {len(self.samples)} samples")
        parts = [self.conversations[i] for i in self.samples[index]]
        lengths = [len(c.input_ids) for c in parts]
        pad = self.seq_len - sum(lengths)
        ids = np.concatenate([c.input_ids for c in parts] + [np.full(pad, self.pad_token_id, dtype=np.int64)])
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        start = 0
        for c, n in zip(parts, lengths):
            # position t predicts token t + 1 of the same conversation, trained where that token is the assistant's
            labels[start : start + n - 1] = np.where(c.assistant[1:] == 1, c.input_ids[1:], IGNORE_INDEX)
            start += n
        doc_lengths = lengths + ([pad] if pad else [])
        documents = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
        starts = np.repeat(np.cumsum([0, *doc_lengths[:-1]]), doc_lengths)
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.arange(self.seq_len),
            "document_ids": torch.from_numpy(documents),
            "document_position_ids": torch.from_numpy(np.arange(self.seq_len) - starts),
        }


# --------------------------------------------------------------------------------------------- datamodule


class ChatDataModule(FileSplitLoaders, L.LightningDataModule):
    """Chat / instruction tuning data: jsonl conversations rendered with the tokenizer's chat template,
    the loss on the assistant turns only, packed into samples of ``seq_len`` tokens with document
    boundaries (Note [Chat data: assistant masks and packing]).

    Args:
        train_files: a jsonl file, a glob pattern, a folder (its ``*.jsonl``) or a list of them.
        tokenizer_path: a local tokenizer folder (``AutoTokenizer``) or a ``tokenizer.json`` file; it
            needs a chat template (or ``chat_template``) and must be a fast tokenizer.
        seq_len: S, the tokens per sample.
        batch_size: samples per batch on each data-parallel replica.
        val_files: the same for validation; no validation when None.
        messages_field: the key of each row holding the list of ``{"role", "content"}`` messages.
        chat_template: a Jinja chat template replacing the tokenizer's.
        on_invalid: rows that cannot be trained (broken JSON, no messages, no assistant turn):
            "skip" (counted and logged) or "error" (a ValueError naming the file and line at setup).
        on_too_long: conversations longer than ``seq_len`` tokens: "skip", "truncate" (their first
            ``seq_len`` tokens) or "error".
        samples_per_epoch: at most this many training samples (all when None).
        val_samples: at most this many validation samples.
        num_workers: DataLoader worker processes.
        seed: seed of the single-process shuffle.
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "seq_len": Range(low=2), "batch_size": AT_LEAST_ONE, "samples_per_epoch": AT_LEAST_ONE, "val_samples": AT_LEAST_ONE,
        "num_workers": NON_NEGATIVE, "seed": ANY,
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
        messages_field: str = "messages",
        chat_template: str | None = None,
        on_invalid: OnInvalid = "skip",
        on_too_long: OnTooLong = "skip",
        samples_per_epoch: int | None = None,
        val_samples: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        values = {k: v for k, v in locals().items() if k in option_hints(ChatDataModule)}  # every argument
        check_options(values, option_hints(ChatDataModule), owner=type(self).__name__)  # types, finite numbers (ranges: below)
        name = type(self).__name__
        for arg, value, least in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}: {arg} must be an integer >= {least}, got {value!r}")
        for arg, value in (("samples_per_epoch", samples_per_epoch), ("val_samples", val_samples)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: {arg} must be a positive integer or None, got {value!r}")
        if on_invalid not in ("skip", "error"):
            raise ValueError(f"{name}: on_invalid={on_invalid!r} is not supported; expected 'skip' or 'error'")
        if on_too_long not in ("skip", "truncate", "error"):
            raise ValueError(f"{name}: on_too_long={on_too_long!r} is not supported; expected 'skip', 'truncate' or 'error'")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"{name}: num_workers must be a non-negative integer, got {num_workers!r}")
        check_ranges(values, self.option_ranges, owner=type(self).__name__)
        self.save_hyperparameters()
        self.train_files, self.val_files, self.tokenizer_path = train_files, val_files, tokenizer_path
        self.seq_len, self.batch_size, self.messages_field, self.chat_template = seq_len, batch_size, messages_field, chat_template
        self.on_invalid, self.on_too_long = on_invalid, on_too_long
        self.samples_per_epoch, self.val_samples, self.num_workers, self.seed = samples_per_epoch, val_samples, num_workers, seed
        self.train_dataset: PackedChatDataset | None = None
        self.val_dataset: PackedChatDataset | None = None
        self.bad_rows: dict[str, Counter] = {}
        """Bad rows by split ("train", "val") and reason, filled at setup."""

    def _dataset(self, files: str | list[str], split: str, num_samples: int | None) -> PackedChatDataset:
        tokenizer = load_tokenizer(self.tokenizer_path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        conversations, bad = read_conversations(
            files, tokenizer, seq_len=self.seq_len, messages_field=self.messages_field, chat_template=self.chat_template,
            on_invalid=self.on_invalid, on_too_long=self.on_too_long,
        )
        self.bad_rows[split] = bad
        dataset = PackedChatDataset(conversations, seq_len=self.seq_len, pad_token_id=0 if pad is None else int(pad),
                                    num_samples=num_samples)
        trained = sum(int(c.assistant[1:].sum()) for c in conversations)
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(bad.items())) or "none"
        rank_zero_info(
            f"{type(self).__name__} ({split}): {len(conversations)} conversations, {trained} trained (assistant) tokens, "
            f"{len(dataset)} samples of {self.seq_len} tokens; bad rows: {counts} "
            f"(on_invalid={self.on_invalid!r}, on_too_long={self.on_too_long!r})"
        )
        return dataset

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = self._dataset(self.train_files, "train", self.samples_per_epoch)
        if self.val_dataset is None and self.val_files is not None and stage in (None, "fit", "validate"):
            self.val_dataset = self._dataset(self.val_files, "val", self.val_samples)
