"""Causal linear attention with decay, and LASP: sequence parallelism that passes only the KV state
(LASP: Sun et al., arXiv:2404.02882, §2.2, Alg. 2-3; the TransNormerLLM token mixer).

Public names:

* :func:`linear_attention_chunked` — one device, optional initial state in and final state out;
  pure torch on CPU (the reference), ``fla-core``'s ``chunk_simple_gla`` on CUDA when installed.
* :func:`linear_attention_chunked_backward` — its explicit backward (what the kernel op runs).
* :func:`linear_attention` — the same attention through the kernel op (what models run unsharded).
* :func:`lasp_attention` — the sequence-parallel version over a 1-D mesh (contiguous layout).
* :class:`LinearAttention` — a parameter-free module that models call; ``configure`` switches it
  from local to LASP (the strategy's job), like :class:`lightning_seqpar.attention.Attention`.
* :data:`LASP_OPS` — the custom ops whose outputs Selective Checkpoint++ must keep.

Note [Linear attention with decay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per head, with decay lambda = exp(decay_log[h]) (decay_log <= 0), no 1/sqrt(d) scale and no
denominator (TNL; LASP Eq. 4-6):

    o_t = sum_{s <= t} lambda^(t-s) (q_t . k_s) v_s
        = q_t^T S_t,        S_t = lambda S_{t-1} + k_t v_t^T,   S: [Dk, Dv] ("KV state")

An initial state S_0 adds lambda^(t+1) q_t^T S_0 to o_t (t counted from 0 in the block). The
chunked form (LASP Eq. 7-11, inside one device) cuts T tokens into chunks of c; per chunk,
with b_i = (i + 1) log(lambda) for the chunk position i and S the state entering the chunk:

    intra:  O  = [(Q K^T) * M] V                    M_ij = lambda^(i-j) (i >= j), else 0
    inter:  O += (Q * lambda^(i+1)) S               the state of everything before the chunk
    state:  S' = lambda^m S + (K * lambda^(m-1-j))^T V      m = chunk length (the last may be short)

so the work is O(T c d + T d^2) and the memory O(T (c + d^2 / c)): linear in T. Everything is
computed in fp32 and the output is cast to the input dtype. Backward runs the adjoint of the same
three lines (the chunk states are recomputed from the initial state, chunk by chunk: local work,
no communication):

    dS   = lambda^m dS' + (Q * lambda^(i+1))^T dO          (reverse scan over chunks)
    dQ   = [(dO V^T) * M] K + (dO S^T) * lambda^(i+1)
    dK   = [(dO V^T) * M]^T Q + (V dS'^T) * lambda^(m-1-j)
    dV   = [(Q K^T) * M]^T dO + (K * lambda^(m-1-j)) dS'

Note [LASP]
~~~~~~~~~~~
The sequence is split contiguously: rank r holds tokens [r C, (r+1) C) (C = T / W, contiguous
layout of ``lightning_seqpar.sharding``). Only the [B, H, Dk, Dv] fp32 KV state crosses ranks, so
the communication does not depend on the sequence length (LASP §2.3, Table 1):

    forward (Alg. 2)                              backward (Alg. 3)
    r0      r1      r2      r3                    r0      r1      r2      r3
    local   local   local   local   (parallel)    P       P       P       P       (cheap)
      S1 -----> S2 -----> S3 ---->                  <----- dS1 <----- dS2 <----- dS3
    +inter  +inter  +inter  +inter                local   local   local   local   (parallel)

1. Every rank computes its chunk with a zero initial state: out_local and S_loc (its own
   tokens' contribution to the state), in parallel — the intra part, all of the heavy work.
2. Rank r receives S_in (the state after all tokens before its chunk) from r - 1 (rank 0: zero),
   adds the inter part out = out_local + (q * lambda^(t+1)) S_in and sends
   S_out = lambda^C S_in + S_loc to r + 1: the state handed on includes the decay over the whole
   local chunk (LASP Eq. 11).
3. S_in is an output of the custom op, so autograd keeps it for backward (KV state caching,
   LASP §2.4): backward neither recomputes it nor communicates for it.
4. Backward: from the cached S_in, dq += (dout S_in^T) * lambda^(t+1), and P = (q *
   lambda^(t+1))^T dout is the gradient of S_in. Rank r receives dS_out (the gradient of its S_out,
   hence of its S_loc) from r + 1 (last rank: zero) and sends dS_in = lambda^C dS_out + P to
   r - 1 (Eq. 21). Then the local backward runs with dS_out as the gradient of its final state,
   which adds dk += (v dS_out^T) * lambda^(C-1-j) and dv += (k * lambda^(C-1-j)) dS_out to the
   intra part (Alg. 3 lines 14-15).

Each hop carries B * H * Dk * Dv fp32 numbers (one send per rank per layer per direction); only
O(C d^2) work per rank sits on the W - 1 hop chain, the heavy local kernels run in parallel
before it (forward) or after it (backward).

Note [All-gather variant]
~~~~~~~~~~~~~~~~~~~~~~~~~
Instead of the W - 1 hop chain, every rank all-gathers the W local states S_loc(s) once and
forms its own initial state directly (equal chunk lengths C, so the decay between ranks is
lambda^C per rank):

    S_in(r) = sum_{s < r} lambda^(C (r-1-s)) S_loc(s)             (unrolls S_out = lambda^C S_in + S_loc)

Backward. S_in(r) enters the loss only through the inter part of rank r, whose gradient is the
local P_r = (q_r * lambda^(t+1))^T do_r. By the formula above, S_loc(s) reaches the loss through
S_in(r) of every later rank r > s, so

    dS_loc(s) = sum_{r > s} lambda^(C (r-1-s)) P_r.

This is the adjoint of "all-gather, then weight and sum": a reduce-scatter of the weighted
P_r. Because the weights lambda^(C (r-1-s)) are known on every rank, all-gathering the W
gradients P_r and weighting them locally gives the same sum with the same number of bytes (W
states of B H Dk Dv per rank), so backward is one all-gather too. dS_loc(s) plays the role of
dS_out in the P2P backward (dk, dv corrections); dq uses the cached S_in as before. Both variants
compute the same numbers up to fp32 summation order. One collective replaces W - 1 dependent
hops; the price is W states received instead of one.

Note [fla-core kernel]
~~~~~~~~~~~~~~~~~~~~~~
On CUDA, with ``fla-core`` installed, ``kernel="auto"`` runs the local chunk with
``fla.ops.simple_gla.chunk_simple_gla(q, k, v, g_gamma=decay_log, scale=1.0, ...)`` (layout
[B, T, H, D]; g_gamma is the per-head log decay; TNL's decay is exactly simple GLA with a
data-independent gate — fla's ``chunk_lightning_attn`` uses another decay). In LASP the kernel
runs with a zero initial state, outside the custom ops, with fla's own autograd Function (it
takes the final-state gradient dS_out as ``dht``); the state exchange is the same op as for the
torch kernel (Note [Two op pairs]). fla's function is ``torch.compiler.disable``d (a graph break
under torch.compile) and its kernels are not dispatcher ops (Selective Checkpoint++ recomputes
them). The branch is kept thin and marked "fla path" below. Tested on 4 x H200 with
fla-core 0.6.0 (``chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None,
initial_state=None, output_final_state=False, ...)``, [B, T, H, D], fp32 final state;
tests/test_lasp_gpu.py compares it with the torch kernel in bf16).

First-call cost: fla's kernels are Triton kernels, compiled and autotuned on their first call for
each (K, V, H) shape; fla's state kernels (``chunk_fwd_kernel_h``, ``chunk_bwd_kernel_dh``) try 48
configurations each, minutes of compilation per shape. Triton caches the compiled kernels and
fla's autotune results on disk, so only the first process pays. ``SEQPAR_FLA_AUTOTUNE=small``
(read at the first fla call; default "full") keeps, in every fla autotuner of more than 8
configurations, those with 4 warps and at most 3 stages (8 of 48): a smaller search for one-shot
GPU runs, the same arithmetic (tile shapes change the fp32 summation order only).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.checks import check_qkv_tensors
from lightning_seqpar.attention.comm import P2P, gather_stacked, process_group

__all__ = [
    "KERNELS",
    "LASP_OPS",
    "LASP_VARIANTS",
    "LinearAttention",
    "lasp_attention",
    "linear_attention",
    "linear_attention_chunked",
    "linear_attention_chunked_backward",
]

Variant = Literal["p2p", "allgather"]
Kernel = Literal["auto", "torch", "fla"]
LASP_VARIANTS: tuple[str, ...] = ("p2p", "allgather")
KERNELS: tuple[str, ...] = ("auto", "torch", "fla")


# ---------------------------------------------------------------------------------------------
# the torch kernel (Note [Linear attention with decay]); fp32 in, fp32 out


def _to_chunks(x: Tensor, c: int) -> Tensor:
    """[B, T, H, D] -> [B, H, N, c, D] in fp32, zero-padded at the end to N * c tokens."""
    B, T, H, D = x.shape
    n = -(-T // c)
    x = x.float().transpose(1, 2)  # (B, H, T, D)
    if n * c != T:
        x = F.pad(x, (0, 0, 0, n * c - T))
    return x.reshape(B, H, n, c, D)


def _from_chunks(x: Tensor, T: int) -> Tensor:
    """[B, H, N, c, D] -> [B, T, H, D] (contiguous)."""
    B, H, n, c, D = x.shape
    return x.reshape(B, H, n * c, D)[:, :, :T].transpose(1, 2).contiguous()


def _chunk_decays(g: Tensor, T: int, c: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decay factors of the chunked form for per-head log decay ``g`` [H] (fp32, <= 0).

    Returns q_decay [H, 1, c, 1] = lambda^(i+1), mask [H, 1, c, c] = lambda^(i-j) (i >= j) else 0,
    k_decay [H, N, c, 1] = lambda^(m_n-1-j) (0 on padding) and chunk_decay [H, N, 1, 1] = lambda^(m_n),
    m_n being the length of chunk n. Exponents are clamped before ``exp`` where the factor is
    masked, so nothing overflows.
    """
    n = -(-T // c)
    g = g.float()
    i = torch.arange(c, device=g.device, dtype=torch.float32)
    lengths = (T - torch.arange(n, device=g.device) * c).clamp(max=c).float()  # (N,)
    q_decay = torch.exp(g[:, None] * (i + 1))[:, None, :, None]  # (H, 1, c, 1)
    diff = i[:, None] - i[None, :]  # (c, c)
    mask = torch.where(diff >= 0, torch.exp(g[:, None, None] * diff.clamp(min=0)), 0.0)[:, None]  # (H, 1, c, c)
    k_exp = lengths[:, None] - 1 - i[None, :]  # (N, c); negative on padding
    k_decay = torch.where(k_exp >= 0, torch.exp(g[:, None, None] * k_exp.clamp(min=0)), 0.0)[..., None]  # (H, N, c, 1)
    chunk_decay = torch.exp(g[:, None] * lengths)[..., None, None]  # (H, N, 1, 1)
    return q_decay, mask, k_decay, chunk_decay


def _chunk_states(kc: Tensor, vc: Tensor, k_decay: Tensor, chunk_decay: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """States entering each chunk [B, H, N, Dk, Dv] and the final state [B, H, Dk, Dv]."""
    local = (kc * k_decay).transpose(-1, -2) @ vc  # (B, H, N, Dk, Dv): each chunk's own contribution
    B, H, n, Dk, Dv = local.shape
    state = local.new_zeros(B, H, Dk, Dv) if initial is None else initial.float()
    entering = []
    for j in range(n):  # the recurrence over chunks: d x d work per chunk
        entering.append(state)
        state = chunk_decay[:, j] * state + local[:, :, j]
    return torch.stack(entering, dim=2), state


def _torch_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk_size: int, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] fp32, final state [B, H, Dk, Dv] fp32); differentiable by autograd."""
    T = q.shape[1]
    qc, kc, vc = _to_chunks(q, chunk_size), _to_chunks(k, chunk_size), _to_chunks(v, chunk_size)
    q_decay, mask, k_decay, chunk_decay = _chunk_decays(g, T, chunk_size)
    entering, final = _chunk_states(kc, vc, k_decay, chunk_decay, initial)
    out = ((qc @ kc.transpose(-1, -2)) * mask) @ vc  # intra  (B, H, N, c, Dv)
    out = out + (qc * q_decay) @ entering  # inter
    return _from_chunks(out, T), final


def _torch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk_size: int, initial: Tensor | None,
                    d_final: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_initial_state), all fp32 (Note [Linear attention with decay])."""
    T = q.shape[1]
    qc, kc, vc, doc = (_to_chunks(x, chunk_size) for x in (q, k, v, do))
    q_decay, mask, k_decay, chunk_decay = _chunk_decays(g, T, chunk_size)
    entering, _ = _chunk_states(kc, vc, k_decay, chunk_decay, initial)  # recomputed locally
    qd = qc * q_decay
    p = qd.transpose(-1, -2) @ doc  # (B, H, N, Dk, Dv): d(state entering chunk) from the inter part
    B, H, n, Dk, Dv = p.shape
    ds = p.new_zeros(B, H, Dk, Dv) if d_final is None else d_final.float()
    after = [ds] * n
    for j in reversed(range(n)):
        after[j] = ds  # gradient of the state after chunk j
        ds = chunk_decay[:, j] * ds + p[:, :, j]
    ds_after = torch.stack(after, dim=2)  # (B, H, N, Dk, Dv)
    d_scores = (doc @ vc.transpose(-1, -2)) * mask  # (B, H, N, c, c)
    kd = kc * k_decay
    dq = d_scores @ kc + (doc @ entering.transpose(-1, -2)) * q_decay
    dk = d_scores.transpose(-1, -2) @ qc + (vc @ ds_after.transpose(-1, -2)) * k_decay
    dv = ((qc @ kc.transpose(-1, -2)) * mask).transpose(-1, -2) @ doc + kd @ ds_after
    return _from_chunks(dq, T), _from_chunks(dk, T), _from_chunks(dv, T), ds


