"""Batches under sequence parallelism: checked, padded, sharded along the sequence, and gathered back.

The strategy's batch hook (``SequenceParallelStrategy.batch_to_device``) calls :func:`shard_batch`,
the one place where a batch is split over the sequence-parallel ranks; ``gather_sequence`` (used by
``CausalLMModule.predict_step``) is its inverse. How a tensor is split is ``lightning_seqpar.sharding.layouts``'s
(Note [Sequence layouts]); packed documents are split per document (Note [Packed documents and
per-document zigzag] in ``lightning_seqpar.sharding.documents``).

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
  (batch size, length, dtype code and fingerprints of its ids, labels, positions, document ids,
  attention mask and any other tensor of the sequence's length) over all ranks,
  and every rank then finds the same disagreement and raises the same error, naming the ranks.
  Nobody waits in a collective that the others skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX
from lightning_seqpar.sharding.documents import PackedDocuments, batch_documents, current_documents, documents_error, set_current_documents
from lightning_seqpar.sharding.layouts import gather_along, mesh_sizes, required_multiple, shard_sequence, unshard_sequence

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["batch_summary", "check_batch", "check_same_batch", "gather_sequence", "pad_batch", "shard_batch"]


# --------------------------------------------------------------------------------------------- checks

_INTEGER_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids")
_DTYPE_CODES: dict[torch.dtype, int] = {
    dtype: code
    for code, dtype in enumerate(
        (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool)
    )
}


def check_batch(batch: Any, *, owner: str) -> None:
    """Raise a ValueError naming the key and the fix for a batch the strategy cannot shard correctly.

    Local: no communication. Checks that ``batch`` is a mapping with a (batch, seq_len) integer
    ``input_ids``; that ``labels``, ``position_ids`` and ``document_ids`` (when present) are integer tensors of the
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
    documents = batch.get("document_ids")
    if documents is not None and tuple(documents.shape) != (batch_size, seq_len):
        raise ValueError(
            f"{owner}: batch['document_ids'] has shape {tuple(documents.shape)}; expected ({batch_size}, {seq_len}) (the shape "
            "of input_ids): the document of every input token"
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


_SHARED_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids", "attention_mask")
"""The per-token tensors :func:`batch_summary` fingerprints by name (every other one of the batch's sequence length is
fingerprinted too, together, in one more column)."""
_SUMMARY_COLUMNS: tuple[str, ...] = ("batch size", "sequence length", "input_ids dtype", *_SHARED_KEYS,
                                     "other per-token tensors")
_ABSENT = -(2**62)  # the fingerprint of a key the batch does not hold


def _fingerprint(value: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """int64 (): a position-weighted sum of the tensor's values (bit patterns for floats; wrapping int64 arithmetic),
    so that another value, a permutation or another dtype changes it."""
    flat = value.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.float().view(torch.int32)  # the bits: exact, NaN included
    elif flat.is_complex():
        flat = torch.view_as_real(flat).float().reshape(-1).view(torch.int32)
    flat = flat.to(torch.int64)
    weights = (torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 2654435761 + salt) % (2**31 - 1)
    code = _DTYPE_CODES.get(value.dtype, -1)
    return (flat * weights).sum() + code * 1000003 + hash(tuple(value.shape)) % (2**31)


def batch_summary(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """int64 (9,): batch size, sequence length, dtype code of the ids, and fingerprints of every per-token tensor the
    sequence-parallel ranks share: ``input_ids``, ``labels``, ``position_ids``, ``document_ids``, ``attention_mask``
    (:data:`_ABSENT` where the batch has none), and all other tensors of the batch's sequence length together (a loss
    mask, ``document_position_ids``, ...: their names are part of the fingerprint).

    The fingerprints are position-weighted sums (wrapping int64 arithmetic) of the values (of their bits for floating
    tensors), so a different sample, a permutation of the same tokens or another dtype or shape changes them.
    """
    input_ids = batch["input_ids"]
    batch_size, seq_len = input_ids.shape
    device = input_ids.device
    head = torch.tensor([batch_size, seq_len, _DTYPE_CODES.get(input_ids.dtype, -1)], dtype=torch.int64, device=device)
    absent = torch.full((), _ABSENT, dtype=torch.int64, device=device)
    named = [_fingerprint(batch[k]) if isinstance(batch.get(k), torch.Tensor) else absent for k in _SHARED_KEYS]
    others = absent.clone()
    for index, key in enumerate(sorted(k for k in batch if k not in _SHARED_KEYS and isinstance(k, str))):
        value = batch[key]
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
            others = others + _fingerprint(value.to(device), salt=index) + sum(map(ord, key)) * (index + 1)
    return torch.stack([*head, *(n.to(device) for n in named), others])


def check_same_batch(batch: Mapping[str, torch.Tensor], *, groups: Sequence[Sequence[int]], owner: str) -> None:
    """All-gather :func:`batch_summary` over the default group; raise on every rank if the ranks of
    any group in ``groups`` (lists of global ranks: the sequence-parallel groups) disagree.

    Collective (one all-gather of 9 integers per rank): every rank must call it. The error names
    the ranks whose batch differs from the first rank of their group, and what differs (the shapes,
    the dtypes, the tokens -- ids or labels --, or the key of another per-token tensor: ``document_ids``, ...).
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
        column = min(c for r in differ for c in range(len(first)) if rows[r][c] != first[c])
        name = _SUMMARY_COLUMNS[column]
        what = "shapes" if column < 2 else "dtypes" if column == 2 else "tokens" if name in ("input_ids", "labels") else name
        details = ", ".join(f"rank {r}: input_ids {tuple(rows[r][:2])}" for r in [group[0], *differ])
        if what not in ("shapes", "dtypes", "tokens"):
            missing = any((rows[r][column] == _ABSENT) != (first[column] == _ABSENT) for r in differ)
            details += f"; {name} {'present on some ranks only' if missing else 'differ'}"
        raise ValueError(
            f"{owner}: ranks {differ} hold batches with different {what} than rank {group[0]} of their "
            f"sequence-parallel group {list(group)} ({details}); every rank of a sequence-parallel group must receive "
            "the same full sequences (and the same per-token tensors: labels, positions, document ids, masks). Let "
            "Lightning add its DistributedSampler (Trainer(use_distributed_sampler=True), the default) or build your "
            "sampler from strategy.distributed_sampler_kwargs, and give every sample the same length (or use "
            "pad_to_multiple=True)"
        )


# --------------------------------------------------------------------------------------------- padding


def pad_batch(batch: dict[str, torch.Tensor], *, multiple: int, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Right-pad the per-token tensors of ``batch`` to a sequence length that is a multiple of ``multiple``.

    Per-token tensors are those with ``shape[1] == batch["input_ids"].shape[1]``. ``labels`` are
    padded with ``ignore_index`` (the padding never counts in the loss), ``position_ids`` continue
    the positions (``S, S+1, ...``), ``document_ids`` with a new id (the padding is a document of
    its own), everything else (ids, masks) with 0. Under a
    causal mask a token never attends to later ones, so the padding changes neither the logits of
    the real tokens nor the loss. Local: no communication. Returns a new dict (``batch`` itself
    when nothing needs padding).
    """
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"multiple must be a positive int, got {multiple!r}")
    seq_len = batch["input_ids"].shape[1]
    pad = -seq_len % multiple
    if pad == 0:
        return batch
    out = dict(batch)
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len):
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, pad + 1, device=value.device, dtype=value.dtype)  # (B, pad)
            out[key] = torch.cat([value, tail], dim=1)
            continue
        shape = (value.shape[0], pad, *value.shape[2:])
        if key == "document_ids":  # the padding is a document of its own
            out[key] = torch.cat([value, (value.amax(dim=1, keepdim=True) + 1).expand(shape)], dim=1)
            continue
        fill = ignore_index if key == "labels" else 0
        out[key] = torch.cat([value, value.new_full(shape, fill)], dim=1)
    return out


