"""Callbacks that inject faults into a run, for the fault-tolerance tests (importable by subprocesses).

Note: the tests directory must be on PYTHONPATH of the processes that load these.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L


class PauseAtStep(L.Callback):
    """After optimizer step ``step``, write ``marker_dir/paused-<rank>`` (holding the pid) and wait
    until ``marker_dir/continue`` exists, so that a test can signal or kill a process at a known point.

    Args:
        step: the global step after which to pause.
        marker_dir: folder of the marker files.
        max_wait: seconds to wait for ``continue`` before failing the run.
    """

    def __init__(self, step: int, marker_dir: str, max_wait: float = 120.0) -> None:
        self.step, self.marker_dir, self.max_wait = step, Path(marker_dir), max_wait

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != self.step:
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker = self.marker_dir / f"paused-{trainer.global_rank}"
        marker.with_suffix(".tmp").write_text(str(os.getpid()))
        os.replace(marker.with_suffix(".tmp"), marker)
        deadline = time.monotonic() + self.max_wait
        while not (self.marker_dir / "continue").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"PauseAtStep: no {self.marker_dir / 'continue'} within {self.max_wait}s")
            time.sleep(0.05)
