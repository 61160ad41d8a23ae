"""The random state of a process, as plain values a checkpoint can hold (``torch.load(weights_only=True)``).

A resumed run continues the random streams where the stopped one left them: the strategy
gathers every rank's state into the checkpoint and each rank puts its own back before the first
training step after the resume (Note [Exact mid-epoch resume] in ``lightning_seqpar.data.resumable``
for why that moment).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """Python's, NumPy's and torch's CPU generator states, and ``device``'s when it is a GPU."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`get_rng_state` (the GPU state only when both have one)."""
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"set_rng_state: the state has no {sorted(missing)} generator; got {sorted(state)}")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
