"""Callbacks that inject faults into a run, for the fault-tolerance tests (importable by subprocesses).

Note: the tests directory must be on PYTHONPATH of the processes that load these.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L


def _pause(marker_dir: Path, rank: int, max_wait: float, owner: str) -> None:
    """Write ``marker_dir/paused-<rank>`` (holding the pid), then wait for ``marker_dir/continue``."""
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker = marker_dir / f"paused-{rank}"
    marker.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(marker.with_suffix(".tmp"), marker)
    deadline = time.monotonic() + max_wait
    while not (marker_dir / "continue").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{owner}: no {marker_dir / 'continue'} within {max_wait}s")
        time.sleep(0.05)


class PauseAtStep(L.Callback):
    """Pause at a known point of a run, so that a test can signal or kill a process there: write
    ``marker_dir/paused-<rank>`` (holding the pid) and wait until ``marker_dir/continue`` exists.

    Args:
        step: the global step at which to pause.
        marker_dir: folder of the marker files.
        max_wait: seconds to wait for ``continue`` before failing the run.
        hook: "on_train_batch_end" (after optimizer step ``step``, between steps) or
            "on_before_backward" (inside the training step that follows optimizer step ``step``:
            after its forward, before its backward's collectives).
        ranks: the ranks that pause (None: all).
    """

    def __init__(self, step: int, marker_dir: str, max_wait: float = 120.0, hook: str = "on_train_batch_end",
                 ranks: list[int] | None = None) -> None:
        if hook not in ("on_train_batch_end", "on_before_backward"):
            raise ValueError(f"PauseAtStep: hook={hook!r} is not supported; expected 'on_train_batch_end' or 'on_before_backward'")
        self.step, self.marker_dir, self.max_wait, self.hook, self.ranks = step, Path(marker_dir), max_wait, hook, ranks

    def _maybe_pause(self, trainer: L.Trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_step == self.step and (self.ranks is None or trainer.global_rank in self.ranks):
            _pause(self.marker_dir, trainer.global_rank, self.max_wait, type(self).__name__)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe_pause(trainer, "on_train_batch_end")

    def on_before_backward(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe_pause(trainer, "on_before_backward")


class _PauseWhenPickled:
    """Pauses (see :func:`_pause`) when ``torch.save`` pickles it; pickles as a plain string."""

    def __init__(self, marker_dir: Path, rank: int, max_wait: float) -> None:
        self.marker_dir, self.rank, self.max_wait = marker_dir, rank, max_wait

    def __reduce__(self) -> tuple[Any, ...]:
        _pause(self.marker_dir, self.rank, self.max_wait, "PauseInCheckpointSave")
        return (str, ("paused",))


class PauseInCheckpointSave(L.Callback):
    """Pause rank 0 in the middle of writing the first checkpoint at global step ``step``: after every
    rank wrote its shards of a distributed checkpoint, while rank 0 writes ``meta.pt`` (the callback's
    state holds an object that pauses when pickled). A process killed there leaves a half-written
    checkpoint (``NAME.partial`` with shards and ``.metadata`` but no ``meta.pt``).

    Args: as :class:`PauseAtStep`.
    """

    def __init__(self, step: int, marker_dir: str, max_wait: float = 120.0) -> None:
        self.step, self.marker_dir, self.max_wait = step, Path(marker_dir), max_wait
        self._paused = False

    def state_dict(self) -> dict[str, Any]:
        trainer_step = getattr(self, "_global_step", None)
        if self._paused or trainer_step != self.step or getattr(self, "_rank", None) != 0:
            return {}
        self._paused = True
        return {"pause": _PauseWhenPickled(self.marker_dir, 0, self.max_wait)}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._global_step, self._rank = trainer.global_step, trainer.global_rank

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._global_step, self._rank = trainer.global_step, trainer.global_rank