# ---------------------------------------------------------------------------------------------
# fla path (Note [fla-core kernel]); tested on GPU by tests/test_lasp_gpu.py


@functools.cache
def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The LASP kernel ``kernel`` names on ``device``: "auto" is fla where fla-core runs, else torch."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; expected one of {KERNELS}")
    if kernel == "auto":
        return "fla" if device.type == "cuda" and _fla_installed() else "torch"
    if kernel == "fla" and not (device.type == "cuda" and _fla_installed()):
        raise ValueError(
            f"kernel='fla' needs CUDA tensors and the fla-core package (pip install fla-core); got device={device}, "
            f"fla installed={_fla_installed()}; use kernel='torch' or 'auto'"
        )
    return kernel


FLA_AUTOTUNE_MODES: tuple[str, ...] = ("full", "small")


@functools.cache
def _prepare_fla() -> None:
    """Apply ``SEQPAR_FLA_AUTOTUNE`` once, before fla's first kernel call (Note [fla-core kernel])."""
    mode = os.environ.get("SEQPAR_FLA_AUTOTUNE", "full")
    if mode not in FLA_AUTOTUNE_MODES:
        raise ValueError(f"SEQPAR_FLA_AUTOTUNE={mode!r} is not supported; expected one of {FLA_AUTOTUNE_MODES} "
                         "('full': fla's own autotuning; 'small': at most 8 configurations per kernel)")
    if mode == "full":
        return
    import fla.ops.common.chunk_h
    import fla.ops.common.chunk_o
    from triton.runtime.autotuner import Autotuner

    for module in (fla.ops.common.chunk_h, fla.ops.common.chunk_o):
        for kernel in list(vars(module).values()):
            for _ in range(4):  # triton.heuristics(...) wraps the Autotuner in ``.fn``
                if isinstance(kernel, Autotuner) or not hasattr(kernel, "fn"):
                    break
                kernel = kernel.fn
            if isinstance(kernel, Autotuner) and len(kernel.configs) > 8:
                small = [c for c in kernel.configs if c.num_warps == 4 and c.num_stages <= 3]
                if small:
                    kernel.configs = small


