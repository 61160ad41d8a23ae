"""Rotary embeddings of transformers models whose frequencies depend on the sequence length, made
global under sharding and per document under packing.

Note [Length-dependent rotary embeddings]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' ``dynamic_rope_update`` (the decorator of the rotary embeddings' ``forward``)
recomputes ``inv_freq`` from ``seq_len = max(position_ids) + 1`` over the whole tensor it is
given, for ``rope_type`` "dynamic" (NTK: a larger base once ``seq_len`` exceeds
``max_position_embeddings``) and "longrope" (Phi-3: the long factors once ``seq_len`` exceeds
``original_max_position_embeddings``, the short ones otherwise). Two things break that reading:

1. Sequence parallelism: each rank gives it only its shard's global positions, so ranks could
   rotate with different frequencies. A forward pre-hook on each such rotary module appends ONE
   column to ``position_ids`` holding the largest position of the whole sequence (an all-reduce
   MAX over the sequence-parallel ranks of the rank's maximum; positions are global, so this is
   the single-device maximum), and a forward hook drops that column from the outputs
   (``cos``/``sin``, or Llama 4's complex ``freqs_cis``: the position dimension is the second
   last). The update then reads the same ``seq_len`` on every rank as on one device, so the
   frequencies, the ``attention_scaling`` and the module's cached state (``max_seq_len_cached``,
   ``long_inv_freq``) are the single-device ones, and each remaining column is computed
   elementwise exactly as before. The extra column costs one position's cos/sin. The all-reduce
   runs once per forward, outside the decoder layers (so activation checkpointing never
   recomputes it), identically on every rank.

2. Packed documents (any number of ranks, one included): a document trained alone reads ITS
   length, but the packed row gives the update the longest document's (the positions restart
   per document, their maximum is the longest one's), so every shorter document would rotate
   with the longest one's frequencies (dynamic NTK: a larger base for all of them once one
   document passes ``max_position_embeddings``; LongRoPE: the long factors for all). The forward
   hook recomputes the output per group of tokens whose documents read the same frequencies:
   every token's document length L comes from the batch's ``PackedDocuments`` (known on every
   rank: no communication), sharded like the batch; the lengths that give the original
   frequencies (dynamic: L <= the original length; LongRoPE: short or long by L against
   ``original_max_position_embeddings``) form one group, every other length its own. Each group
   runs the module's own forward on its tokens' positions plus one column holding L - 1, so the
   update reads ``seq_len = L``, exactly as for that document alone; the columns are put back in
   place. The groups run in increasing L after one call at position 0, which brings dynamic NTK's
   cached state back to the original frequencies (transformers' own reset): each later group then
   grows the cache to its own L, as a fresh module given that document would. Cost: one rotary
   call per group (usually one or two; a group per distinct length above the original context).

Rotary types that read no length are left alone (no hook, no communication, no regrouping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_seqpar.attention import Attention
from lightning_seqpar.sharding.documents import PackedDocuments, current_documents
from lightning_seqpar.sharding.layouts import mesh_sizes

__all__ = ["GlobalLengthRotary", "install_global_length_rotary", "reads_sequence_length"]


def reads_sequence_length(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers rotary embedding whose frequencies depend on the sequence
    length (``rope_type`` "dynamic" / "longrope", as transformers' ``dynamic_rope_update`` tests it)."""
    rope_type = getattr(module, "rope_type", None)
    kinds = list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
    return any(_reads_length(kind) for kind in kinds)


def _reads_length(kind: Any) -> bool:
    return isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")


