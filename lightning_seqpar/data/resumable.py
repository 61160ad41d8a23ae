"""A training loader that remembers its position within the epoch, for exact mid-epoch resume.

Note [Exact mid-epoch resume]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning checkpoints its loops (epoch, batches done in the epoch, optimizer steps) and, for
every training loader that has ``state_dict`` / ``load_state_dict``, that loader's state
(``loops.fit_loop.state_dict.combined_loader``); on resume it hands the state back before the
first batch. A plain ``DataLoader`` has no such state, so a run resumed in the middle of an
epoch would start the epoch again. ``SequenceParallelStrategy.process_dataloader`` therefore
wraps every training loader in :class:`ResumableLoader`, whose state is

    {"batches": batches handed out in this epoch, "epoch": the sampler's epoch,
     "samples_per_batch": batch_size x the sampler's num_replicas (the global batch)}

On resume the first iteration sets the sampler's epoch and skips that many batches. For a
map-style ``DataLoader`` the skip happens on the batch sampler's indices (a new ``DataLoader``
over the same dataset whose batch sampler drops the first batches): no sample is loaded twice.
Any other iterable is advanced by reading and dropping the batches. The order of the samples
must depend only on (seed, epoch), as it does with the ``DistributedSampler`` that Lightning
adds under the strategy, or with a sampler that has its own seeded generator. The count is of
batches handed to Lightning, which reads one batch ahead of the step only for loaders without a
length (iterable datasets): for those a resume starts one batch late.

A ``DataLoader`` draws from the global random generator when it creates an iterator (the base
seed of its workers). The strategy restores the random state just before the first step after
a resume, after Lightning created the iterator; the draws still fall where they fell in the run
that saved: a resume in the middle of an epoch creates the iterator at once (the saved state
already includes that epoch's draw), a resume at the end of an epoch creates it at the first
batch (the run that saved drew after the checkpoint).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler

__all__ = ["ResumableLoader"]


class ResumableLoader:
    """Wrap a training loader so that Lightning saves and restores the position within the epoch.

    Args:
        loader: a ``DataLoader`` (or any iterable of batches; sized ones report their length).

    Attributes other than the state are read from ``loader`` (``sampler``, ``batch_size``,
    ``dataset``, ...), so Lightning's ``set_epoch`` reaches the sampler.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        if isinstance(loader, ResumableLoader):
            raise ValueError("ResumableLoader: the loader is already a ResumableLoader")
        self.loader = loader
        self._batches = 0
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError for unsized loaders, as theirs

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_batches", "_resume"):  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def worker_init_fn(self) -> Any:
        return getattr(self.loader, "worker_init_fn", None)

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Any) -> None:  # Lightning sets it when seeding workers
        self.loader.worker_init_fn = fn  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        skip = self._batches_to_skip(resume) if resume is not None else 0
        sampler = getattr(self.loader, "sampler", None)
        if skip and resume is not None and resume.get("epoch") is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(resume["epoch"])  # type: ignore[union-attr]
        self._batches = skip
        if skip:
            return _Counting(self, self._skipping_iterator(skip))
        if resume is not None:
            # The saved epoch had ended (or not begun): the run that saved created the next
            # epoch's iterator after the checkpoint, so create it at the first batch, after the
            # strategy restored the random state.
            return _Counting(self, _Deferred(lambda: iter(self.loader)))
        return _Counting(self, iter(self.loader))

    def _skipping_iterator(self, skip: int) -> Iterator[Any]:
        loader = self.loader
        if isinstance(loader, DataLoader) and loader.batch_sampler is not None:
            return iter(_with_batch_sampler(loader, _SkipBatches(loader.batch_sampler, skip)))
        return itertools.islice(iter(loader), skip, None)  # read and drop

    # ------------------------------------------------------------------------------------------ state

    def _samples_per_batch(self) -> int | None:
        batch_size = getattr(self.loader, "batch_size", None)
        if not isinstance(batch_size, int):
            return None
        return batch_size * int(getattr(getattr(self.loader, "sampler", None), "num_replicas", 1))

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch (saved by Lightning with its loops)."""
        return {
            "batches": self._batches,
            "epoch": getattr(getattr(self.loader, "sampler", None), "epoch", None),
            "samples_per_batch": self._samples_per_batch(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s position at the next iteration."""
        missing = {"batches", "epoch", "samples_per_batch"} - set(state_dict)
        if missing:
            raise ValueError(f"ResumableLoader.load_state_dict: the state has no {sorted(missing)}; got keys {sorted(state_dict)}")
        self._resume = dict(state_dict)

    def _batches_to_skip(self, resume: dict[str, Any]) -> int:
        done = int(resume["batches"])
        if done == 0:
            return 0
        try:
            length = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        if length is not None and done >= length:
            return 0  # the checkpoint was written at the end of the epoch: the next one starts afresh
        saved, now = resume["samples_per_batch"], self._samples_per_batch()
        if saved is not None and now is not None and saved != now:
            raise ValueError(
                f"ResumableLoader: the checkpoint stopped {done} batches into an epoch with a global batch of {saved} "
                f"samples (batch_size x data-parallel size), but this run's global batch is {now}; resume with the "
                f"same global batch (per-rank batch_size = {saved} / data-parallel size) or from a checkpoint "
                "written at the end of an epoch"
            )
        return done


class _Counting(Iterator[Any]):
    """Counts the batches handed to Lightning (not those prefetched by workers)."""

    def __init__(self, owner: ResumableLoader, iterator: Iterator[Any]) -> None:
        self.owner, self.iterator = owner, iterator

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.owner._batches += 1
        return batch


class _Deferred(Iterator[Any]):
    """An iterator made by ``factory`` at the first ``next``."""

    def __init__(self, factory: Any) -> None:
        self.factory, self.iterator = factory, None

    def __next__(self) -> Any:
        if self.iterator is None:
            self.iterator = self.factory()
        return next(self.iterator)


class _SkipBatches(Sampler[list[int]]):
    """A batch sampler without the first ``skip`` batches of ``batch_sampler`` (indices only: no data is read)."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]


def _with_batch_sampler(loader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """A DataLoader like ``loader`` (its public settings) that reads batches from ``batch_sampler``."""
    return DataLoader(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=False,  # used for the rest of one epoch only
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )
