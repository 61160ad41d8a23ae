"""Checkpoint files and folders of ``SequenceParallelStrategy``: written whole, checked, loaded (also in one
process, as ``seqpar export`` reads them), and the random state they hold.

Note [Checkpoint formats]
~~~~~~~~~~~~~~~~~~~~~~~~~
save_distributed_checkpoint=True: ModelParallelStrategy's folder of shards written by
torch.distributed.checkpoint (plus meta.pt with the rest of the Lightning checkpoint).
False: one file with the full model and optimizer state dicts of
torch.distributed.checkpoint.state_dict, i.e. keyed by parameter names as the plain model
has them (activation checkpointing and compile wrappers leave no trace in the names)
(:func:`load_full_checkpoint`). Both load into any mesh layout: a full tensor is re-sharded on load.

Note [Complete checkpoints only]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint (a folder of shards, or one file) appears under its name only once it is complete
(every rank has written its shards and rank 0 meta.pt), so a run killed while saving leaves the
previous checkpoint of that name (or none), never a half-written one: the strategy writes to
:func:`partial_path` and rank 0 moves it into place with :func:`replace` after a barrier. What
was being written stays as NAME.partial, which Lightning's ckpt_path="last" never takes (it
looks for last*.ckpt) and the next save of that name removes; :func:`check_loadable` refuses it,
and a folder without its ``.metadata`` / ``meta.pt``, by name.

Note [Checking a checkpoint's files]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A complete checkpoint can still be broken afterwards: a shard copied halfway, a file deleted, a
disk that filled up. torch then fails deep in the collective load ("PytorchStreamReader failed
reading zip archive ... internal miniz error") without naming a file, and ranks that read other
files wait for it. So before loading, every rank checks the files locally
(:func:`check_files`; no communication, a few KB read per file):

* a folder of shards: ``.metadata`` unpickles; every file its ``storage_data`` lists exists and
  holds at least the largest ``offset + length`` recorded for it (torch.distributed.checkpoint
  writes each item at a recorded offset and length, so a truncated shard is shorter than that);
  ``meta.pt`` is a whole torch.save file (below);
* one file (and ``meta.pt``): torch.save writes a zip archive whose central directory is at the
  end, so a truncated file has none (``zipfile`` cannot open it). A pickle (torch.save's legacy
  format) is not checked.

Every problem found is named in one ``ValueError`` with the checkpoint and the file. Every rank
sees the same files (loading under another layout reads other ranks' shards, so the folder is
shared), so every rank raises the same error before the load's first collective.

The random state of a process is kept as plain values a checkpoint can hold
(``torch.load(weights_only=True)``). A resumed run continues the random streams where the
stopped one left them: the strategy gathers every rank's state into the checkpoint
(:func:`gather_rng_states`) and each rank puts its own back (:func:`rng_state_of_rank`,
:func:`set_rng_state`) before the first training step after the resume (Note [Exact mid-epoch
resume] in ``lightning_seqpar.data.resumable`` for why that moment).
"""

from __future__ import annotations

import os
import random
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "atomic_save",
    "check_checkpoint",
    "check_module_checkpoint",
    "check_files",
    "check_loadable",
    "full_optimizer_state",
    "gather_rng_states",
    "get_rng_state",
    "load_full_checkpoint",
    "load_meta",
    "load_model_state_dict",
    "partial_path",
    "remove",
    "replace",
    "rng_state_of_rank",
    "set_rng_state",
    "write_complete",
]

# --------------------------------------------------------------------------------------------- files


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written until it is complete (Note [Complete checkpoints only])."""
    return path.with_name(path.name + ".partial")


def remove(path: Path) -> None:
    """Remove a file or folder if it exists."""
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def replace(source: Path, target: Path) -> None:
    """Put the folder or file ``source`` at ``target``, replacing what is there; ``target`` never holds a mix of both.

    A file replaces a file in one ``os.replace``. A folder cannot replace a folder atomically: the old one is
    renamed to ``TARGET.old`` first, so a kill between the two renames leaves the previous complete checkpoint
    as ``TARGET.old`` (pass it as ckpt_path) and no ``TARGET``."""
    if target.is_file() and source.is_file():
        os.replace(source, target)
        return
    if target.exists():
        old = target.with_name(target.name + ".old")
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(source, target)


def write_complete(path: Path, write: Callable[[Path], None], *, barrier: Callable[[str], None], rank_zero: bool,
                   every_rank_writes: bool) -> None:
    """Write a checkpoint on every rank (collective) so that ``path`` appears only once it is complete (Note [Complete
    checkpoints only]): ``write(partial_path(path))``, then rank 0 moves it into place, between barriers (one more
    before the move when every rank writes its shards)."""
    partial = partial_path(path)
    if rank_zero:
        remove(partial)
    barrier("seqpar_save_checkpoint_start")
    write(partial)
    if every_rank_writes:
        barrier("seqpar_save_checkpoint_written")
    if rank_zero:
        replace(partial, path)
    barrier("seqpar_save_checkpoint_renamed")


def check_loadable(path: Path, *, owner: str) -> None:
    """Raise naming ``path`` when it is not a complete checkpoint (Note [Complete checkpoints only])."""
    if path.name.endswith(".partial"):
        raise ValueError(
            f"{owner}: {str(path)!r} is not a complete checkpoint: its save did not finish (was the run "
            f"killed while saving?); resume from {str(path.with_name(path.name.removesuffix('.partial')))!r} if it "
            "exists, or an earlier checkpoint (ckpt_path='last' never takes a .partial one)"
        )
    if path.is_dir():  # a folder of shards
        missing = [name for name in (".metadata", "meta.pt") if not (path / name).is_file()]
        if missing:
            raise ValueError(
                f"{owner}: {str(path)!r} is not a complete distributed checkpoint (no {missing}): "
                "its save did not finish (was the run killed while saving?); resume from an earlier checkpoint"
            )
    elif not path.is_file():
        raise FileNotFoundError(f"{owner}: no checkpoint at {str(path)!r}")
    check_files(path, owner=owner)


def check_files(path: Path, *, owner: str) -> None:
    """Raise one ``ValueError`` naming the checkpoint ``path`` and each of its files that is missing, shorter than recorded,
    or not a whole torch.save archive (Note [Checking a checkpoint's files]). Local: no communication."""
    if not path.is_dir():
        problems = _torch_save_problems(path)
        if problems:
            raise ValueError(f"{owner}: the checkpoint file {str(path)!r} is broken: {problems}; it cannot be loaded: "
                             "resume from another checkpoint, or copy this one again")
        return
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # an unpickling error of any kind: truncated, or not written by torch.distributed.checkpoint
        raise ValueError(f"{owner}: the checkpoint {str(path)!r} is broken: its .metadata does not load "
                         f"({type(error).__name__}: {error}); resume from another checkpoint") from error
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            needed[name] = max(needed.get(name, 0), offset + length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing (its .metadata lists it)")
        elif file.stat().st_size < size:
            problems.append(f"{name} has {file.stat().st_size} bytes where its .metadata records {size} (truncated)")
    meta = _torch_save_problems(path / "meta.pt")
    if meta:
        problems.append(f"meta.pt {meta}")
    if problems:
        raise ValueError(f"{owner}: the checkpoint {str(path)!r} is broken: {'; '.join(problems)}. It cannot be loaded: "
                         "resume from another checkpoint, or copy this one again (every file of the folder is needed)")


def _torch_save_problems(path: Path) -> str:
    """What is wrong with a torch.save file ("" when nothing is seen): empty, or a zip archive without its end."""
    if not path.is_file():
        return "is missing"
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "is empty (0 bytes)"
    if head.startswith(b"\x80"):  # a pickle: torch.save's legacy format, nothing to check
        return ""
    if not head.startswith(b"PK"):
        return f"is not a torch.save file (it starts with {head!r}, not a zip archive)"
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
    except (zipfile.BadZipFile, OSError) as error:
        return f"is a zip archive without its end ({error}: truncated, {path.stat().st_size} bytes)"
    return "" if end <= path.stat().st_size else f"has {path.stat().st_size} bytes, its zip directory records {end} (truncated)"


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) state of ``optimizer`` over the sharded ``model``, on the CPU: what a one-file checkpoint
    holds (Note [Checkpoint formats])."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_checkpoint(path: Path, model: nn.Module, optimizers: list[Any], *, strict: bool, fitting: bool,
                         weights_only: bool | None) -> dict[str, Any]:
    """Load a one-file checkpoint (Note [Checkpoint formats]) into the sharded ``model`` (and ``optimizers``
    when ``fitting``); returns the rest of the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    # Every rank reads the (memory-mapped) file and keeps its own shard of each full tensor.
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    optimizer_states = checkpoint.pop("optimizer_states", [])
    if fitting:
        for optimizer, state in zip(optimizers, optimizer_states):
            set_optimizer_state_dict(model, optimizer, state, options=options)
    return checkpoint

# --------------------------------------------------------------------------------------------- reading in one process

_META = "meta.pt"  # Lightning's name for the non-tensor part of a folder checkpoint


def _is_folder_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / _META).is_file()


def check_checkpoint(path: Path, *, owner: str = "export") -> None:
    """Raise naming ``path`` when it is neither a checkpoint file nor a complete folder of shards, or when one of its
    files is broken (:func:`check_files`); ``owner`` starts the message. What reading in one process checks first."""
    if path.is_file() or _is_folder_checkpoint(path):
        check_files(path, owner=owner)  # every file there and whole (Note [Checking a checkpoint's files])
        return
    if path.is_dir():
        raise ValueError(
            f"{owner}: {str(path)!r} is not a complete distributed checkpoint (needs .metadata and {_META}); was its "
            "save interrupted? Pass another checkpoint"
        )
    raise FileNotFoundError(f"{owner}: no checkpoint at {str(path)!r}")


def load_meta(path: str | os.PathLike, *, owner: str = "export") -> dict[str, Any]:
    """The non-tensor part of a checkpoint (hyper-parameters, loops, ...), without the model and optimizer."""
    path = Path(path)
    check_checkpoint(path, owner=owner)
    if path.is_dir():
        return torch.load(path / _META, map_location="cpu", weights_only=True)
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


def load_model_state_dict(path: str | os.PathLike, *, owner: str = "export") -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (CausalLMModule names, ``model.`` prefix), on CPU.

    For a folder of shards only the model's tensors are read (not the optimizer's).
    """
    path = Path(path)
    check_checkpoint(path, owner=owner)
    if path.is_file():
        return dict(torch.load(path, mmap=True, map_location="cpu", weights_only=True)["state_dict"])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    model = {
        key[len(prefix):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{owner}: {str(path)!r} holds no model tensors under 'state_dict' (keys: {sorted(metadata.state_dict_metadata)[:5]})")
    state = {"state_dict": model}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["state_dict"]


def check_module_checkpoint(meta: Any, path: str | os.PathLike, *, owner: str = "export",
                            state_keys: Any = None) -> None:
    """Refuse, naming ``path``, what is not a checkpoint of ``CausalLMModule`` (an arbitrary ``torch.save`` dict):
    ``meta`` (the checkpoint without its tensors, :func:`load_meta`) must hold the module's ``hyper_parameters['model']``
    (the model's config, which an export rebuilds the model from); ``state_keys`` (the model state dict's keys, where
    read) must sit under ``model.``."""
    problems = []
    if not isinstance(meta, dict):
        problems.append(f"it holds a {type(meta).__name__}, not a checkpoint dict")
    else:
        hparams = meta.get("hyper_parameters")
        if not isinstance(hparams, dict) or "model" not in hparams:
            problems.append("its hyper_parameters have no 'model' (CausalLMModule saves the model's config there)")
    if state_keys is not None:
        outside = sorted(k for k in state_keys if not str(k).startswith("model."))
        if outside:
            problems.append(f"its state_dict has keys outside 'model.' ({outside[:3]})")
    if problems:
        raise ValueError(f"{owner}: {str(path)!r} is not a checkpoint of CausalLMModule: {'; '.join(problems)}. "
                         "Export a checkpoint that a run of CausalLMModule saved (a .ckpt folder of shards or file)")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` through ``PATH.partial``: ``path`` never holds a half-written file."""
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    os.replace(partial, path)



# --------------------------------------------------------------------------------------------- random state


def gather_rng_states(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's :func:`get_rng_state`, in rank order (collective when a process group of several ranks exists)."""
    state = get_rng_state(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def rng_state_of_rank(states: list[dict[str, Any]] | None, rank: int) -> dict[str, Any] | None:
    """The state rank ``rank`` restores from a checkpoint's states (rank r of a smaller saved world: r mod its size)."""
    return states[rank % len(states)] if states else None


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