def _call_kind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the rope type this call computes, its layer type): per-layer-type rotary modules (a dict ``rope_type``) are
    called with ``layer_type``."""
    rope_type = module.rope_type
    if not isinstance(rope_type, dict):
        return rope_type, None
    layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
    return rope_type.get(layer_type), layer_type


def _original_length(module: nn.Module, kind: str, layer_type: str | None) -> int | None:
    """The length up to which ``module`` rotates with its original frequencies (None: unknown)."""
    if "dynamic" in kind:
        value = getattr(module, "original_max_seq_len", None)
    else:  # longrope: transformers compares seq_len with config.rope_parameters["original_max_position_embeddings"]
        params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
        if layer_type is not None and isinstance(params, dict):
            params = params.get(layer_type) or {}
        value = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _frequency_key(lengths: Tensor, module: nn.Module, kind: str, layer_type: str | None) -> Tensor:
    """One key per document length such that equal keys read the same frequencies (Note [Length-dependent rotary
    embeddings], 2.): the original-frequency lengths share a key, every other length is its own."""
    original = _original_length(module, kind, layer_type)
    if original is None:
        return lengths
    if "dynamic" in kind:
        return torch.where(lengths > original, lengths, torch.zeros_like(lengths))
    return (lengths > original).long() * original + 1  # longrope: short (1) or long (original + 1)


class GlobalLengthRotary:
    """The pre-hook / hook pair of Note [Length-dependent rotary embeddings] for one rotary module.

    ``attention``: the model's ``Attention`` modules; the sequence-parallel mesh is read from them at
    every call (None: one rank). Held by the hooks, so ``copy.deepcopy`` of the model maps it onto
    the copy's modules.
    """

    def __init__(self, attention: Sequence[Attention]) -> None:
        self.attention = tuple(attention)
        self.active = False
        self._regrouping = False

    def _mesh(self) -> Any:
        return next((m.mesh for m in self.attention if m.mesh is not None and m.mesh.size() > 1), None)

    @staticmethod
    def _position_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if not isinstance(position_ids, Tensor):
            raise ValueError(
                f"{type(module).__name__}: a length-dependent rotary embedding (rope_type={module.rope_type!r}) under "
                "sequence parallelism or with packed documents needs position_ids (the positions of the tokens)"
            )
        return position_ids

    @staticmethod
    def _with_positions(args: tuple[Any, ...], kwargs: dict[str, Any], position_ids: Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(args) > 1:
            return (args[0], position_ids, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": position_ids}

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._regrouping:  # the hook's own per-group calls (Note [Length-dependent rotary embeddings], 2.)
            return None
        mesh = self._mesh()
        self.active = mesh is not None and current_documents() is None
        if not self.active:
            return None
        position_ids = self._position_ids(module, args, kwargs)
        top = position_ids.max().reshape(1).to(torch.int64)  # (1,)
        for group in mesh.get_all_groups():
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        extra = top.to(position_ids.dtype).expand(*position_ids.shape[:-1], 1)  # (..., 1)
        return self._with_positions(args, kwargs, torch.cat([position_ids, extra], dim=-1))  # (..., S_local + 1)

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self._regrouping:
            return None
        documents = current_documents()
        if documents is not None:
            return self._per_document(module, args, kwargs, output, documents)
        if not self.active:
            return None
        self.active = False

        def drop(t: Any) -> Any:
            if not isinstance(t, Tensor) or t.ndim < 2:
                raise ValueError(f"{type(module).__name__} returned {type(t).__name__}; expected (..., S, D) tensors")
            return t[..., :-1, :]  # (..., S_local, D): the extra position's column removed

        return tuple(drop(t) for t in output) if isinstance(output, tuple) else drop(output)

    def _local_lengths(self, documents: PackedDocuments, position_ids: Tensor) -> Tensor:
        """``[B, S_local]``: the length of every local token's document, sharded as the strategy shards the batch."""
        full = documents.token_lengths()  # [B, S]
        mesh = self._mesh()
        if mesh is not None:  # the documents were split over the cp ranks, each cp shard contiguously over hp
            hp, hp_rank, _, cp_rank = mesh_sizes(mesh)
            full = documents.shard(full, cp_rank, hp=hp, hp_rank=hp_rank)
        if full.shape[1] != position_ids.shape[-1] or position_ids.shape[0] not in (1, full.shape[0]):
            raise ValueError(
                f"rotary embedding: position_ids of shape {tuple(position_ids.shape)} do not match the batch's packed "
                f"documents ({full.shape[0]} samples of {full.shape[1]} tokens on this rank)"
            )
        return full

    def _per_document(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                      documents: PackedDocuments) -> Any:
        """The output recomputed per group of documents that read the same frequencies (Note [Length-dependent
        rotary embeddings], 2.)."""
        kind, layer_type = _call_kind(module, args, kwargs)
        if not _reads_length(kind):
            return None  # this layer type's frequencies read no length: the output is the document's already
        position_ids = self._position_ids(module, args, kwargs)
        lengths = self._local_lengths(documents, position_ids)  # [B, S_local] (CPU)
        B, S = lengths.shape
        position_ids = position_ids.expand(B, S)
        flat_pos = position_ids.reshape(-1)
        keys = _frequency_key(lengths.reshape(-1), module, kind, layer_type)
        outputs = list(output) if isinstance(output, tuple) else [output]
        if any(not isinstance(t, Tensor) or t.ndim < 2 or t.shape[-2] != S for t in outputs):
            raise ValueError(f"{type(module).__name__} returned outputs of shapes {[tuple(getattr(t, 'shape', ())) for t in outputs]}; "
                             f"expected (..., {S}, D) tensors")
        full = [t.expand(B, *t.shape[-2:]).reshape(B * S, t.shape[-1]).clone() for t in outputs]  # (B * S, D)
        self._regrouping = True
        try:
            call_args, call_kwargs = self._with_positions(args, kwargs, position_ids.new_zeros(1, 1))
            module(*call_args, **call_kwargs)  # seq_len 1: dynamic NTK's cache back to the original frequencies
            for key in torch.unique(keys).tolist():  # increasing: each dynamic group grows the cache to its length
                where = (keys == key).nonzero().squeeze(1)  # (n,) flat token indices
                length = int(lengths.reshape(-1)[where].max())
                pos = torch.cat([flat_pos[where.to(flat_pos.device)], flat_pos.new_full((1,), length - 1)])[None]  # (1, n + 1)
                call_args, call_kwargs = self._with_positions(args, kwargs, pos)
                got = module(*call_args, **call_kwargs)
                got = list(got) if isinstance(got, tuple) else [got]
                for dst, src in zip(full, got):
                    dst.index_copy_(0, where.to(dst.device), src.reshape(-1, src.shape[-2], src.shape[-1])[0, :-1].to(dst.dtype))
        finally:
            self._regrouping = False
        shaped = [f.view(B, S, f.shape[-1]) for f in full]
        return tuple(shaped) if isinstance(output, tuple) else shaped[0]


def install_global_length_rotary(model: nn.Module, attention: Sequence[Attention]) -> int:
    """Hook every length-dependent rotary embedding of ``model`` (Note [Length-dependent rotary
    embeddings]); returns how many are hooked. Idempotent: a module hooked before keeps its hooks,
    with ``attention`` as the modules to read the mesh from."""
    count = 0
    for module in model.modules():
        if not reads_sequence_length(module):
            continue
        count += 1
        existing = [h for h in module._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), GlobalLengthRotary)]
        if existing:
            existing[0].__self__.attention = tuple(attention)
            continue
        state = GlobalLengthRotary(attention)
        module.register_forward_pre_hook(state.pre_hook, with_kwargs=True)
        module.register_forward_hook(state.hook, with_kwargs=True)
    return count
