"""``PreemptionCheckpoint``: on SIGTERM, finish the step on every rank, write a checkpoint, stop.

Note [SIGTERM under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Schedulers (SLURM, Kubernetes, torchrun) send SIGTERM before they kill a job; the job has a grace
period to save. Saving a distributed checkpoint is a collective, so every rank must save at the
same point of the program, while the signal may reach one rank or all of them, at any moment,
possibly while a rank waits inside a collective of the step.

This callback's handler only sets a flag (no communication inside a signal handler: a
collective started at an arbitrary point of the step by some ranks only would pair with the
step's own collectives, or wait forever for ranks that are blocked in them). At the end of each
training step, where all ranks are in step, the ranks OR their flags with one all-reduce of one
integer (``strategy.reduce_boolean_decision``); if any rank was signalled, all of them write the
checkpoint (``trainer.save_checkpoint``, the same call and state as ``ModelCheckpoint``'s) and
stop the Trainer (``trainer.should_stop``). The run then ends normally; ``fit(ckpt_path="last")``
finds the checkpoint, since the class is an ``OnExceptionCheckpoint``.

Lightning 2.6's own SIGTERM handler broadcasts from inside the signal handler (and raises
``SIGTERMException`` at the next step); that broadcast is the unsafe pattern above, so while this
callback is active its handler replaces Lightning's for the duration of the training loop
(Lightning restores the original handlers when ``fit`` ends).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["PreemptionCheckpoint"]


class PreemptionCheckpoint(OnExceptionCheckpoint):
    """Checkpoint and stop when the run receives SIGTERM (Note [SIGTERM under sequence parallelism]).

    Args:
        dirpath: folder of the checkpoint ``dirpath/filename.ckpt``.
        filename: its name without extension.
        signals: names of the signals that request a checkpoint (default ``("SIGTERM",)``).
        check_every_n_steps: how often the ranks compare their flags (one all-reduce of one
            integer); the checkpoint is written at most this many steps after the signal.

    ``saved_at_step`` is the global step of the checkpoint this run wrote (None if none). Unlike
    its parent class it writes nothing on other exceptions: after an arbitrary error the ranks
    may be in different places and a collective save could hang.
    """

    def __init__(
        self,
        dirpath: str,
        filename: str = "preempted",
        *,
        signals: Sequence[str] = ("SIGTERM",),
        check_every_n_steps: int = 1,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if not isinstance(check_every_n_steps, int) or isinstance(check_every_n_steps, bool) or check_every_n_steps < 1:
            raise ValueError(f"PreemptionCheckpoint: check_every_n_steps must be a positive int, got {check_every_n_steps!r}")
        known = {s.name for s in signal.Signals}
        unknown = [name for name in signals if name not in known]
        if unknown or isinstance(signals, str):
            raise ValueError(f"PreemptionCheckpoint: signals must be a list of signal names such as ['SIGTERM'], got {signals!r}")
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.check_every_n_steps = check_every_n_steps
        self.requested = False
        self.saved_at_step: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True  # nothing else: see the Note

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.requested, self.saved_at_step = False, None
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._request)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step % self.check_every_n_steps:
            return
        if not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        trainer.save_checkpoint(self.ckpt_path)
        self.saved_at_step = trainer.global_step
        trainer.should_stop = True
        rank_zero_info(f"PreemptionCheckpoint: signal received; saved {self.ckpt_path} at step {trainer.global_step}, stopping")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.on_train_end(trainer, trainer.lightning_module)  # put the handlers back; save nothing

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.saved_at_step is None:  # a fit that finished: an older preemption checkpoint is stale
            super().teardown(trainer, pl_module, stage)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath), "filename": self.filename}
