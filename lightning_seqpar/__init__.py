"""lightning_seqpar: exact sequence parallelism (ring, all-gather, Ulysses, 2D) for PyTorch Lightning.

Public names: :class:`SequenceParallelStrategy` (also registered as the Trainer strategies
"seqpar", "seqpar_ring", "seqpar_allgather", "seqpar_ulysses", "seqpar_2d"),
:class:`CausalLMModule` and the callback :class:`PreemptionCheckpoint` (checkpoint and stop on
SIGTERM). The functional API lives in ``lightning_seqpar.attention`` and
``lightning_seqpar.sharding``; models in ``lightning_seqpar.models``; data in ``lightning_seqpar.data``;
long-context evaluation in ``lightning_seqpar.metrics`` (``LossByPosition``, ``PasskeyAccuracy``) and
``lightning_seqpar.callbacks`` (``LongContextEval``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning_seqpar.module import CausalLMModule
from lightning_seqpar.preemption import PreemptionCheckpoint
from lightning_seqpar.strategy import SequenceParallelStrategy

try:
    __version__ = version("lightning-seqpar")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0.dev0"

__all__ = ["CausalLMModule", "PreemptionCheckpoint", "SequenceParallelStrategy", "__version__"]
