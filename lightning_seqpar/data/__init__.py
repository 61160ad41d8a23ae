"""Datamodules yielding ``{"input_ids", "labels", "position_ids"}`` batches of full sequences.

The strategy's batch hook shards them along the sequence; labels are already shifted here.
:class:`HFTextDataModule` (local text / jsonl / parquet through Hugging Face ``datasets``, packed
documents; ``min_doc_tokens`` / ``long_doc_ratio`` for long-context training) also yields ``document_ids`` and
``document_position_ids``; so does :class:`ChatDataModule` (jsonl
conversations through the chat template, the loss on the assistant turns only). :func:`passkey_prompts`
builds passkey-retrieval prompts with a tokenizer (``lightning_seqpar.training.callbacks.LongContextEval``).
"""

from __future__ import annotations

from lightning_seqpar.data.chat import ChatDataModule, PackedChatDataset
from lightning_seqpar.data.chars import BitsPerCharacter, CharDataModule, CharWindowDataset, bits_per_character, char_splits
from lightning_seqpar.data.hf_text import HFTextDataModule, PackedDocumentDataset, select_documents
from lightning_seqpar.data.passkey import PasskeyPrompts, passkey_prompts
from lightning_seqpar.data.resumable import ResumableLoader
from lightning_seqpar.data.synthetic import CopyTaskDataset, LongRangeDataModule
from lightning_seqpar.data.tokens import TOKEN_DTYPES, TokenFileDataModule, TokenWindowDataset

__all__ = [
    "BitsPerCharacter", "CharDataModule", "CharWindowDataset", "bits_per_character", "char_splits",
    "ChatDataModule", "CopyTaskDataset", "HFTextDataModule", "LongRangeDataModule", "PackedChatDataset", "PackedDocumentDataset", "ResumableLoader", "TOKEN_DTYPES", "TokenFileDataModule", "TokenWindowDataset",
    "PasskeyPrompts", "passkey_prompts", "select_documents",
]
