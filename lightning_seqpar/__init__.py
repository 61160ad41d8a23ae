"""lightning_seqpar: exact sequence parallelism (ring, all-gather, Ulysses, 2D) for PyTorch Lightning.

Public names: :class:`SequenceParallelStrategy` (also registered as the Trainer strategies
"seqpar", "seqpar_ring", "seqpar_allgather", "seqpar_ulysses", "seqpar_2d"),
:class:`CausalLMModule` and the callback :class:`PreemptionCheckpoint` (checkpoint and stop on
SIGTERM). The functional API lives in ``lightning_seqpar.attention`` and
``lightning_seqpar.sharding``; the loss in ``lightning_seqpar.loss``; models in ``lightning_seqpar.models``;
data in ``lightning_seqpar.data``; transformers models in ``lightning_seqpar.hf``; long-context evaluation in
``lightning_seqpar.training.metrics`` (``LossByPosition``, ``PasskeyAccuracy``) and
``lightning_seqpar.training.callbacks`` (``LongContextEval``).

The folders are the layers of docs/architecture.md, from the top: ``cli`` (the ``seqpar`` command),
``training`` (the LightningModules, metrics, callbacks), ``strategy.py`` (Lightning's hooks), ``hf``,
``planner`` (memory and mesh plans), ``parallel`` (the strategy's internals: options, mesh, ``apply_*``,
checkpoint files), ``routing`` and ``models``, ``attention``, ``sharding`` and ``data``, ``loss`` and ``checks.py``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning_seqpar.strategy import SequenceParallelStrategy
from lightning_seqpar.training.module import CausalLMModule
from lightning_seqpar.training.preemption import PreemptionCheckpoint

try:
    __version__ = version("lightning-seqpar")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0.dev0"

__all__ = ["CausalLMModule", "PreemptionCheckpoint", "SequenceParallelStrategy", "__version__"]
