"""Sequence-parallel token mixers that are not softmax attention: the short causal convolution,
the gated delta rule (gated DeltaNet, Qwen3-Next, Kimi Delta Attention), Mamba2's state-space duality
(SSD) scan (and with it MiniMax's lightning attention), Mamba1's selective scan and RecurrentGemma's
RG-LRU — exact under sequence sharding, with the contiguous and the zigzag layout.

One file per family, over the shared part (imports run one way: down to ``base.py``, never back up):

    recurrence.py   Recurrence: the module the models' token mixers call          (every family below)
    conv.py         the short convolution            delta_rule.py   the gated delta rule, KDA
    ssd.py          Mamba2's SSD scan                rglru.py        the RG-LRU (over selective.py)
    chunked.py      the chunked kernels of delta_rule.py and ssd.py (fla-core on CUDA)
    selective.py    Mamba1's selective scan, the diagonal kernel and its parallel state passing
    base.py         the state chain, the checks, the documents' segment layout, the fp32 guard
                    (over lightning_seqpar.attention.scan, the blocked scan of the states)

Public names (all importable from this package):

* :func:`causal_conv1d` — depthwise causal convolution over sequence shards (halo exchange).
* :func:`gated_delta_rule` — the gated delta rule over sequence shards (state passing).
* :func:`ssd_scan` — Mamba2's selective scan (scalar decay per head and token) over sequence shards.
* :func:`selective_scan` — Mamba1's selective scan (decay per channel and state index) over sequence
  shards (Note [Mamba1's selective scan under sequence sharding]).
* :func:`diagonal_recurrence` — a diagonal linear recurrence (RecurrentGemma's RG-LRU) over sequence
  shards, and :func:`sequence_starts` (where its state starts from zero: Note [Diagonal linear
  recurrences under sequence sharding]).
* :func:`gated_delta_rule_chunked`, :func:`ssd_scan_chunked` — the one-device kernels (pure torch,
  chunked, the chunk states by the blocked scan of :mod:`lightning_seqpar.attention.scan`; ``fla-core``
  on CUDA when installed), with an initial state in and the final state out.
* :class:`Recurrence` — a parameter-free module that the model's token mixers call; ``configure``
  gives it the sequence-parallel mesh and layout (as :class:`lightning_seqpar.attention.Attention`).

The Notes: [Linear recurrences under sequence sharding], [State chain under the zigzag layout],
[Documents in a recurrence] and [Recurrences in fp32 under autocast] in ``base.py``; [Halo exchange
for the short convolution] in ``conv.py``; [Chunked gated recurrences] in ``chunked.py``; [Mamba1's
selective scan under sequence sharding] and [Parallel state passing for diagonal recurrences] in
``selective.py``; [Diagonal linear recurrences under sequence sharding] in ``rglru.py``.
"""

from __future__ import annotations

from lightning_seqpar.attention.recurrent.base import RECURRENT_KERNELS, Kernel  # noqa: F401 - the kernels' Literal, as before
from lightning_seqpar.attention.recurrent.chunked import fla_installed, fla_unusable
from lightning_seqpar.attention.recurrent.conv import causal_conv1d
from lightning_seqpar.attention.recurrent.delta_rule import gated_delta_rule, gated_delta_rule_chunked
from lightning_seqpar.attention.recurrent.recurrence import Recurrence
from lightning_seqpar.attention.recurrent.rglru import diagonal_recurrence, sequence_starts
from lightning_seqpar.attention.recurrent.selective import selective_scan
from lightning_seqpar.attention.recurrent.ssd import ssd_scan, ssd_scan_chunked

__all__ = [
    "RECURRENT_KERNELS",
    "Recurrence",
    "causal_conv1d",
    "diagonal_recurrence",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "selective_scan",
    "sequence_starts",
    "ssd_scan",
    "ssd_scan_chunked",
]