# --------------------------------------------------------------------------------------------- sharding a batch


def shard_batch(batch: Any, *, sp: int, sp_mesh: DeviceMesh | None, device_mesh: DeviceMesh | None, layout: str, attention: str,
                pad_to_multiple: bool, validate_batches: bool, owner: str, checked: bool = False) -> Any:
    """This rank's piece of a dict batch of full sequences (``SequenceParallelStrategy.shard_batch``).

    First the local checks (:func:`check_batch`, the sequence length against the layout, padding
    with ``pad_to_multiple``): no communication, so a wrong batch raises before any collective.
    Then, with ``validate_batches`` and sequence parallelism, one all-gather compares the batch
    across the ranks of each sequence-parallel group (:func:`check_same_batch`). Then every tensor
    with ``shape[1] == input_ids.shape[1]`` (input ids, labels, position ids, loss masks, document
    ids, ...) is split along dim 1 with ``layout`` over ``sp_mesh``. Missing ``position_ids`` are
    created first as the global positions ``0..S-1``.

    Packed documents (``document_ids``, or ``position_ids`` that restart at 0): the batch is
    split with the per-document zigzag instead, ``position_ids`` become the positions inside
    each document, and the documents are made current for every ``Attention`` module, so
    attention never crosses a document boundary (Note [Packed documents and per-document zigzag]).
    ``sp``: the sequence-parallel size; ``device_mesh``: the strategy's whole mesh (its rows of
    ``sp`` ranks are the groups that must hold the same batch); ``attention``: the resolved algorithm;
    ``checked``: the caller already ran :func:`check_batch`.
    """
    name = owner
    if not checked:
        check_batch(batch, owner=name)
    if sp > 1:
        assert sp_mesh is not None and device_mesh is not None
        multiple = required_multiple(sp_mesh, layout)
        if batch["input_ids"].shape[1] % multiple:
            if not pad_to_multiple:
                seq_len = batch["input_ids"].shape[1]
                raise ValueError(
                    f"{name}: sequence length {seq_len} of batch['input_ids'] must be a multiple of {multiple} "
                    f"(sequence_parallel_size={sp}, load_balance={layout!r}); set "
                    f"pad_to_multiple=True (pads with ignored labels, the loss does not change) or choose seq_len as a "
                    f"multiple of {multiple}"
                )
            batch = pad_batch(dict(batch), multiple=multiple)
    hp, hp_rank, cp, cp_rank = mesh_sizes(sp_mesh) if sp > 1 else (1, 0, 1, 0)  # type: ignore[arg-type]
    documents = _current_batch_documents(batch, cp, sp=sp, layout=layout, attention=attention, owner=name)
    out = dict(batch)
    if documents is not None:  # Note [Packed documents and per-document zigzag]: positions restart per document
        out["position_ids"] = documents.position_ids(batch["input_ids"].device)
    if sp == 1:
        return type(batch)(out) if not isinstance(batch, dict) else out
    if validate_batches:
        groups = device_mesh.mesh.reshape(-1, sp).tolist()  # type: ignore[union-attr]
        check_same_batch(batch, groups=groups, owner=name)
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[1]
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand(input_ids.shape[0], seq_len)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
            if documents is not None:
                out[key] = documents.shard(value.expand(input_ids.shape[0], *value.shape[1:]), cp_rank, hp=hp, hp_rank=hp_rank)
            else:
                out[key] = shard_sequence(value, sp_mesh, dim=1, layout=layout)  # type: ignore[arg-type]
    return type(batch)(out) if not isinstance(batch, dict) else out


