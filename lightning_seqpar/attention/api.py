"""The public attention API: validation, dispatch, the custom ops and the ``Attention`` module.

Note [Custom ops]
~~~~~~~~~~~~~~~~~
The local, ring and all-gather algorithms run inside one pair of torch custom ops,
``seqpar::attn_fwd`` -> (out, lse) and ``seqpar::attn_bwd`` -> (dq, dk, dv), with fake (meta)
implementations and an autograd formula. So:

* torch.compile sees one opaque node per attention call (no graph break, no tracing of P2P);
* autograd saves (q, k, v, out, lse) and the backward never runs the forward again;
* Selective Checkpoint++ saves the op's outputs by name (``ATTENTION_OPS``), so recomputing a
  block in backward neither recomputes attention nor repeats its communication.

Process groups cross the op boundary by name (``ProcessGroup.group_name``) and are looked up with
torch's own registry. Ulysses and the head dimension of 2D use torch's functional all-to-all
(with autograd) around these ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.sharding.agreement import RankAgreement, check_ranks_agree
from lightning_seqpar.attention.algorithms import ALGORITHMS, Algorithm, OpKind
from lightning_seqpar.attention.checks import check_qkv_tensors
from lightning_seqpar.attention.comm import kv_repeat, process_group
from lightning_seqpar.attention.lasp import LASP_OPS
from lightning_seqpar.attention.allgather import (
    global_order,
    allgather_backward,
    allgather_forward,
    doc_gathered_backward,
    doc_gathered_forward,
    gathered_backward,
    gathered_forward,
    to_rank_order,
)
from lightning_seqpar.attention.varlen import DocSegments, reorder, sample_order
from lightning_seqpar.attention.local import (FA4_MIN_TOKENS, acc_dtype, block_backward, block_forward, default_scale, log_auto_backend,
                                              resolve_backend)
from lightning_seqpar.attention.masked import variant_block_backward, variant_block_forward
from lightning_seqpar.attention.merge import new_accumulators
from lightning_seqpar.attention.ring import ring_backward, ring_forward
from lightning_seqpar.attention.two_d import split_kv_heads, two_d_attention
from lightning_seqpar.attention.ulysses import overlapped_backward, overlapped_forward, ulysses_stages
from lightning_seqpar.attention.variants import Variant, check_variant_args, fold_sinks, local_mask, sinks_grad
from lightning_seqpar.sharding.documents import PackedDocuments, current_documents
from lightning_seqpar.sharding.layouts import LAYOUTS



def _local_docs_forward(q, k, v, causal, scale, backend, docs):
    """Packed documents over the whole sequence (in rank order for Ulysses): one varlen call."""
    order = sample_order(docs, q.device)
    if order is not None:
        q, k, v = (reorder(x, order[0], 1) for x in (q, k, v))
    out, lse = block_forward(q, k, v, causal=causal, scale=scale, backend=backend, varlen=DocSegments(docs, q.device).whole())
    if order is not None:
        out, lse = reorder(out, order[1], 1), reorder(lse, order[1], 2)
    return out, lse


def _local_docs_backward(dout, q, k, v, out, lse, causal, scale, backend, docs):
    order = sample_order(docs, q.device)
    if order is not None:
        dout, q, k, v, out = (reorder(x, order[0], 1) for x in (dout, q, k, v, out))
        lse = reorder(lse, order[0], 2)
    grads = block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend, varlen=DocSegments(docs, q.device).whole())
    if order is not None:
        grads = tuple(reorder(g, order[1], 1) for g in grads)
    return grads


def _local_variant_forward(q, k, v, scale, backend, docs, variant: Variant):
    """The whole sequence (in rank order for Ulysses with documents) under a window / chunk / softcap: one masked block."""
    order = sample_order(docs, q.device) if docs is not None else None
    if order is not None:
        q, k, v = (reorder(x, order[0], 1) for x in (q, k, v))
    mask, kind = local_mask(q, docs, variant)
    if mask is None:
        out, lse = new_accumulators(q, v.shape[-1])
        out = out.to(q.dtype)
    else:
        out, lse = variant_block_forward(q, k, v, mask, scale=scale, backend=backend)
    if order is not None:
        out, lse = reorder(out, order[1], 1), reorder(lse, order[1], 2)
    return out, lse


def _local_variant_backward(dout, q, k, v, out, lse, scale, backend, docs, variant: Variant):
    order = sample_order(docs, q.device) if docs is not None else None
    if order is not None:
        dout, q, k, v, out = (reorder(x, order[0], 1) for x in (dout, q, k, v, out))
        lse = reorder(lse, order[0], 2)
    mask, _ = local_mask(q, docs, variant)
    if mask is None:
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    else:
        grads = variant_block_backward(dout, q, k, v, out, lse, mask, scale=scale, backend=backend)
    if order is not None:
        grads = tuple(reorder(g, order[1], 1) for g in grads)
    return grads


def _variant(causal: bool, window: int, chunk: int, softcap: float) -> Variant | None:
    """The Variant of an op call, or None for plain attention (the original paths)."""
    return Variant(causal, window, chunk, softcap) if (window or chunk or softcap) else None


def _forward(q, k, v, algorithm, group, causal, layout, scale, backend, inner, docs, head_chunks, var: Variant | None):
    if head_chunks > 1:
        return _fwd_by_heads(q, k, v, head_chunks, lambda qc, kc, vc: _forward(qc, kc, vc, algorithm, group, causal, layout, scale,
                                                                               backend, inner, docs, 1, var))
    if algorithm == "local":
        if var is not None:
            return _local_variant_forward(q, k, v, scale, backend, docs, var)
        if docs is not None:
            return _local_docs_forward(q, k, v, causal, scale, backend, docs)
        return block_forward(q, k, v, causal=causal, scale=scale, backend=backend)
    pg = process_group(group)
    if algorithm == "gathered":
        if var is not None:
            raise ValueError("gathered_kv_attention takes no window, chunk_size or softcap")
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        if docs is not None:
            return doc_gathered_forward(q, torch.stack([k, v]), rank=rank, world=world, causal=causal, scale=scale, backend=backend, docs=docs)
        kv = torch.stack([k, v]).index_select(2, global_order(world, layout, q.shape[1], q.device))
        return gathered_forward(q, kv, rank=rank, world=world, causal=causal, layout=layout, scale=scale, backend=backend)
    if algorithm == "ring":
        return ring_forward(q, k, v, group=pg, causal=causal, layout=layout, scale=scale, backend=backend, inner=inner or None, docs=docs,
                            variant=var)
    return allgather_forward(q, k, v, group=pg, causal=causal, layout=layout, scale=scale, backend=backend, docs=docs, variant=var)


@torch.library.custom_op("seqpar::attn_fwd", mutates_args=())
def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, algorithm: str, group: str, causal: bool, layout: str,
              scale: float, backend: str, inner: int, docs: Tensor | None = None, head_chunks: int = 1,
              window: int = 0, chunk: int = 0, softcap: float = 0.0, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out, lse = _forward(q, k, v, algorithm, group, causal, layout, scale, backend, inner, docs, head_chunks,
                        _variant(causal, window, chunk, softcap))
    if sinks is not None:  # Note [Attention variants]: one more key of score s_h and value 0, after the last merge
        out, lse = fold_sinks(out, lse, sinks)
    return out.contiguous(), lse.contiguous()


@_attn_fwd.register_fake
def _(q, k, v, algorithm, group, causal, layout, scale, backend, inner, docs=None, head_chunks=1, window=0, chunk=0, softcap=0.0,
      sinks=None):
    B, S, H, _ = q.shape
    return q.new_empty((B, S, H, v.shape[-1])), q.new_empty((B, H, S), dtype=acc_dtype(q.dtype, q.device))


def _backward_impl(dout, q, k, v, out, lse, algorithm, group, causal, layout, scale, backend, inner, docs, head_chunks, var):
    if head_chunks > 1:
        return _bwd_by_heads(dout, q, k, v, out, lse, head_chunks,
                             lambda *t: _backward_impl(*t, algorithm, group, causal, layout, scale, backend, inner, docs, 1, var))
    if algorithm == "local":
        if var is not None:
            return _local_variant_backward(dout, q, k, v, out, lse, scale, backend, docs, var)
        if docs is not None:
            return _local_docs_backward(dout, q, k, v, out, lse, causal, scale, backend, docs)
        return block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend)
    if algorithm == "gathered":
        pg = process_group(group)
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        if docs is not None:
            dq, dkv = doc_gathered_backward(dout, q, torch.stack([k, v]), out, lse, rank=rank, world=world, causal=causal, scale=scale,
                                            backend=backend, docs=docs)
        else:
            kv = torch.stack([k, v]).index_select(2, global_order(world, layout, q.shape[1], q.device))
            dq, dkv = gathered_backward(dout, q, kv, out, lse, rank=rank, world=world, causal=causal, layout=layout, scale=scale, backend=backend)
            dkv = to_rank_order(dkv, world, layout, q.shape[1], dim=2)
        return dq, dkv[0], dkv[1]
    if algorithm == "ring":
        return ring_backward(dout, q, k, v, out, lse, group=process_group(group), causal=causal, layout=layout, scale=scale,
                             backend=backend, inner=inner or None, docs=docs, variant=var)
    return allgather_backward(dout, q, k, v, out, lse, group=process_group(group), causal=causal, layout=layout,
                              scale=scale, backend=backend, docs=docs, variant=var)


@torch.library.custom_op("seqpar::attn_bwd", mutates_args=())
def _attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, algorithm: str, group: str,
              causal: bool, layout: str, scale: float, backend: str, inner: int, docs: Tensor | None = None,
              head_chunks: int = 1, window: int = 0, chunk: int = 0, softcap: float = 0.0,
              sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``sinks`` only keeps the schema that of the forward: its gradient is taken in the autograd formula."""
    dout = dout.contiguous()
    dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, algorithm, group, causal, layout, scale, backend, inner, docs, head_chunks,
                                _variant(causal, window, chunk, softcap))
    return _fresh((dq, dk, dv), (q, k, v), (dout, q, k, v, out, lse))


