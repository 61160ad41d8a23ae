"""How a sequence is split over the sequence-parallel ranks, and what is split with it.

``layouts.py``: ``shard_sequence`` / ``unshard_sequence`` / ``sequence_index``, the zigzag and contiguous
layouts (Note [Sequence layouts]); ``documents.py``: packed documents (masks, per-document zigzag, the
documents of the current batch); ``batches.py``: a batch checked, padded and sharded (``shard_batch`` /
``gather_sequence``); ``agreement.py``: the one cross-rank input check. The functional API is this face:
``from lightning_seqpar.sharding import shard_sequence, unshard_sequence``.
"""

from __future__ import annotations

from lightning_seqpar.sharding.layouts import LAYOUTS, Layout, sequence_index, shard_sequence, unshard_sequence

__all__ = ["LAYOUTS", "Layout", "sequence_index", "shard_sequence", "unshard_sequence"]