def gather_sequence(x: torch.Tensor, *, sp_mesh: DeviceMesh | None, layout: str) -> torch.Tensor:
    """The full sequences, on every rank, from this rank's piece of a per-token tensor of the current
    batch (``(B, S_local, ...)``, e.g. predictions from the sharded ``input_ids``): the inverse of
    :func:`shard_batch` along dim 1, with its layout or per-document split (an all-gather over the
    sequence-parallel ranks). Without sequence parallelism (``sp_mesh`` None) ``x`` itself. Padding
    that ``pad_to_multiple`` added stays at the end."""
    if sp_mesh is None:
        return x
    documents = current_documents()
    if documents is None:
        return unshard_sequence(x, sp_mesh, dim=1, layout=layout)  # type: ignore[arg-type]
    hp, _, cp, _ = mesh_sizes(sp_mesh)
    if hp > 1:  # Note [Sequence layouts]: the hp split of a cp shard is contiguous
        x = gather_along(x, sp_mesh.get_group("hp"), dim=1)
    if cp > 1:
        group = sp_mesh.get_group("cp") if sp_mesh.ndim == 2 else sp_mesh.get_group()
        x = documents.unshard(gather_along(x, group, dim=1).chunk(cp, dim=1), dim=1)
    return x


def _current_batch_documents(batch: dict, cp: int, *, sp: int, layout: str, attention: str, owner: str) -> PackedDocuments | None:
    """The batch's packed documents (``document_ids``, or ``position_ids`` restarting at 0), made current for attention."""
    documents = batch_documents(batch, world=cp)
    if documents is not None and attention == "lasp":
        raise documents_error(owner, "which attention='lasp' (linear attention) does not mask; drop document_ids "
                              "and use plain position_ids")
    if documents is not None and sp > 1 and layout != "zigzag":
        raise ValueError(
            f"{owner}: packed documents are split with the per-document zigzag; load_balance={layout!r} "
            "must be 'zigzag' or 'auto'"
        )
    set_current_documents(documents)
    return documents