def _fresh(grads: tuple[Tensor, ...], like: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``grads`` as fresh contiguous tensors in the dtypes of ``like``: custom ops may not return aliases
    of their inputs or of each other. A gradient that already is one is returned as is (no copy:
    at long context each copy is a transient of the size of q)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    out = []
    for g, x in zip(grads, like):
        ptr = g.untyped_storage().data_ptr()
        if g.dtype != x.dtype or not g.is_contiguous() or g._base is not None or ptr in seen:
            g = g.to(x.dtype, memory_format=torch.contiguous_format, copy=True)
        seen.add(g.untyped_storage().data_ptr())
        out.append(g)
    return tuple(out)


# Note [Head chunks]
# ~~~~~~~~~~~~~~~~~~
# Attention heads are independent, so the op may run over groups of K/V heads one after another
# (with their query heads: q head i belongs to K/V head i // (H_q / H_kv)). Outputs and gradients
# are written into full-size tensors; everything the algorithm allocates on the way (the fp32
# output and dq accumulators, the travelling K/V and dK/dV buffers of the ring, the gathered K/V
# of all-gather, the kernels' workspaces) is 1/head_chunks as large. Results are identical; the
# price is head_chunks times as many (smaller) messages and kernel launches.


def _head_slices(h_q: int, h_kv: int, chunks: int):
    for c in range(chunks):
        yield slice(c * h_q // chunks, (c + 1) * h_q // chunks), slice(c * h_kv // chunks, (c + 1) * h_kv // chunks)


def _fwd_by_heads(q: Tensor, k: Tensor, v: Tensor, chunks: int, fn) -> tuple[Tensor, Tensor]:
    B, S, Hq, _ = q.shape
    out = q.new_empty((B, S, Hq, v.shape[-1]))
    lse = torch.empty((B, Hq, S), dtype=acc_dtype(q.dtype, q.device), device=q.device)
    for hq, hk in _head_slices(Hq, k.shape[2], chunks):
        o, l = fn(q[:, :, hq].contiguous(), k[:, :, hk].contiguous(), v[:, :, hk].contiguous())
        out[:, :, hq] = o
        lse[:, hq] = l
        del o, l
    return out, lse


def _bwd_by_heads(dout, q, k, v, out, lse, chunks: int, fn) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the fake impl says
    for hq, hk in _head_slices(q.shape[2], k.shape[2], chunks):
        a, b, c = fn(dout[:, :, hq].contiguous(), q[:, :, hq].contiguous(), k[:, :, hk].contiguous(), v[:, :, hk].contiguous(),
                     out[:, :, hq].contiguous(), lse[:, hq].contiguous())
        dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = a, b, c
        del a, b, c
    return dq, dk, dv


@_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, algorithm, group, causal, layout, scale, backend, inner, docs=None, head_chunks=1, window=0, chunk=0,
      softcap=0.0, sinks=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.seqpar.attn_bwd(dout, q, k, v, out, lse, *ctx.args)
    grads = [None] * len(ctx.args)
    sinks = ctx.args[_SINKS] if len(ctx.args) > _SINKS else None
    if sinks is not None and ctx.needs_input_grad[3 + _SINKS]:
        grads[_SINKS] = sinks_grad(dout, out, lse, sinks)  # Note [Attention variants]
    return (dq, dk, dv, *grads)


_SINKS = 12  # position of ``sinks`` among the op's arguments after (q, k, v): see attention_op


@dataclass(frozen=True)
class AttentionSpec:
    """What one call of the attention op runs, besides its tensors (q, k, v, the documents' piece lengths, the sinks).

    Built once per call of an entry point (``local_attention``, ``sequence_parallel_attention``,
    ``gathered_kv_attention``) from its checked arguments, and hashable. ``kind``: what the op call
    runs (``lightning_seqpar.attention.algorithms.OpKind``); ``group``: the process group's name ("" for
    "local"); ``inner_ring_size``: 0 for one ring; ``window`` / ``chunk_size`` / ``softcap``: 0 for none
    (Note [Attention variants]).
    """

    kind: OpKind
    causal: bool
    layout: str
    scale: float
    backend: str
    group: str = ""
    inner_ring_size: int = 0
    head_chunks: int = 1
    window: int = 0
    chunk_size: int = 0
    softcap: float = 0.0


def attention_op(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *, docs: Tensor | None = None,
                 sinks: Tensor | None = None) -> Tensor:
    """``seqpar::attn_fwd`` for ``spec``: the one place that turns a spec into the op's arguments. A torch.library
    custom op takes only tensors, numbers and strings, so its schema stays positional (Note [Custom ops]):
    (q, k, v, kind, group, causal, layout, scale, backend, inner_ring_size, docs, head_chunks, window,
    chunk_size, softcap, sinks); ``_SINKS`` is the position of ``sinks`` after (q, k, v)."""
    return torch.ops.seqpar.attn_fwd(q, k, v, spec.kind, spec.group, spec.causal, spec.layout, spec.scale, spec.backend,
                                     spec.inner_ring_size, docs, spec.head_chunks, spec.window, spec.chunk_size, spec.softcap,
                                     sinks)[0]


torch.library.register_autograd("seqpar::attn_fwd", _backward, setup_context=_setup_context)


# Ulysses with its all-to-alls inside the op, overlapped with the attention (Note [Overlapped Ulysses]).
# ``zigzag``: the gathered sequence is put in global order (the zigzag split, with a mask over
# positions and no documents, which order themselves); the stage's attention is the "local" kind.

def _ulysses_local(causal, layout, scale, backend, docs, var):
    fwd = lambda q, k, v: _forward(q, k, v, "local", "", causal, layout, scale, backend, 0, docs, 1, var)  # noqa: E731
    bwd = lambda *t: _backward_impl(*t, "local", "", causal, layout, scale, backend, 0, docs, 1, var)  # noqa: E731
    return fwd, bwd


def _ulysses_zigzag(causal: bool, layout: str, docs, var) -> bool:
    return layout == "zigzag" and docs is None and (causal or var is not None)


@torch.library.custom_op("seqpar::ulysses_fwd", mutates_args=())
def _ulysses_fwd(q: Tensor, k: Tensor, v: Tensor, group: str, world: int, stages: int, causal: bool, layout: str, scale: float, backend: str,
                 docs: Tensor | None = None, window: int = 0, chunk: int = 0,
                 softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    var = _variant(causal, window, chunk, softcap)
    fwd, _ = _ulysses_local(causal, layout, scale, backend, docs, var)
    return overlapped_forward(q.contiguous(), k.contiguous(), v.contiguous(), group=process_group(group), stages=stages,
                              zigzag=_ulysses_zigzag(causal, layout, docs, var), local_forward=fwd)


@_ulysses_fwd.register_fake
def _(q, k, v, group, world, stages, causal, layout, scale, backend, docs=None, window=0, chunk=0, softcap=0.0):
    B, S, Hq, D = q.shape
    P = world
    hq, hk = Hq // (P * stages), k.shape[2] // (P * stages)
    head = lambda h, d: q.new_empty((stages, B, P * S, h, d))  # noqa: E731
    return (q.new_empty((B, S, Hq, v.shape[-1])), head(hq, D), head(hk, D), head(hk, D), head(hq, v.shape[-1]),
            q.new_empty((stages, B, hq, P * S), dtype=acc_dtype(q.dtype, q.device)))


@torch.library.custom_op("seqpar::ulysses_bwd", mutates_args=())
def _ulysses_bwd(dout: Tensor, qh: Tensor, kh: Tensor, vh: Tensor, oh: Tensor, lse: Tensor, group: str, world: int, stages: int, causal: bool,
                 layout: str, scale: float, backend: str, docs: Tensor | None = None, window: int = 0, chunk: int = 0,
                 softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    var = _variant(causal, window, chunk, softcap)
    _, bwd = _ulysses_local(causal, layout, scale, backend, docs, var)
    return overlapped_backward(dout.contiguous(), qh, kh, vh, oh, lse, group=process_group(group),
                               zigzag=_ulysses_zigzag(causal, layout, docs, var), local_backward=bwd)


@_ulysses_bwd.register_fake
def _(dout, qh, kh, vh, oh, lse, group, world, stages, causal, layout, scale, backend, docs=None, window=0, chunk=0, softcap=0.0):
    B, S, Hq, _ = dout.shape
    n, _, _, hk, D = kh.shape
    P = world
    return dout.new_empty((B, S, Hq, qh.shape[-1])), kh.new_empty((B, S, hk * P * n, D)), vh.new_empty((B, S, hk * P * n, D))


def _ulysses_setup_context(ctx, inputs, output):
    _, qh, kh, vh, oh, lse = output
    ctx.save_for_backward(qh, kh, vh, oh, lse)
    ctx.args = inputs[3:]
    ctx.mark_non_differentiable(qh, kh, vh, oh, lse)


def _ulysses_backward(ctx, dout, *_):
    qh, kh, vh, oh, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.seqpar.ulysses_bwd(dout, qh, kh, vh, oh, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


torch.library.register_autograd("seqpar::ulysses_fwd", _ulysses_backward, setup_context=_ulysses_setup_context)


def ulysses_op(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, world: int, *, docs: Tensor | None = None) -> Tensor:
    """``seqpar::ulysses_fwd`` for ``spec`` (``spec.group``: the Ulysses group, of ``world`` ranks); K/V heads already
    split over its ranks."""
    stages = ulysses_stages(k.shape[2] // world)
    return torch.ops.seqpar.ulysses_fwd(q, k, v, spec.group, world, stages, spec.causal, spec.layout, spec.scale, spec.backend, docs,
                                        spec.window, spec.chunk_size, spec.softcap)[0]

#: Ops whose outputs Selective Checkpoint++ keeps: the attention (out, lse), the head all-to-alls
#: and LASP's linear-attention kernel and state exchange.
ATTENTION_OPS = (
    torch.ops.seqpar.attn_fwd.default,
    torch.ops.seqpar.ulysses_fwd.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    *LASP_OPS,
)


# ---------------------------------------------------------------------------------------------
# validation: everything is checked from local metadata, before any collective


def _check_qkv(q, k, v) -> None:
    check_qkv_tensors(q, k, v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must have the same batch and local sequence length; got q={tuple(q.shape)}, k={tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim; got q={q.shape[3]}, k={k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"the number of query heads (q.shape[2]={q.shape[2]}) must be a multiple of the key/value heads (k.shape[2]={k.shape[2]})")


def _check_options(causal, layout, algorithm) -> None:
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; expected one of {LAYOUTS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; expected one of {ALGORITHMS}")


def _mesh_dims(mesh, algorithm: str) -> tuple[int, int]:
    """(hp, cp) of ``mesh`` for ``algorithm``, or a ValueError naming ``mesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if algorithm == "2d":
        if mesh.ndim != 2 or set(names) != {"hp", "cp"}:
            raise ValueError(f"algorithm='2d' needs a 2-D mesh with mesh_dim_names ('hp', 'cp'); got ndim={mesh.ndim}, names={names}")
        return mesh.size(names.index("hp")), mesh.size(names.index("cp"))
    if mesh.ndim != 1:
        raise ValueError(f"algorithm={algorithm!r} needs a 1-D mesh of the sequence-parallel ranks; got ndim={mesh.ndim}, names={names} "
                         "(use algorithm='2d' for an ('hp', 'cp') mesh)")
    return (mesh.size(), 1) if algorithm == "ulysses" else (1, mesh.size())


def check_head_chunks(head_chunks, h_kv: int | None, algorithm: str) -> None:
    """``head_chunks`` is a positive int, used only by ring / all-gather, and divides ``h_kv`` (when known)."""
    if not isinstance(head_chunks, int) or isinstance(head_chunks, bool) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
    if head_chunks > 1 and algorithm not in ("ring", "allgather"):
        raise ValueError(f"head_chunks={head_chunks} is for algorithm 'ring' or 'allgather' (Ulysses / 2D already split the heads "
                         f"over ranks), not {algorithm!r}")
    if h_kv is not None and h_kv % head_chunks:
        raise ValueError(f"head_chunks={head_chunks} must divide the number of key/value heads ({h_kv})")


def _check_sizes(q, k, algorithm, layout, hp, cp, inner_ring_size) -> None:
    s_local, h_q, h_kv = q.shape[1], q.shape[2], k.shape[2]
    if hp > 1 and h_q % hp:
        what = "sequence-parallel size" if algorithm == "ulysses" else "hp size"
        raise ValueError(f"algorithm={algorithm!r}: the number of query heads (q.shape[2]={h_q}) must be divisible by the {what} ({hp})")
    if hp > 1 and kv_repeat(h_q, h_kv, hp) is None:  # never when hp | h_q; kept as the invariant's check
        raise ValueError(f"cannot split {h_q} query heads / {h_kv} key-value heads over {hp} head-parallel ranks")
    # zigzag cuts the global sequence into 2 * hp * cp equal chunks: every local shard is two of them
    # (with one rank in the layout's dimension both layouts are the identity; Ulysses runs on a 1-D
    # mesh whose W ranks hold the layout's shards)
    layout_ranks = hp if algorithm == "ulysses" else cp
    if layout == "zigzag" and layout_ranks > 1 and s_local % 2:
        raise ValueError(
            f"layout='zigzag' needs the global sequence length divisible by 2 * sequence-parallel size: "
            f"q.shape[1]={s_local} is the local length of a global length {s_local * hp * cp}, not divisible by {2 * hp * cp}; "
            "shard with lightning_seqpar.sharding.shard_sequence after padding to that multiple"
        )
    if inner_ring_size is not None:
        if algorithm not in ("ring", "2d"):
            raise ValueError(f"inner_ring_size is only used by algorithm 'ring' or '2d', not {algorithm!r}")
        if not isinstance(inner_ring_size, int) or isinstance(inner_ring_size, bool) or inner_ring_size < 1 or cp % inner_ring_size:
            raise ValueError(f"inner_ring_size={inner_ring_size!r} must be a positive int dividing the context-parallel size ({cp})")


_DTYPE_CODES = {torch.float16: 16, torch.bfloat16: 161, torch.float32: 32, torch.float64: 64}  # in the rank-agreement message


def _group_name(mesh: DeviceMesh, dim: str | None = None) -> str:
    return (mesh.get_group(dim) if dim is not None else mesh.get_group()).group_name


# ---------------------------------------------------------------------------------------------


def _check_documents(documents, q, layout: str, algorithm: str, hp: int, cp: int) -> Tensor | None:
    """The piece lengths of ``documents`` for the custom ops, after checking they fit ``q`` (no communication)."""
    if documents is None:
        return None
    if not isinstance(documents, PackedDocuments):
        raise ValueError(f"documents must be a lightning_seqpar.sharding.documents.PackedDocuments or None, got {type(documents).__name__}")
    # the ranks the documents were split over: the 1-D ranks (Ulysses) or the cp ranks (ring, all-gather, 2D)
    world = hp if algorithm == "ulysses" else cp
    if layout != "zigzag" and world > 1:
        raise ValueError(f"documents are sharded with the per-document zigzag (PackedDocuments.shard); layout={layout!r} must be 'zigzag'")
    documents.check(batch=q.shape[0], local_len=q.shape[1] * hp * cp // world, world=world)
    return documents.pieces


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None,
                    backend: str = "auto", documents: PackedDocuments | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: Tensor | None = None, chunk_size: int | None = None) -> Tensor:
    """Exact attention on one device with the package's kernels. Shapes as
    :func:`sequence_parallel_attention`; GQA/MQA without repeating K/V in memory (math backend).
    ``documents``: packed documents (built with ``world=1``): attention stays inside each document.
    ``window``, ``softcap``, ``sinks``, ``chunk_size``: as :func:`sequence_parallel_attention`."""
    _check_qkv(q, k, v)
    _check_options(causal, "zigzag", "ring")
    var = check_variant_args(causal=causal, window=window, softcap=softcap, chunk_size=chunk_size, sinks=sinks, h_q=q.shape[2])
    docs = _check_documents(documents, q, "zigzag", "ring", 1, 1)
    be = _checked_backend(backend, q.device, q.dtype, q.shape[-1])
    spec = AttentionSpec(kind="local", causal=causal, layout="zigzag", scale=default_scale(q.shape[-1], scale), backend=be,
                         window=var.window, chunk_size=var.chunk, softcap=var.softcap)
    return attention_op(q, k, v, spec, docs=docs, sinks=_sinks_on(sinks, q))


def _sinks_on(sinks: Tensor | None, q: Tensor, heads: slice = slice(None)) -> Tensor | None:
    """The sink logits of the query heads ``heads`` on q's device (differentiable: a slice, no copy when already there)."""
    if sinks is None:
        return None
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on the device of q ({q.device}), got {sinks.device}")
    return sinks[heads]


def sequence_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh,
    algorithm: Algorithm = "ring",
    causal: bool = True,
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    scale: float | None = None,
    backend: str = "auto",
    inner_ring_size: int | None = None,
    documents: PackedDocuments | None = None,
    head_chunks: int = 1,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    agreement: RankAgreement | None = None,
) -> Tensor:
    """Exact attention of sequence-sharded ``q, k, v`` — the same result as attention on the
    full sequence, sharded the same way.

    Args:
        q: ``[B, S_local, H_q, D]``, this rank's shard (see :func:`lightning_seqpar.sharding.shard_sequence`).
        k, v: ``[B, S_local, H_kv, D]`` with ``H_q % H_kv == 0`` (MHA, GQA, MQA, any head count).
        mesh: the sequence-parallel ranks: 1-D (any axis name) for "ring", "allgather", "ulysses";
            2-D with axes ("hp", "cp") for "2d".
        algorithm: "ring" (LightSeq DistAttn), "allgather" (LSS), "ulysses" (head all-to-all) or
            "2d" (LoongTrain: ulysses over hp x ring over cp).
        causal: causal mask over global positions.
        layout: how the global sequence was split ("zigzag" balances causal work).
        scale: softmax scale, default ``1 / sqrt(D)``.
        backend: local kernel: "auto", "cudnn", "flash", "efficient" or "math".
        inner_ring_size: double ring (LoongTrain §4.3) inner ring size for "ring" / "2d"; must
            divide the context-parallel size. None = one ring.
        documents: packed documents (:class:`lightning_seqpar.sharding.documents.PackedDocuments`, built from
            the full batch with ``world`` = the context-parallel size, or the mesh size for
            "ulysses"; shards from its ``shard``): attention never crosses a document boundary,
            and the per-document zigzag gives every rank the same work. None: one sequence.
        head_chunks: "ring" / "allgather": run over this many groups of K/V heads one after
            another (Note [Head chunks]): the same result with 1/head_chunks of the working memory.
            Must divide ``H_kv``.
        window: sliding window (causal only): query i sees keys j with i - window < j <= i, i and j
            global token positions (transformers' ``sliding_window``). None: no window. The ring
            skips the block pairs wholly outside the window (Note [Windows, zigzag and the ring]).
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2's
            ``attn_logit_softcapping``). None: none.
        sinks: ``[H_q]`` logits that join each query head's softmax denominator only (gpt-oss);
            differentiable. None: none.
        chunk_size: chunked attention (Llama 4): query i sees keys j with i // chunk_size ==
            j // chunk_size (and j <= i when causal), global positions. With ``documents``, i and j
            are the positions inside the document (every document chunked from its own first
            token, as if alone) and the document mask holds too. None: none. Note [Attention variants] in ``lightning_seqpar/attention/variants.py``.
        agreement: a :class:`lightning_seqpar.sharding.agreement.RankAgreement` that the caller keeps across calls: the
            ranks' inputs are compared until a call on ``mesh`` agrees, then not again (None: on every call).

    Returns:
        ``[B, S_local, H_q, D]`` in the dtype of ``q``. Differentiable in ``q, k, v``.

    Raises:
        ValueError: naming the argument, before any communication, for any input it does not take;
            and on every rank, on a call that compares them (``agreement``), when the ranks passed different shapes or
            options (one small all-gather; Note [Inputs that differ across ranks] in ``lightning_seqpar/sharding/agreement.py``).
    """
    _check_qkv(q, k, v)
    _check_options(causal, layout, algorithm)
    hp, cp = _mesh_dims(mesh, algorithm)
    _check_sizes(q, k, algorithm, layout, hp, cp, inner_ring_size)
    check_head_chunks(head_chunks, k.shape[2], algorithm)
    var = check_variant_args(causal=causal, window=window, softcap=softcap, chunk_size=chunk_size, sinks=sinks, h_q=q.shape[2])
    docs = _check_documents(documents, q, layout, algorithm, hp, cp)
    be = _checked_backend(backend, q.device, q.dtype, q.shape[-1])
    sc = default_scale(q.shape[-1], scale)
    inner = inner_ring_size or 0
    _sinks_on(sinks, q)
    check_ranks_agree(mesh, lambda: dict(  # Note [Inputs that differ across ranks]
        batch=q.shape[0], seq_local=q.shape[1], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3], head_dim_v=v.shape[3],
        dtype=_DTYPE_CODES.get(q.dtype, 0), algorithm=ALGORITHMS.index(algorithm), causal=int(causal), layout=LAYOUTS.index(layout),
        scale=sc, inner_ring_size=inner, head_chunks=head_chunks, documents=int(docs is not None), window=var.window,
        chunk_size=var.chunk, softcap=var.softcap, sinks=int(sinks is not None),
        sinks_sum=0.0 if sinks is None else float(sinks.detach().double().sum())), q.device, "sequence_parallel_attention", agreement)
    local = AttentionSpec(kind="local", causal=causal, layout=layout, scale=sc, backend=be, window=var.window,
                          chunk_size=var.chunk, softcap=var.softcap)

    if algorithm in ("ring", "allgather"):
        if cp == 1:
            return attention_op(q, k, v, replace(local, head_chunks=head_chunks), docs=docs, sinks=sinks)
        spec = replace(local, kind=algorithm, group=_group_name(mesh), inner_ring_size=inner, head_chunks=head_chunks)
        return attention_op(q, k, v, spec, docs=docs, sinks=sinks)

    hp_rank = mesh.get_local_rank() if algorithm == "ulysses" else mesh.get_local_rank("hp")
    heads = slice(hp_rank * (q.shape[2] // hp), (hp_rank + 1) * (q.shape[2] // hp))  # the query heads this rank attends for
    local_sinks = _sinks_on(sinks, q, heads)
    if algorithm == "ulysses":
        if hp == 1:
            return attention_op(q, k, v, local, docs=docs, sinks=sinks)
        if sinks is None:  # Note [Overlapped Ulysses]
            k, v = split_kv_heads(q, k, v, hp)
            return ulysses_op(q, k, v, replace(local, group=_group_name(mesh)), hp, docs=docs)
        return two_d_attention(q, k, v, hp=hp, hp_group=_group_name(mesh),
                               inner_attention=_gathered_local(hp, q.shape[1], local, docs, local_sinks))

    ring = replace(local, kind="ring", group=_group_name(mesh, "cp"), inner_ring_size=inner) if cp > 1 else replace(local, inner_ring_size=inner)

    def ring_over_cp(qh, kh, vh):
        return attention_op(qh, kh, vh, ring, docs=docs, sinks=local_sinks)

    if hp == 1:
        return ring_over_cp(q, k, v)
    return two_d_attention(q, k, v, hp=hp, hp_group=_group_name(mesh, "hp"), inner_attention=ring_over_cp)


def gathered_kv_attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, causal: bool = True,
                          layout: Literal["zigzag", "contiguous"] = "zigzag", scale: float | None = None,
                          backend: str = "auto", documents: PackedDocuments | None = None) -> Tensor:
    """Local queries attending to keys/values of the whole sequence that this rank already has.

    The second half of all-gather attention, for callers that gather something cheaper than K/V
    themselves — the LSS Transformer's fused communication (Principle 3) all-gathers the layer
    input x once and projects K and V locally. No communication happens here.

    Args:
        q: ``[B, S_local, H_q, D]``, this rank's shard.
        k, v: ``[B, W * S_local, H_kv, D]``: every rank's shard concatenated in rank order (what
            an all-gather along the sequence gives). Their gradients are the full dK/dV from this
            rank's queries; summing them over ranks (the reduce-scatter of the all-gather's
            backward) gives each shard's gradient.
        mesh: the 1-D sequence-parallel mesh; causal, layout, scale, backend, documents: as
            :func:`sequence_parallel_attention`.
    """
    _check_options(causal, layout, "allgather")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, seq, heads, head_dim], got {getattr(t, 'shape', type(t).__name__)}")
    _, cp = _mesh_dims(mesh, "allgather")
    if k.shape[1] != q.shape[1] * cp:
        raise ValueError(f"k.shape[1]={k.shape[1]} must be the whole sequence: q.shape[1] ({q.shape[1]}) x mesh size ({cp})")
    _check_qkv(q, k[:, : q.shape[1]], v[:, : q.shape[1]])
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k={tuple(k.shape)}, v={tuple(v.shape)}")
    _check_sizes(q, k, "allgather", layout, 1, cp, None)
    docs = _check_documents(documents, q, layout, "allgather", 1, cp)
    be = _checked_backend(backend, q.device, q.dtype, q.shape[-1])
    sc = default_scale(q.shape[-1], scale)
    local = AttentionSpec(kind="local", causal=causal, layout=layout, scale=sc, backend=be)
    if cp == 1:
        return attention_op(q, k, v, local, docs=docs)
    return attention_op(q, k, v, replace(local, kind="gathered", group=_group_name(mesh)), docs=docs)


def _gathered_local(world: int, s_local: int, spec: AttentionSpec, docs: Tensor | None = None, sinks: Tensor | None = None):
    """Local attention (``spec``, of kind "local") over the whole sequence gathered in rank order (Ulysses); ``sinks``:
    of this rank's heads."""

    def attend(qh, kh, vh):
        if docs is not None:  # the op puts the rank-ordered documents in order itself
            return attention_op(qh, kh, vh, spec, docs=docs, sinks=sinks)
        reorder = spec.layout == "zigzag" and (spec.causal or bool(spec.window or spec.chunk_size or spec.softcap))
        if reorder:  # rank order -> global order, so the masks over positions are the plain ones
            order = global_order(world, spec.layout, s_local, qh.device)
            qh, kh, vh = (x.index_select(1, order) for x in (qh, kh, vh))
        out = attention_op(qh, kh, vh, spec, sinks=sinks)
        if reorder:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            out = out.index_select(1, inverse)
        return out

    return attend


@torch.compiler.assume_constant_result
def _checked_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``resolve_backend`` of a call, a constant to torch.compile: its device queries (``cudnn.is_available()``) would
    break a compiled block's graph (Note [Checkpoints under torch.compile] in ``lightning_seqpar.parallel.activation_checkpointing``)."""
    return resolve_backend(backend, device, dtype, head_dim)


@torch.compiler.assume_constant_result
def _auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int, cudnn_exact: bool, short: bool) -> str:
    """``backend="auto"``'s kernel for a call (``short``: fewer than ``FA4_MIN_TOKENS`` local query tokens), logged once
    per process. A constant to torch.compile, computed (and logged) while Dynamo traces: the device queries and the
    logger inside break a graph, and a checkpointed block's graph may hold no side effect (Note [Checkpoints under
    torch.compile] in ``lightning_seqpar.parallel.activation_checkpointing``); the arguments are all the answer depends on."""
    backend = resolve_backend("auto", device, dtype, head_dim, cudnn_exact=cudnn_exact, seq_len=1 if short else FA4_MIN_TOKENS)
    log_auto_backend(backend, cudnn_exact=cudnn_exact, seq_len=1 if short else FA4_MIN_TOKENS)
    return backend


class Attention(nn.Module):
    """Scaled dot-product attention that a model calls; local until configured.

    ``forward(q, k, v)`` takes ``[B, S, H_q, D]`` and ``[B, S, H_kv, D]`` and returns
    ``[B, S, H_q, D]``. ``lightning_seqpar.parallel.parallelize.apply_attention`` calls :meth:`configure` on
    every instance, after which the same model code runs sequence-parallel attention over the
    mesh. The module has no parameters. Packed documents: the ``documents`` argument, else the
    batch's documents that ``SequenceParallelStrategy`` sets (``current_documents()``).
    """

    def __init__(self, *, causal: bool = True, scale: float | None = None) -> None:
        super().__init__()
        self.causal = causal
        self.scale = scale
        self.mesh: DeviceMesh | None = None
        self.algorithm: str = "ring"
        self.layout: str = "zigzag"
        self.backend: str = "auto"
        self.inner_ring_size: int | None = None
        self.head_chunks: int = 1
        self.cudnn_exact = False
        self.agreement = RankAgreement()

    def configure(self, *, mesh: DeviceMesh | None, algorithm: Algorithm = "ring", layout: str = "zigzag",
                  backend: str = "auto", inner_ring_size: int | None = None, head_chunks: int = 1,
                  agreement: RankAgreement | None = None, cudnn_exact: bool = False) -> None:
        """Run sequence-parallel attention over ``mesh`` (None: back to local attention). ``agreement``: shared by
        the modules of one model (``apply_attention``), so that the ranks' inputs are compared on the first call of
        the first layer only (Note [Inputs that differ across ranks]); None: a new one for this module.
        ``cudnn_exact``: the model's attention gradients are exact with cuDNN, so ``backend="auto"`` may take it
        (Note [Choosing the local kernel])."""
        if mesh is not None:
            _check_options(self.causal, layout, algorithm)
            _mesh_dims(mesh, algorithm)
        self.mesh, self.algorithm, self.layout, self.backend, self.inner_ring_size = mesh, algorithm, layout, backend, inner_ring_size
        self.head_chunks = head_chunks
        self.cudnn_exact = bool(cudnn_exact)
        self.agreement = agreement if agreement is not None else RankAgreement()

    def _backend(self, q: Tensor) -> str:
        """The kernel of this call: ``backend``, or for "auto" the fastest exact one for the model (logged once)."""
        if self.backend != "auto" or q.device.type != "cuda":
            return self.backend
        return _auto_backend(q.device, q.dtype, q.shape[-1], self.cudnn_exact, bool(q.shape[1] < FA4_MIN_TOKENS))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: PackedDocuments | None = None, *, window: int | None = None,
                softcap: float | None = None, sinks: Tensor | None = None, chunk_size: int | None = None,
                causal: bool | None = None, scale: float | None = None) -> Tensor:
        """``documents``: packed documents to mask by; default the batch's (``lightning_seqpar.sharding.documents.current_documents``).
        ``window``, ``softcap``, ``sinks``, ``chunk_size``: per call (a model alternates them by layer), as
        :func:`sequence_parallel_attention`. ``causal``: this call's mask, default the module's (a routed
        ``F.scaled_dot_product_attention`` call passes its ``is_causal`` and ``scale``); ``scale``: likewise."""
        causal = self.causal if causal is None else causal
        scale = self.scale if scale is None else scale
        documents = documents if documents is not None else current_documents()
        variant = dict(window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size)
        backend = self._backend(q)
        if self.mesh is None:
            return local_attention(q, k, v, causal=causal, scale=scale, backend=backend, documents=documents, **variant)
        return sequence_parallel_attention(q, k, v, mesh=self.mesh, algorithm=self.algorithm, causal=causal,  # type: ignore[arg-type]
                                           layout=self.layout, scale=scale, backend=backend,  # type: ignore[arg-type]
                                           inner_ring_size=self.inner_ring_size, documents=documents,
                                           head_chunks=self.head_chunks, agreement=self.agreement, **variant)

    def extra_repr(self) -> str:
        where = "local" if self.mesh is None else f"{self.algorithm}, layout={self.layout}, mesh={tuple(self.mesh.shape)}"
        return f"causal={self.causal}, {where}"
