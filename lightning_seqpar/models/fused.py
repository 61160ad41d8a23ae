"""Fused element-wise kernels for the package's models: RMSNorm, RoPE and SwiGLU, one kernel each way.

Note [Fused element-wise kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Written in torch ops, as Hugging Face writes them, each of these is several memory-bound kernels over
(S, d)-sized tensors, in fp32 where they upcast: an RMSNorm's forward is six passes (the fp32 copy, the
square, the mean, the scale, the cast, the weight), RoPE's eight over q and k, SwiGLU's two over the
I-wide gate and up, and their backwards more. At long lengths on several GPUs the step is attention and
the matmuls, but not only: profiled on 4 x H200, Llama-3-8B at 128K under Ulysses with flash-attention 4
(session -8 in docs/benchmarks.md), ~1.0 s of a 10.3 s step was element-wise kernels (``aten::mul``
0.44 s, ``aten::copy_`` 0.39 s), against 8.6 s for the step's physical bound.

On a CUDA device with Liger Kernel installed (``pip install lightning-seqpar[gpu]``; a well-kept library of
Triton kernels for exactly these layers) the package's models run them as one Triton kernel each way:

    rms_norm    liger's RMSNorm, casting mode "llama": the mean square and the scale in fp32, the
                normalised row cast to the input's dtype, then times the weight (Hugging Face's order)
    rope        liger's RoPE kernel over q and k at once (rotate-half, fp32 products), on copies: its
                kernel rotates in place, and the projections' outputs may be kept elsewhere (a
                checkpoint that saves matmul outputs)
    silu_mul    liger's SwiGLU: silu in fp32, cast, times up (torch's eager rounding); its backward
                writes the two gradients over the saved gate and up, which nothing reads afterwards

Each computes the same formula in the same precision as the torch path, so results agree to the last
bf16 rounding, not bitwise (a row's sum runs in another order): the distributed runs and their
single-device references take the same path, so exactness tests compare like with like. The torch path
runs on the CPU, inside ``torch.compile`` (which fuses these itself), where the weight's dtype differs from
the input's (liger multiplies in the input's dtype; torch promotes), and with SEQPAR_FUSED_KERNELS=0 (for
comparisons on one machine).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

__all__ = ["fused_kernels_available", "fused_kernels_on", "rms_norm", "rope", "silu_mul", "use_fused"]


@functools.cache
def fused_kernels_available() -> bool:
    """Liger Kernel (and so Triton) is importable."""
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def fused_kernels_on() -> bool:
    """The fused kernels are installed and not turned off (SEQPAR_FUSED_KERNELS=0): on a CUDA device the package's
    models run them (what the memory planner counts)."""
    return os.environ.get("SEQPAR_FUSED_KERNELS", "1") != "0" and fused_kernels_available()


def use_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``x`` (Note [Fused element-wise kernels])."""
    return x.is_cuda and not torch.compiler.is_compiling() and fused_kernels_on()


# --- the torch path: the reference, and what runs on the CPU ---------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_torch(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    cos, sin = freqs_cis.real, freqs_cis.imag  # (B, S, 1, D/2)
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, S, H, D/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # (B, S, H, D)


# --- the entry points ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, normalised in fp32; x (..., d)."""
    if use_fused(x) and weight.dtype == x.dtype:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
    return rms_norm_torch(x, weight, eps)


class _Rope(torch.autograd.Function):
    """liger's RoPE kernel, out of place: q, k (B, S, H, D) contiguous; cos, sin (B, S, D/2) fp32."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from liger_kernel.ops.rope import rope_forward

        D = q.shape[-1]
        q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
        q, k, cos, sin = rope_forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin, rotary_dim=D)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        from liger_kernel.ops.rope import rope_backward

        cos, sin = ctx.saved_tensors
        D = dq.shape[-1]
        dq, dk = dq.clone(memory_format=torch.contiguous_format), dk.clone(memory_format=torch.contiguous_format)
        dq, dk = rope_backward(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin, rotary_dim=D)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def rope(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, S, H, D) and k (B, S, H_kv, D) rotated by ``freqs_cis`` (B, S, 1, D/2) complex64, in fp32, in Hugging
    Face Llama's rotate-half convention (``lightning_seqpar.models.llama.rope_freqs_cis``)."""
    if use_fused(q) and q.dtype == k.dtype and q.shape[:2] == freqs_cis.shape[:2] and q.dim() == 4:
        cos, sin = freqs_cis.real[:, :, 0], freqs_cis.imag[:, :, 0]  # (B, S, D/2), strided views
        return _Rope.apply(q, k, cos.contiguous(), sin.contiguous())
    return rope_torch(q, freqs_cis), rope_torch(k, freqs_cis)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU's product); gate, up (..., I)."""
    if use_fused(gate) and gate.dtype == up.dtype and gate.shape == up.shape:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply(gate, up)
    return F.silu(gate) * up