def _fla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial: Tensor | None, output_final_state: bool):
    from fla.ops.simple_gla import chunk_simple_gla  # fla path

    _prepare_fla()
    return chunk_simple_gla(q, k, v, g_gamma=g.float(), scale=1.0, initial_state=initial, output_final_state=output_final_state)


def _position_decay(g: Tensor, n: int) -> Tensor:
    """[n, H, 1]: lambda^(t+1), the decay from the start of the block to token t."""
    t = torch.arange(1, n + 1, device=g.device, dtype=torch.float32)
    return torch.exp(t[:, None] * g.float()[None, :])[..., None]


# ---------------------------------------------------------------------------------------------
# LASP state exchange (Note [LASP], Note [All-gather variant])


def _weighted_sum(states: Tensor, g: Tensor, exponents: Tensor) -> Tensor:
    """sum_i lambda^(exponents[i]) states[i] over [n, B, H, Dk, Dv] (zeros when n == 0)."""
    w = torch.exp(exponents.float()[:, None] * g.float()[None, :])  # (n, H)
    return torch.einsum("nh,nbhkv->bhkv", w, states)


def _state_in(s_loc: Tensor, g: Tensor, C: int, variant: str, group: dist.ProcessGroup) -> Tensor:
    """The KV state of all tokens before this rank's chunk (forward of Note [LASP] step 2)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if variant == "allgather":
        gathered = gather_stacked(s_loc, group)
        s = torch.arange(rank, device=g.device)
        return _weighted_sum(gathered[:rank], g, C * (rank - 1 - s))  # ranks s < r, lambda^(C (r-1-s))
    comm = P2P(group)
    s_in = torch.zeros_like(s_loc)
    if rank > 0:
        comm.wait(comm.post([], [(s_in, rank - 1)]))
    if rank < world - 1:
        s_out = torch.exp(g.float() * C)[:, None, None] * s_in + s_loc  # includes the decay over the local chunk
        comm.wait(comm.post([(s_out, rank + 1)], []))
    return s_in


def _state_out_grad(p: Tensor, g: Tensor, C: int, variant: str, group: dist.ProcessGroup) -> Tensor:
    """The gradient of this rank's local state S_loc, from P = d(S_in) of the later ranks
    (backward of Note [LASP] step 4)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if variant == "allgather":
        gathered = gather_stacked(p, group)
        r = torch.arange(rank + 1, world, device=g.device)
        return _weighted_sum(gathered[rank + 1:], g, C * (r - 1 - rank))  # ranks r > s, lambda^(C (r-1-s))
    comm = P2P(group)
    ds_out = torch.zeros_like(p)
    if rank < world - 1:
        comm.wait(comm.post([], [(ds_out, rank + 1)]))
    if rank > 0:
        ds_in = torch.exp(g.float() * C)[:, None, None] * ds_out + p
        comm.wait(comm.post([(ds_in, rank - 1)], []))
    return ds_out


