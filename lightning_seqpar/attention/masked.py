"""Block kernels for masked and soft-capped attention (Note [Attention variants] in
``lightning_seqpar.attention.variants``).

    variant_block_forward(q, k, v, mask, scale, backend)                  -> out, lse (as block_forward)
    variant_block_backward(dout, q, k, v, out, lse, mask, scale, backend) -> dq, dk, dv

The mask of a block comes from the global positions of its rows (``Mask``). Kernels:

* full block, no softcap: the dense kernels of ``lightning_seqpar.attention.local``;
* "math" (CPU, and the reference): pure torch, the (Sq, Sk) mask built from the positions,
  softcap c * tanh(x / c) and its derivative 1 - tanh^2 in backward; fp64 accumulation on the CPU;
* CUDA, sliding window on a diagonal block (the single-device case, and every ring's own
  shard under the contiguous layout), no softcap / chunk / documents, bf16/fp16: torch's
  flash-attention-2 kernel with ``window_size_left = w - 1`` (head dims up to 256; it takes the
  merged lse in backward like the dense kernels);
* CUDA otherwise: FlexAttention (``torch.nn.attention.flex_attention``, compiled): a BlockMask
  built from 128-row tiles of the positions (tiles wholly masked are never visited, tiles wholly
  allowed skip the mask_mod), ``mask_mod`` over the global positions and document ids,
  ``score_mod`` for the softcap.

Note [FlexAttention backward with the merged lse]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The distributed algorithms run each block's backward with the FINAL (out, lse) of its rows
(Note [Merging partial attention]). FlexAttention's public API only differentiates its own
forward, so the backward recomputes the block's (o_b, l_b) and back-propagates
    g_o = w * dout,  g_l = w * (rowsum(dout * o_b) - rowsum(dout * out)),  w = exp(l_b - lse),
which is exactly the merged gradient: with P_b = exp(x - l_b), autograd gives
dS = P_b * (g_o V^T - rowsum(g_o * o_b) + g_l) = w P_b (dout V^T - rowsum(dout * out)) = P (dP - delta)
with P = exp(x - lse). The price is one extra forward of the block in backward.
"""

from __future__ import annotations

import contextlib

import functools

import torch
from torch import Tensor

from lightning_seqpar.attention.local import acc_dtype, block_backward, block_forward, fa4_interface, fa4_supports, finite_lse
from lightning_seqpar.attention.variants import Mask

_TILE = 128  # FlexAttention's default block size


# ---------------------------------------------------------------------------------------------
# pure torch


def allowed_pairs(mask: Mask) -> Tensor | None:
    """[Bp, Sq, Sk] bool of the pairs the mask lets through (None: all)."""
    if mask.full:
        return None
    v = mask.variant
    qp, kp = mask.q_pos[:, :, None], mask.k_pos[:, None, :]
    a = torch.ones(max(qp.shape[0], kp.shape[0]), qp.shape[1], kp.shape[2], dtype=torch.bool, device=qp.device)
    if v.causal:
        a &= kp <= qp
    if v.window:
        a &= kp > qp - v.window
    if v.chunk:
        a &= torch.div(qp, v.chunk, rounding_mode="floor") == torch.div(kp, v.chunk, rounding_mode="floor")
    if mask.q_doc is not None:
        a = a & (mask.q_doc[:, :, None] == mask.k_doc[:, None, :])
    return a


