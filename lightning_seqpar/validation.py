"""Checks of a batch before it is sharded: local ones first, then one cheap cross-rank comparison.

Note [Validating batches without hanging]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A mistake in a batch must end the run with a message, never with a hang. Two kinds of check:

* :func:`check_batch` looks at this rank's batch only (keys, shapes, dtypes, masks). It
  communicates nothing and runs before any collective of the step, so a rank whose batch is
  wrong raises at once (the launcher then stops the other ranks, or they fail after the
  strategy's ``timeout``).
* :func:`check_same_batch` is the one check that needs the other ranks: all ranks of a
  sequence-parallel group must hold the SAME full sequences, or each would shard a different
  sequence and attention would silently mix them. Every rank all-gathers a few integers
  (batch size, length, dtype code and two fingerprints of its ids and labels) over all ranks,
  and every rank then finds the same disagreement and raises the same error, naming the ranks.
  Nobody waits in a collective that the others skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_seqpar.loss import IGNORE_INDEX

__all__ = ["batch_summary", "check_batch", "check_same_batch"]

_INTEGER_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids")
_DTYPE_CODES: dict[torch.dtype, int] = {
    dtype: code
    for code, dtype in enumerate(
        (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool)
    )
}


def check_batch(batch: Any, *, owner: str) -> None:
    """Raise a ValueError naming the key and the fix for a batch the strategy cannot shard correctly.

    Local: no communication. Checks that ``batch`` is a mapping with a (batch, seq_len) integer
    ``input_ids``; that ``labels`` and ``position_ids`` (when present) are integer tensors of the
    same length (``position_ids`` may have batch size 1); and that an ``attention_mask`` is a
    (batch, seq_len) right-padding mask (ones, then zeros) whose padded positions carry ignored
    labels: the sequence-parallel attention is causal over the whole sequence and supports no
    other mask.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(
            f"{owner} shards dict batches with an 'input_ids' tensor (batch, seq_len) and tensors such as "
            f"'labels' / 'position_ids' of the same length; got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(
            f"{owner}: batch['input_ids'] must be a (batch, seq_len) tensor, got {getattr(input_ids, 'shape', input_ids)!r}"
        )
    batch_size, seq_len = input_ids.shape
    for key in _INTEGER_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            dtype = getattr(value, "dtype", type(value).__name__)
            raise ValueError(
                f"{owner}: batch[{key!r}] must be an integer tensor (token ids / positions), got {dtype}; "
                f"convert it with .long() in the dataset or collate_fn"
            )
    labels = batch.get("labels")
    if labels is not None and tuple(labels.shape) != (batch_size, seq_len):
        raise ValueError(
            f"{owner}: batch['labels'] has shape {tuple(labels.shape)} but batch['input_ids'] has {(batch_size, seq_len)}; "
            "labels must be the next tokens of the FULL sequence, one per input token (shift before batching and put "
            f"{IGNORE_INDEX} on the last position), never shifted after sharding"
        )
    positions = batch.get("position_ids")
    if positions is not None and (positions.ndim != 2 or positions.shape[1] != seq_len or positions.shape[0] not in (1, batch_size)):
        raise ValueError(
            f"{owner}: batch['position_ids'] has shape {tuple(positions.shape)}; expected ({batch_size}, {seq_len}) or "
            f"(1, {seq_len}), the global position of every input token"
        )
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_attention_mask(mask, labels, batch_size=batch_size, seq_len=seq_len, owner=owner)


def _check_attention_mask(mask: Any, labels: torch.Tensor | None, *, batch_size: int, seq_len: int, owner: str) -> None:
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch_size, seq_len):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"{owner}: batch['attention_mask'] of shape {shape} is not supported: the sequence-parallel attention is "
            f"causal over the whole sequence and takes only a ({batch_size}, {seq_len}) right-padding mask; express "
            f"other masking through labels={IGNORE_INDEX} (ignored tokens) or drop the mask"
        )
    keep = mask.bool()
    # right padding: once a row has a 0, every later position is 0 (cummin keeps the first 0 on)
    if not torch.equal(keep, keep.int().cummin(dim=1).values.bool()):
        rows = torch.nonzero((keep != keep.int().cummin(dim=1).values.bool()).any(dim=1)).flatten().tolist()
        raise ValueError(
            f"{owner}: batch['attention_mask'] rows {rows[:8]} are not right padding (a 0 followed by a 1: left "
            "padding or holes); the sequence-parallel attention is causal and cannot mask tokens out. Pad on the "
            f"right, or keep the tokens and set their labels to {IGNORE_INDEX}"
        )
    if labels is not None and bool((labels[~keep] != IGNORE_INDEX).any()):
        raise ValueError(
            f"{owner}: batch['labels'] has targets where batch['attention_mask'] is 0; set labels={IGNORE_INDEX} on "
            "padding so that it does not count in the loss"
        )


def batch_summary(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """int64 (5,): batch size, sequence length, dtype code of the ids, fingerprints of ids and labels.

    The fingerprints are position-weighted sums (wrapping int64 arithmetic), so a different
    sample or a permutation of the same tokens changes them.
    """
    input_ids = batch["input_ids"]
    batch_size, seq_len = input_ids.shape
    weights = (torch.arange(1, batch_size * seq_len + 1, device=input_ids.device, dtype=torch.int64) * 2654435761) % (2**31 - 1)
    weights = weights.view(batch_size, seq_len)
    labels = batch.get("labels")
    ids_print = (input_ids.to(torch.int64) * weights).sum()
    labels_print = (labels.to(torch.int64) * weights).sum() if labels is not None else torch.zeros((), dtype=torch.int64, device=input_ids.device)
    head = torch.tensor([batch_size, seq_len, _DTYPE_CODES.get(input_ids.dtype, -1)], dtype=torch.int64, device=input_ids.device)
    return torch.cat([head, ids_print.view(1), labels_print.view(1)])


def check_same_batch(batch: Mapping[str, torch.Tensor], *, groups: Sequence[Sequence[int]], owner: str) -> None:
    """All-gather :func:`batch_summary` over the default group; raise on every rank if the ranks of
    any group in ``groups`` (lists of global ranks: the sequence-parallel groups) disagree.

    Collective (one all-gather of 5 integers per rank): every rank must call it. The error names
    the ranks whose batch differs from the first rank of their group.
    """
    summary = batch_summary(batch)
    world = dist.get_world_size()
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary)
    rows = [g.tolist() for g in gathered]
    for group in groups:
        first = rows[group[0]]
        differ = [r for r in group if rows[r] != first]
        if not differ:
            continue
        what = "shapes" if any(rows[r][:2] != first[:2] for r in differ) else (
            "dtypes" if any(rows[r][2] != first[2] for r in differ) else "tokens")
        details = ", ".join(f"rank {r}: input_ids {tuple(rows[r][:2])}" for r in [group[0], *differ])
        raise ValueError(
            f"{owner}: ranks {differ} hold batches with different {what} than rank {group[0]} of their "
            f"sequence-parallel group {list(group)} ({details}); every rank of a sequence-parallel group must receive "
            "the same full sequences. Let Lightning add its DistributedSampler (Trainer(use_distributed_sampler=True), "
            "the default) or build your sampler from strategy.distributed_sampler_kwargs, and give every sample the "
            "same length (or use pad_to_multiple=True)"
        )