# ---------------------------------------------------------------------------------------------
# custom ops (as seqpar::attn_fwd / attn_bwd, Note [Custom ops] in api.py)
#
# Note [Two op pairs]
# ~~~~~~~~~~~~~~~~~~~
# LASP on one rank is  out = out_local + inter:
#
#     (out_local, S_loc) = seqpar::linear_attn_fwd(q, k, v, decay)     the torch kernel, zero initial state
#                          (or fla's chunk_simple_gla, its own autograd Function)
#     (inter, S_in)      = seqpar::lasp_fwd(q, S_loc, decay)           the state exchange + inter part
#
# Autograd then runs seqpar::lasp_bwd (P = d S_in from dout and q; the state-gradient exchange;
# d S_loc) and hands d out_local = dout and d S_loc to the kernel's backward, which treats d S_loc
# as the gradient of its final state (the dk, dv corrections of Alg. 3 lines 14-15). The kernel
# is kept out of the exchange op so that fla's kernel can run with its own autograd: autograd
# does not record inside a custom op, so fla's backward could not be called from one. Saved for
# backward: q, k, v (kernel) and S_in (the cached KV state), nothing of size T beyond the inputs.


@torch.library.custom_op("seqpar::linear_attn_fwd", mutates_args=())
def _kernel_fwd(q: Tensor, k: Tensor, v: Tensor, decay_log: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    out, state = _torch_forward(q, k, v, decay_log, chunk_size, None)
    return out.to(q.dtype), state


@_kernel_fwd.register_fake
def _(q, k, v, decay_log, chunk_size):
    B, T, H, Dk = q.shape
    return q.new_empty((B, T, H, v.shape[-1])), q.new_empty((B, H, Dk, v.shape[-1]), dtype=torch.float32)


@torch.library.custom_op("seqpar::linear_attn_bwd", mutates_args=())
def _kernel_bwd(dout: Tensor, dstate: Tensor, q: Tensor, k: Tensor, v: Tensor, decay_log: Tensor,
                chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv, _ = _torch_backward(dout.contiguous(), q, k, v, decay_log, chunk_size, None, dstate)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_kernel_bwd.register_fake
def _(dout, dstate, q, k, v, decay_log, chunk_size):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_setup_context(ctx, inputs, output):
    q, k, v, decay_log, chunk_size = inputs
    ctx.save_for_backward(q, k, v, decay_log)
    ctx.chunk_size = chunk_size


def _kernel_backward(ctx, dout, dstate):
    q, k, v, decay_log = ctx.saved_tensors
    dq, dk, dv = torch.ops.seqpar.linear_attn_bwd(dout, dstate, q, k, v, decay_log, ctx.chunk_size)
    return dq, dk, dv, None, None


torch.library.register_autograd("seqpar::linear_attn_fwd", _kernel_backward, setup_context=_kernel_setup_context)


# Note [LASP inter-chunk GEMMs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# inter = (lambda^(t+1) q_t) S_in and its two backward products are batched GEMMs over (B, H)
# in the dtype of q: on bf16/fp16 tensor cores with fp32 accumulation, the state cast to q's
# dtype for the product as fla's own kernels do (``o += q @ h.to(q.dtype)``). The cached S_in
# and the exchanged state gradients stay fp32; only each product's output is rounded once. In
# fp32 (CPU, the reference) everything is fp32. Measured on 4 x H200 (TNL-1B heads, 32K tokens
# per GPU): the fp32 einsums made LASP cost 2.5x the local kernel.


def _bh(x: Tensor) -> Tensor:
    """[B, T, H, D] -> [B, H, T, D] (a view)."""
    return x.transpose(1, 2)


def _decayed_q(q: Tensor, decay_log: Tensor) -> Tensor:
    """lambda^(t+1) q_t in q's dtype, [B, H, T, Dk]."""
    return _bh(q * _position_decay(decay_log, q.shape[1]).to(q.dtype))


@torch.library.custom_op("seqpar::lasp_fwd", mutates_args=())
def _lasp_fwd(q: Tensor, state_local: Tensor, decay_log: Tensor, variant: str, group: str) -> tuple[Tensor, Tensor]:
    s_in = _state_in(state_local.float(), decay_log, q.shape[1], variant, process_group(group))
    inter = torch.matmul(_decayed_q(q, decay_log), s_in.to(q.dtype))  # [B, H, T, Dv] (Note [LASP inter-chunk GEMMs])
    return _bh(inter).contiguous(), s_in.contiguous()  # contiguous, as the fake implementation promises


@_lasp_fwd.register_fake
def _(q, state_local, decay_log, variant, group):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, state_local.shape[-1])), state_local.new_empty(state_local.shape, dtype=torch.float32)