def _math_scores(q, k, mask: Mask, scale: float):
    """(scores with -inf where masked, tanh(x / softcap) or None): (B, Hkv, G, Sq, Sk) in the accumulation dtype."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    acc = acc_dtype(q.dtype, q.device)
    x = torch.einsum("bqhgd,bkhd->bhgqk", q.to(acc).view(B, Sq, Hkv, Hq // Hkv, D), k.to(acc)) * scale
    t = None
    if mask.variant.softcap:
        t = torch.tanh(x / mask.variant.softcap)
        x = mask.variant.softcap * t
    allowed = allowed_pairs(mask)
    if allowed is not None:
        x = x.masked_fill(~allowed[:, None, None], float("-inf"))
    return x, t


def _math_forward(q, k, v, mask: Mask, scale: float):
    B, Sq, Hq, _ = q.shape
    s, _ = _math_scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq)
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(p.dtype)).reshape(B, Sq, Hq, v.shape[-1])
    return out.to(q.dtype), lse.reshape(B, Hq, Sq)


def _math_backward(dout, q, k, v, out, lse, mask: Mask, scale: float):
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    s, t = _math_scores(q, k, mask, scale)
    lse = lse.reshape(B, Hkv, G, Sq).to(s.dtype)
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1)).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)
    acc, Dv = p.dtype, v.shape[-1]
    do = dout.to(acc).view(B, Sq, Hkv, G, Dv)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(acc))
    delta = (do * out.to(acc).view(B, Sq, Hkv, G, Dv)).sum(-1).permute(0, 2, 3, 1)  # (B, Hkv, G, Sq)
    ds = p * (dp - delta.unsqueeze(-1))
    if t is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(acc)).reshape(B, Sq, Hq, D) * scale
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(acc).view(B, Sq, Hkv, G, D)) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# torch's flash-attention-2 with a sliding window (CUDA, bf16/fp16)


def fa2_window_applies(q: Tensor, k: Tensor, mask: Mask, backend: str) -> bool:
    v = mask.variant
    return (backend != "math" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and v.causal and bool(v.window)
            and not v.chunk and not v.softcap and mask.q_doc is None and mask.offset == 0 and q.shape[1] == k.shape[1]
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0)


def fa2_window_forward(q, k, v, window: int, scale: float):
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False, scale=scale,
                                                       window_size_left=window - 1, window_size_right=0)[:2]
    return out, lse.to(acc_dtype(q.dtype, q.device))


def fa2_window_backward(dout, q, k, v, out, lse, window: int, scale: float):
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    out = out.contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dout.contiguous().to(out.dtype), q.contiguous(), k.contiguous(), v.contiguous(),
                                                         out, lse.float().contiguous(), None, None, q.shape[1], k.shape[1], 0.0, True,
                                                         seed, offset, scale=scale, window_size_left=window - 1, window_size_right=0)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# flash-attn 4 (CUDA, when installed): its own sliding window and soft-capping


def fa4_variant_applies(q: Tensor, k: Tensor, mask: Mask, backend: str) -> bool:
    """Blocks flash-attn 4 computes with its own window / softcap: a fully visible block (softcap
    only), or a diagonal causal block (the same positions for queries and keys) with a window
    and / or a softcap. Chunks and packed documents take FlexAttention."""
    v = mask.variant
    if backend != "fa4" or not q.is_cuda or v.chunk or mask.q_doc is not None or not fa4_supports(q.shape[-1]):
        return False
    return mask.full or (v.causal and mask.offset == 0 and q.shape[1] == k.shape[1])


def _fa4_variant_kwargs(mask: Mask) -> dict:
    v = mask.variant
    kw: dict = {"causal": v.causal and not mask.full}
    if v.window and not mask.full:
        kw.update(window_size_left=v.window - 1, window_size_right=0)
    return kw


def fa4_variant_forward(q, k, v, mask: Mask, scale: float):
    kw = _fa4_variant_kwargs(mask)
    out, lse = fa4_interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, softcap=mask.variant.softcap or None, return_lse=True, **kw)[:2]
    return out, lse.float()


def fa4_variant_backward(dout, q, k, v, out, lse, mask: Mask, scale: float):
    kw = _fa4_variant_kwargs(mask)
    out = out.contiguous()
    dq, dk, dv = fa4_interface()._flash_attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), out, dout.contiguous().to(out.dtype),
                                        lse.float().contiguous(), scale, softcap=mask.variant.softcap or 0.0, **kw)[:3]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# FlexAttention (CUDA)


@functools.cache
def flex_functions():
    """(compiled flex_attention, BlockMask, AuxRequest or None)."""
    from torch.nn.attention import flex_attention as fa

    return torch.compile(fa.flex_attention, dynamic=False), fa.BlockMask, getattr(fa, "AuxRequest", None)


def _tiles(pos: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tile (min, max) of ``pos`` [Bp, S] -> [Bp, ceil(S / TILE)] each."""
    n = pos.shape[1]
    T = -(-n // _TILE)
    if T * _TILE != n:
        pos = torch.cat([pos, pos[:, -1:].expand(-1, T * _TILE - n)], 1)
    p = pos.view(pos.shape[0], T, _TILE)
    return p.amin(-1), p.amax(-1)


def tile_kinds(mask: Mask) -> tuple[Tensor, Tensor]:
    """(partial, full) bool [Bp, Tq, Tk] of the 128 x 128 tiles of a block (interval bounds, as ``classify``)."""
    v = mask.variant
    qlo, qhi = (t[:, :, None] for t in _tiles(mask.q_pos))
    klo, khi = (t[:, None, :] for t in _tiles(mask.k_pos))
    dmin, dmax = qlo - khi, qhi - klo
    skip = torch.zeros(torch.broadcast_shapes(dmin.shape, dmax.shape), dtype=torch.bool, device=dmin.device)
    full = ~skip
    if v.causal:
        skip |= dmax < 0
        full &= dmin >= 0
    if v.window:
        skip |= dmin >= v.window
        full &= dmax < v.window
    if v.chunk:
        c = v.chunk
        skip |= (qhi // c < klo // c) | (khi // c < qlo // c)
        full &= (qlo // c == qhi // c) & (klo // c == khi // c) & (qlo // c == klo // c)
    if mask.q_doc is not None:
        dqlo, dqhi = (t[:, :, None] for t in _tiles(mask.q_doc))
        dklo, dkhi = (t[:, None, :] for t in _tiles(mask.k_doc))
        skip = skip | (dqhi < dklo) | (dkhi < dqlo)
        full = full & (dqlo == dqhi) & (dklo == dkhi) & (dqlo == dklo)
    full = full & ~skip
    return ~skip & ~full, full


def _mask_mod(mask: Mask):
    v = mask.variant
    qp, kp, qd, kd = mask.q_pos, mask.k_pos, mask.q_doc, mask.k_doc
    Sq, Sk = qp.shape[1] - 1, kp.shape[1] - 1
    per_q, per_k = qp.shape[0] > 1, kp.shape[0] > 1

    def mask_mod(b, h, qi, kj):
        qi, kj = torch.clamp(qi, max=Sq), torch.clamp(kj, max=Sk)
        i = qp[b, qi] if per_q else qp[0, qi]
        j = kp[b, kj] if per_k else kp[0, kj]
        ok = i >= 0
        if v.causal:
            ok = ok & (j <= i)
        if v.window:
            ok = ok & (j > i - v.window)
        if v.chunk:
            ok = ok & (i // v.chunk == j // v.chunk)
        if qd is not None:
            ok = ok & (qd[b, qi] == kd[b, kj])
        return ok

    return mask_mod


def flex_block_mask(mask: Mask):
    """The FlexAttention ``BlockMask`` of ``mask`` (None where every key is seen)."""
    if mask.full:
        return None
    _, BlockMask, _ = flex_functions()
    partial, full = tile_kinds(mask)

    def compact(m):  # [Bp, Tq, Tk] -> ([Bp, 1, Tq] counts, [Bp, 1, Tq, Tk] indices of the set tiles first)
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[:, None].contiguous(), idx[:, None].contiguous()

    kv_num, kv_idx = compact(partial)
    full_num, full_idx = compact(full)
    with _functorch_usable():
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, _TILE, _mask_mod(mask),
                                        seq_lengths=(mask.q_pos.shape[1], mask.k_pos.shape[1]))


# Note [vmap inside the attention op]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# BlockMask.from_kv_blocks builds its transposed indices with torch.vmap. Under Selective
# Checkpoint++ the attention op is run by the checkpoint's TorchDispatchMode, which calls it with
# every key after Python in the thread's exclude set, functorch's and ADInplaceOrView among them;
# vmap's view ops then fail ("Cannot access storage of BatchedTensorImpl": seen on 4 x H200 with a
# gpt-oss-shaped model, sinks and sliding layers under all-gather attention). Those keys are
# lifted from the exclude set while the mask is built, as ``_autograd_below_dispatch`` lifts the
# autograd keys for the backward.
_FUNCTORCH_KEYS = ("ADInplaceOrView", "FuncTorchDynamicLayerBackMode", "FuncTorchDynamicLayerFrontMode", "FuncTorchBatched",
                   "Batched", "VmapMode", "FuncTorchVmapMode", "BatchedNestedTensor", "FuncTorchGradWrapper")


@contextlib.contextmanager
def _functorch_usable():
    """Note [vmap inside the attention op]."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    for name in _FUNCTORCH_KEYS:
        if hasattr(torch._C.DispatchKey, name):
            keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - keys):
        yield


def flex_call(q, k, v, mask: Mask, scale: float, block_mask):
    """One FlexAttention call of ``mask``'s variant: (output, log-sum-exp)."""
    flex, _, AuxRequest = flex_functions()
    c = mask.variant.softcap
    score_mod = None
    if c:
        def score_mod(score, b, h, qi, kj):
            return c * torch.tanh(score / c)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [B, S, H, D] -> [B, H, S, D] view
    gqa = q.shape[2] != k.shape[2]
    if AuxRequest is not None:
        out, aux = flex(t(q), t(k), t(v), score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                        return_aux=AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = flex(t(q), t(k), t(v), score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    return t(out), lse


def flex_forward(q, k, v, mask: Mask, scale: float, block_mask=None):
    out, lse = flex_call(q, k, v, mask, scale, flex_block_mask(mask) if block_mask is None else block_mask)
    # rows that see no key: the merge wants lse = -inf and out = 0
    lse = lse.to(acc_dtype(q.dtype, q.device))
    empty = torch.isinf(lse) | (lse < -1e30)
    lse = lse.masked_fill(empty, float("-inf"))
    return out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0), lse


@contextlib.contextmanager
def _autograd_below_dispatch():
    """Record autograd inside a custom op's implementation.

    The implementation of ``seqpar::attn_bwd`` runs below the Autograd dispatch key (the keys are
    in the thread's exclude set), so ``torch.enable_grad()`` alone records nothing there and
    ``torch.autograd.grad`` fails with "element 0 of tensors does not require grad". Lift the
    autograd keys from the exclude set for this block only."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCUDA)
    keys = keys | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - keys), torch.enable_grad():
        yield


def flex_backward(dout, q, k, v, out, lse, mask: Mask, scale: float, block_mask=None):
    """Note [FlexAttention backward with the merged lse]."""
    bm = flex_block_mask(mask) if block_mask is None else block_mask
    with _autograd_below_dispatch():
        qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
        o_b, l_b = flex_call(qr, kr, vr, mask, scale, bm)
        lse_f = lse.to(torch.float32)
        seen = ~torch.isinf(lse_f)
        w = torch.where(seen, torch.exp(l_b.detach().float() - torch.where(seen, lse_f, 0.0)), 0.0)  # (B, H, S)
        w = torch.nan_to_num(w, nan=0.0)
        do = dout.float()
        g_o = (do * w.transpose(1, 2).unsqueeze(-1)).to(o_b.dtype)
        g_l = w * ((do * o_b.detach().float()).sum(-1) - (do * out.float()).sum(-1)).transpose(1, 2)
        dq, dk, dv = torch.autograd.grad((o_b, l_b), (qr, kr, vr), (g_o, g_l.to(l_b.dtype)))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------


def _dense(mask: Mask) -> bool:
    return mask.full and not mask.variant.softcap


def _uses_math(q: Tensor, backend: str) -> bool:
    return backend == "math" or not q.is_cuda


def variant_block_forward(q, k, v, mask: Mask, *, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq]) of one block under ``mask``."""
    if _dense(mask):
        return block_forward(q, k, v, causal=False, scale=scale, backend=backend)
    if _uses_math(q, backend):
        out, lse = _math_forward(q, k, v, mask, scale)
    elif fa4_variant_applies(q, k, mask, backend):
        out, lse = fa4_variant_forward(q, k, v, mask, scale)
    elif fa2_window_applies(q, k, mask, backend):
        out, lse = fa2_window_forward(q, k, v, mask.variant.window, scale)
    else:
        out, lse = flex_forward(q, k, v, mask, scale)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def variant_block_backward(dout, q, k, v, out, lse, mask: Mask, *, scale: float, backend: str):
    """(dq, dk, dv) of one block given the final (out, lse) of its rows."""
    if _dense(mask):
        return block_backward(dout, q, k, v, out, lse, causal=False, scale=scale, backend=backend)
    if _uses_math(q, backend):
        return _math_backward(dout, q, k, v, out, lse, mask, scale)
    if fa4_variant_applies(q, k, mask, backend):
        return fa4_variant_backward(dout, q, k, v, out, lse, mask, scale)
    if fa2_window_applies(q, k, mask, backend):
        return fa2_window_backward(dout, q, k, v, out, lse, mask.variant.window, scale)
    return flex_backward(dout, q, k, v, out, lse, mask, scale)
