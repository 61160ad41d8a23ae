"""What a run of :class:`~lightning_seqpar.strategy.SequenceParallelStrategy` holds and gives back: the
process groups of its meshes (tied to the module they serve), the default process group it created, the
device's and the pinned host memory's caches. Local calls only: no collective.

Note [What a run releases]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The process groups of a run's meshes (Note [Releasing the groups of a mesh] in
``lightning_seqpar.parallel.mesh``: five per run at any world size, each with its own threads on gloo,
a communicator, proxy thread and GPU memory on NCCL) are what the parallelized module runs
on: FSDP2 gathers over them, and so does ``get_model_state_dict(full_state_dict=True)`` or a
``trainer.validate`` after ``fit``. So they live exactly as long as that module:

* ``weakref.finalize`` on the module destroys them when the module is freed, and with them
  the default process group if this strategy created it (``init_process_group`` ran in the
  run, not before it) and no other groups are left (another run may be using it);
* ``teardown`` (the end of every run) runs Python's cycle collector: a finished run's module
  sits in reference cycles (Trainer <-> LightningModule) that Python frees at no set time, so
  the module of an earlier run that the program dropped is freed, and its groups released,
  by the next run's end at the latest (``gc.collect()``, ~0.1 s); what remains are the groups
  of modules the program still holds;
* a later run of the same strategy on the same (already parallelized) module reuses the
  meshes: no new groups;
* a run that failed (set-up or a step: Lightning calls ``on_exception`` and then
  ``teardown``) releases its groups and the default group it created at once: after a
  failure they may be unusable (a dead peer), and the module is not trained further;
* every run also drops the packed documents of its last batch (device tensors) and, on
  CUDA, empties the pinned host memory cache (``offload_checkpoints`` / ``offload_params``)
  and the device memory cache.

``tests/test_resources.py`` counts threads, file descriptors, RSS and CUDA memory over ten
fits in one process.

Note [Pinning host memory in parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Offloaded checkpoints (``offload_checkpoints``) grow torch's caching host allocator during the
first step: every block input goes to pinned host memory, which the later steps reuse. By
default the allocator pins with ``cudaHostAlloc``, one call under the driver's global lock that
faults in and locks every page on one thread: on 4 x H200 the first step of Qwen3-8B at 1M
tokens with 16 packed documents took 195 s against 76 s for the second (~78 GB pinned per
rank). torch's own documented remedy (the ``pinned_use_cuda_host_register`` and
``pinned_num_register_threads`` keys of ``PYTORCH_CUDA_ALLOC_CONF``; 8 threads is the value its
documentation recommends from benchmarks) allocates with ``malloc``, faults the pages in on 8
threads and then locks them with ``cudaHostRegister``. ``prefer_parallel_pinning`` turns it on
when a run offloads to the host on CUDA, unless the user's ``PYTORCH_CUDA_ALLOC_CONF`` /
``PYTORCH_ALLOC_CONF`` already names a ``pinned_`` key (theirs wins). The allocator reads both
keys at each allocation and frees each block the way it was allocated, so turning them on at
set-up, after earlier pinned allocations, is safe; torch's parser only changes the keys it is
given.

Note [Expandable segments by default]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The memory planner (Note [Planning memory] in ``lightning_seqpar.planner.memory``) plans the bytes a step
allocates; the CUDA caching allocator reserves fixed-size segments and can only reuse a freed block
for a request that fits inside it, so at long lengths, where a step allocates tensors of several GB
that change size between phases (a layer's saved activations, the ring's buffers, the loss
chunk), the reserved memory runs ahead of the allocated and a request fails, or is met only after
freeing every cached block and synchronizing (a cudaMalloc retry), with GBs nominally free. With
``expandable_segments:True`` the allocator maps physical pages into one growing virtual range per
stream instead, and the reserved memory follows the allocated. All three peers launch with it:
torchtitan's ``run_train.sh`` sets ``PYTORCH_ALLOC_CONF=expandable_segments:True``, TRL's
long-context guide tells users to set it ("still fails without it" at 1M tokens) and ALST's paper
recommends it. ``prefer_expandable_segments`` turns it on at ``setup_environment`` on CUDA, before
the model is built, unless the user's ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` already
names ``expandable_segments`` (theirs wins). Blocks allocated before stay in their segments; only
new segments are expandable, so turning it on mid-process is safe (torch's own tests do).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_seqpar.parallel.mesh import release_mesh_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RunGroups", "empty_device_caches", "free_unreferenced", "launched_by_torchelastic", "pinning_in_effect",
           "prefer_expandable_segments", "prefer_parallel_pinning", "release_groups", "segments_in_effect"]

PARALLEL_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


class RunGroups:
    """The process groups that the runs of one strategy create, and when they go (Note [What a run releases]): the
    default group where a run created it, and the groups of a run's meshes, tied to the module sharded over them."""

    def __init__(self) -> None:
        self.owns_default_group = False
        """Whether a run of this strategy created the default process group (``init_process_group`` ran in it)."""
        self.finalizer: weakref.finalize | None = None
        """Releases the groups of the meshes when the module sharded over them is freed (or when called)."""
        self.failed = False
        """Whether the current run raised (Lightning's ``on_exception``): its groups go at its end."""

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around the start of the default process group: remembers whether this run created it."""
        created = not (dist.is_available() and dist.is_initialized())
        yield
        self.owns_default_group = self.owns_default_group or created

    def tie(self, module: nn.Module, meshes: list[DeviceMesh | None]) -> None:
        """The groups of ``meshes`` live as long as ``module``, which is sharded over them (:func:`release_groups`)."""
        self.finalizer = weakref.finalize(module, release_groups, meshes, owns_default_group=self.owns_default_group)

    def release_at_end(self, meshes: list[DeviceMesh | None], *, built: bool) -> bool:
        """At a run's end: where it failed, or its set-up stopped between building the meshes (``built``) and sharding
        the module, the groups of ``meshes`` at once (through the finalizer where there is one) and the default group
        the run created (unless torchrun's agent holds its store). True when they went: the caller drops the meshes."""
        failed, self.failed = self.failed, False
        if not (failed or (self.finalizer is None and built)):
            return False
        finalizer, self.finalizer = self.finalizer, None
        if finalizer is not None:
            finalizer()  # runs release_groups once
        else:
            release_groups(meshes, owns_default_group=self.owns_default_group)
        if self.owns_default_group and not launched_by_torchelastic() and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_default_group = False
        return True


def free_unreferenced(device: torch.device) -> None:
    """Python's cycle collector (it frees the modules of earlier runs that nothing references any more, and so their
    groups), then the device's caches."""
    gc.collect()
    empty_device_caches(device)


def empty_device_caches(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks, and the caching host allocator's pinned ones, back."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned host memory (torch has no public API for it)
            torch._C._host_emptyCache()


def prefer_parallel_pinning(device: torch.device) -> bool:
    """Pinned host memory allocated on 8 threads (Note [Pinning host memory in parallel]) unless the user's allocator
    configuration names a ``pinned_`` key; True where this call turned it on."""
    if device.type != "cuda" or _user_keys("pinned_"):
        return False
    return _set_allocator("pinning", PARALLEL_PINNING, refused="pinned host memory stays on one thread")


def prefer_expandable_segments(device: torch.device) -> bool:
    """The CUDA caching allocator grows segments in place (Note [Expandable segments by default]) unless the user's
    allocator configuration names ``expandable_segments``; True where this call turned it on."""
    if device.type != "cuda" or _user_keys("expandable_segments"):
        return False
    return _set_allocator("segments", EXPANDABLE_SEGMENTS, refused="device memory keeps torch's fixed segments")


def _set_allocator(what: str, settings: str, *, refused: str) -> bool:
    """Hand ``settings`` to torch's allocator parser (it changes only the keys it is given); a refusal warns."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9 (no public API)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter(settings)
    except (RuntimeError, ValueError) as err:  # an allocator build without these keys: it stays as it was
        rank_zero_warn(f"{refused}: torch refused {settings!r} ({err})")
        return False
    _SET[what] = settings
    return True


_SET: dict[str, str] = {}


def pinning_in_effect() -> str:
    """How this process pins host memory: what :func:`prefer_parallel_pinning` set, else the user's ``pinned_`` keys,
    else torch's default (torch 2.11 has no getter for the allocator's settings; benchmark records name it)."""
    if "pinning" in _SET:
        return _SET["pinning"]
    return ",".join(_user_keys("pinned_")) or "default (cudaHostAlloc)"


def segments_in_effect() -> str:
    """How the CUDA caching allocator grows: what :func:`prefer_expandable_segments` set, else the user's key, else
    torch's default (fixed segments)."""
    if "segments" in _SET:
        return _SET["segments"]
    return ",".join(_user_keys("expandable_segments")) or "default (fixed segments)"


def _user_keys(prefix: str) -> list[str]:
    """The ``key:value`` entries of the user's allocator configuration (both variables torch reads) whose key starts
    with ``prefix``."""
    return [kv.strip() for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
            for kv in os.environ.get(var, "").split(",") if kv.strip().startswith(prefix)]


def release_groups(meshes: list[DeviceMesh | None], *, owns_default_group: bool) -> None:
    """The groups of a run's meshes, and the default group when the run created it and nothing else uses
    groups any more (Note [What a run releases]). No reference to the module: a ``weakref.finalize`` callback."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    release_mesh_groups(*meshes)
    registry = getattr(dist.distributed_c10d, "_world", None)  # torch's group registry (private; no public list)
    if owns_default_group and not launched_by_torchelastic() and registry is not None and len(registry.pg_map) == 1:
        dist.destroy_process_group()


def launched_by_torchelastic() -> bool:
    """Under torchrun the default group rendezvouses through the agent's store, whose keys a second
    init_process_group in the same process would collide with: the default group then stays for the
    process's lifetime (the mesh groups are still released)."""
    return "TORCHELASTIC_RUN_ID" in os.environ