@torch.library.custom_op("seqpar::lasp_bwd", mutates_args=())
def _lasp_bwd(dinter: Tensor, q: Tensor, decay_log: Tensor, state_in: Tensor, variant: str, group: str) -> tuple[Tensor, Tensor]:
    e = _position_decay(decay_log, q.shape[1]).to(q.dtype)  # (C, H, 1)
    dinter = _bh(dinter.to(q.dtype))
    dq = _bh(torch.matmul(dinter, state_in.to(q.dtype).transpose(-1, -2))) * e  # from the cached state: no communication
    p = torch.matmul(_decayed_q(q, decay_log).transpose(-1, -2), dinter).float()  # d S_in [B, H, Dk, Dv]
    ds_local = _state_out_grad(p, decay_log, q.shape[1], variant, process_group(group))
    return dq.to(q.dtype).contiguous(), ds_local.contiguous()


@_lasp_bwd.register_fake
def _(dinter, q, decay_log, state_in, variant, group):
    return q.new_empty(q.shape), state_in.new_empty(state_in.shape)


def _lasp_setup_context(ctx, inputs, output):
    q, state_local, decay_log, variant, group = inputs
    _, state_in = output
    ctx.save_for_backward(q, decay_log, state_in)  # state_in: the cached KV state (LASP §2.4)
    ctx.args = (variant, group)
    ctx.state_dtype = state_local.dtype
    ctx.mark_non_differentiable(state_in)


def _lasp_backward(ctx, dinter, _dstate_in):
    q, decay_log, state_in = ctx.saved_tensors
    dq, ds_local = torch.ops.seqpar.lasp_bwd(dinter, q, decay_log, state_in, *ctx.args)
    return dq, ds_local.to(ctx.state_dtype), None, None, None


torch.library.register_autograd("seqpar::lasp_fwd", _lasp_backward, setup_context=_lasp_setup_context)

#: Ops whose outputs Selective Checkpoint++ must keep, so that recomputing a block neither runs
#: the linear-attention kernel again nor repeats LASP's communication: the kernel (out_local,
#: S_loc) and the exchange (inter, cached S_in).
LASP_OPS = (torch.ops.seqpar.linear_attn_fwd.default, torch.ops.seqpar.lasp_fwd.default)


def _local_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk_size: int, kernel: str) -> tuple[Tensor, Tensor]:
    """(out_local in q's dtype, S_loc fp32) with a zero initial state; differentiable."""
    if kernel == "fla":  # fla path: fla's own autograd Function (Note [fla-core kernel])
        out, state = _fla_chunk(q, k, v, g, None, True)
        return out, state.float()
    return torch.ops.seqpar.linear_attn_fwd(q, k, v, g, chunk_size)


# ---------------------------------------------------------------------------------------------
# validation: from local metadata only, before any collective


def _check_inputs(q, k, v, decay_log) -> None:
    check_qkv_tensors(q, k, v)
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, Dk] (one key head per query head); got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must match q in batch, sequence length and heads [B, T, H, Dv]; got q={tuple(q.shape)}, v={tuple(v.shape)}")
    if not isinstance(decay_log, Tensor) or not decay_log.is_floating_point():
        raise ValueError(f"decay_log must be a floating-point tensor of shape [H] (the log of each head's decay, <= 0), "
                         f"got {type(decay_log).__name__}{'' if not isinstance(decay_log, Tensor) else f' of dtype {decay_log.dtype}'}")
    if decay_log.shape != (q.shape[2],):
        raise ValueError(f"decay_log must have shape [H] = ({q.shape[2]},) (one log decay per head), got {tuple(decay_log.shape)}")
    if decay_log.device != q.device:
        raise ValueError(f"decay_log must be on the device of q ({q.device}), got {decay_log.device}")
    if decay_log.requires_grad and torch.is_grad_enabled():
        raise ValueError("decay_log must not require grad: the decay is a constant of the model (TNL) and gets no gradient; "
                         "pass decay_log.detach() or build it without autograd")


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"LASP needs a 1-D mesh of the sequence-parallel ranks; got mesh with ndim={mesh.ndim}, "
                         f"names={tuple(mesh.mesh_dim_names or ())} (head parallelism does not apply to LASP)")


def _check_options(variant, layout) -> None:
    if variant not in LASP_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; expected one of {LASP_VARIANTS}")
    if layout != "contiguous":
        raise ValueError(f"LASP needs layout='contiguous' (rank r holds the r-th of W contiguous chunks, LASP Alg. 1); "
                         f"got layout={layout!r}; shard with lightning_seqpar.sharding.shard_sequence(..., layout='contiguous')")


# ---------------------------------------------------------------------------------------------
# public functions


def linear_attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay_log: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    kernel: Kernel = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Causal linear attention with per-head decay on one device (Note [Linear attention with decay]).

    Args:
        q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``.
        decay_log: ``[H]``, log of each head's decay (<= 0; not checked, reading it would synchronise
            a GPU). A constant: it gets no gradient and must not require one.
        chunk_size: chunk length of the torch kernel (any T; the last chunk may be short).
        initial_state: ``[B, H, Dk, Dv]`` state of the tokens before this block (fp32), or None (zero).
        output_final_state: also return the state after the last token.
        kernel: "torch" (pure torch, fp32), "fla" (``fla-core``'s ``chunk_simple_gla``, CUDA;
            tested against the torch kernel in bf16 on H200) or "auto" (fla on CUDA when installed, else torch).

    Returns:
        ``(out [B, T, H, Dv] in q's dtype, final_state [B, H, Dk, Dv] fp32 or None)``;
        differentiable in q, k, v and initial_state (by autograd through the torch ops).
    """
    _check_inputs(q, k, v, decay_log)
    _check_chunk_size(chunk_size)
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != want or not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be a floating-point tensor of shape [B, H, Dk, Dv] = {want}, got "
                             f"{tuple(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__}")
    if resolve_kernel(kernel, q.device) == "fla":  # fla path
        out, final = _fla_chunk(q, k, v, decay_log.detach(), initial_state, output_final_state)
        return out, (final.float() if output_final_state else None)
    out, final = _torch_forward(q, k, v, decay_log.detach(), chunk_size, initial_state)
    return out.to(q.dtype), (final if output_final_state else None)


def linear_attention_chunked_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay_log: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    d_final_state: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Explicit backward of :func:`linear_attention_chunked` (torch kernel): ``(dq, dk, dv,
    d_initial_state)`` for the upstream gradients ``dout`` [B, T, H, Dv] and ``d_final_state``
    [B, H, Dk, Dv] (None: zero). dq, dk, dv in the input dtypes; d_initial_state fp32."""
    _check_inputs(q, k, v, decay_log)
    _check_chunk_size(chunk_size)
    dq, dk, dv, d_init = _torch_backward(dout, q, k, v, decay_log.detach(), chunk_size, initial_state, d_final_state)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_init


def linear_attention(q: Tensor, k: Tensor, v: Tensor, decay_log: Tensor, *, chunk_size: int = 64,
                     kernel: Kernel = "auto") -> Tensor:
    """Causal linear attention with decay of a whole sequence on one device, through the custom op
    (explicit backward, one opaque node for torch.compile). Shapes as :func:`linear_attention_chunked`."""
    _check_inputs(q, k, v, decay_log)
    _check_chunk_size(chunk_size)
    return _local_chunk(q, k, v, decay_log.detach(), chunk_size, resolve_kernel(kernel, q.device))[0]


def lasp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay_log: Tensor,
    *,
    mesh: DeviceMesh,
    variant: Variant = "p2p",
    layout: Literal["contiguous"] = "contiguous",
    chunk_size: int = 64,
    kernel: Kernel = "auto",
) -> Tensor:
    """Linear attention with decay over sequence shards: LASP (Note [LASP]).

    The same result as :func:`linear_attention` on the full sequence, sharded the same way.

    Args:
        q, k: ``[B, T_local, H, Dk]``, v: ``[B, T_local, H, Dv]`` — this rank's contiguous shard
            (``shard_sequence(x, mesh, dim=1, layout="contiguous")``); equal T_local on all ranks.
        decay_log: ``[H]``, log decay per head (<= 0), identical on all ranks; no gradient.
        mesh: the sequence-parallel ranks, 1-D.
        variant: "p2p" (LASP Alg. 2-3: the state hops rank to rank) or "allgather" (one all-gather
            of the W local states, Note [All-gather variant]).
        layout: must be "contiguous".
        chunk_size, kernel: as :func:`linear_attention_chunked`.

    Returns:
        ``[B, T_local, H, Dv]`` in q's dtype; differentiable in q, k, v.

    Raises:
        ValueError: naming the argument, before any communication, for any input it does not take.
    """
    _check_inputs(q, k, v, decay_log)
    _check_chunk_size(chunk_size)
    _check_options(variant, layout)
    _check_mesh(mesh)
    g = decay_log.detach()
    out_local, state_local = _local_chunk(q, k, v, g, chunk_size, resolve_kernel(kernel, q.device))
    if mesh.size() == 1:
        return out_local
    inter, _ = torch.ops.seqpar.lasp_fwd(q, state_local, g, variant, mesh.get_group().group_name)
    return out_local + inter


class LinearAttention(nn.Module):
    """Causal linear attention with per-head decay that a model calls; local until configured.

    ``forward(q, k, v, decay_log)`` takes ``[B, S, H, Dk]``, ``[B, S, H, Dk]``, ``[B, S, H, Dv]``
    and ``[H]`` and returns ``[B, S, H, Dv]``. :meth:`configure` (the strategy's call) switches it to
    LASP over a 1-D mesh; the module has no parameters and holds no global state.
    """

    def __init__(self, *, chunk_size: int = 64, kernel: Kernel = "auto") -> None:
        super().__init__()
        _check_chunk_size(chunk_size)
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} is not supported; expected one of {KERNELS}")
        self.chunk_size = chunk_size
        self.kernel: str = kernel
        self.mesh: DeviceMesh | None = None
        self.algorithm: str = "lasp"
        self.variant: str = "p2p"
        self.layout: str = "contiguous"

    def configure(self, *, mesh: DeviceMesh | None, algorithm: Literal["lasp"] = "lasp", variant: Variant = "p2p",
                  layout: str = "contiguous", chunk_size: int | None = None, kernel: Kernel | None = None) -> None:
        """Run LASP over ``mesh`` (None or one rank: back to local linear attention)."""
        if algorithm != "lasp":
            raise ValueError(f"algorithm={algorithm!r} is not supported by LinearAttention; expected 'lasp'")
        _check_options(variant, layout)
        if mesh is not None:
            _check_mesh(mesh)
        if chunk_size is not None:
            _check_chunk_size(chunk_size)
            self.chunk_size = chunk_size
        if kernel is not None:
            if kernel not in KERNELS:
                raise ValueError(f"kernel={kernel!r} is not supported; expected one of {KERNELS}")
            self.kernel = kernel
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.algorithm, self.variant, self.layout = algorithm, variant, layout

    def forward(self, q: Tensor, k: Tensor, v: Tensor, decay_log: Tensor) -> Tensor:
        if self.mesh is None:
            return linear_attention(q, k, v, decay_log, chunk_size=self.chunk_size, kernel=self.kernel)  # type: ignore[arg-type]
        return lasp_attention(q, k, v, decay_log, mesh=self.mesh, variant=self.variant, layout="contiguous",  # type: ignore[arg-type]
                              chunk_size=self.chunk_size, kernel=self.kernel)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        where = "local" if self.mesh is None else f"lasp, variant={self.variant}, mesh={tuple(self.mesh.shape)}"
        return f"chunk_size={self.chunk_size}, kernel={self.kernel}, {where}"
