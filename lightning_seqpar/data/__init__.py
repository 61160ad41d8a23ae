"""Datamodules yielding ``{"input_ids", "labels", "position_ids"}`` batches of full sequences.

The strategy's batch hook shards them along the sequence; labels are already shifted here.
"""

from __future__ import annotations

from lightning_seqpar.data.chars import BitsPerCharacter, CharDataModule, CharWindowDataset, bits_per_character, char_splits
from lightning_seqpar.data.synthetic import CopyTaskDataset, LongRangeDataModule
from lightning_seqpar.data.tokens import TOKEN_DTYPES, TokenFileDataModule, TokenWindowDataset

__all__ = [
    "BitsPerCharacter", "CharDataModule", "CharWindowDataset", "bits_per_character", "char_splits",
    "CopyTaskDataset", "LongRangeDataModule", "TOKEN_DTYPES", "TokenFileDataModule", "TokenWindowDataset",
]
