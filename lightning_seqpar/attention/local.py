"""One block of attention on one device, returning the log-sum-exp.

Every distributed algorithm is built from two calls:

    block_forward(q, k, v, causal, scale, backend)            -> out [B, Sq, Hq, D], lse [B, Hq, Sq] (fp32)
    block_backward(dout, q, k, v, out, lse, causal, scale, backend) -> dq, dk, dv

``out`` and ``lse`` given to the backward are the *final* (merged) ones: the backward kernels
rebuild P = exp(q k^T * scale - lse) from them, which is the exact softmax of the whole row even
when this block saw only part of the keys. So the forward is never run again in backward.

Tensors are [B, S, H, D] ("BSHD") throughout; the SDPA kernels take [B, H, S, D] views of them
(a transpose, no copy). GQA: the pure-torch path groups query heads over the shared K/V head; the
fused kernels get K/V heads repeated locally, after communication, when the kernel needs it
(K/V are never repeated before they travel). ``causal`` means the top-left aligned mask of a
square block (Sq == Sk): the diagonal blocks of a causal sequence.

Backends:
    "cudnn"      torch SDPA cuDNN kernels (bf16/fp16, Hopper+; fast, but see Note [Choosing the
                 local kernel]: only when asked for by name)
    "flash"      torch SDPA flash-attention-2 kernels (bf16/fp16, CUDA)
    "efficient"  torch SDPA memory-efficient kernels (CUDA, also fp32)
    "math"       pure torch, fp32 accumulation; CPU, and the reference
    "fa4"        flash-attention 4 (Dao-AILab ``flash-attn-4``, CuTe DSL) on Hopper / Blackwell,
                 bf16/fp16, head dims 8..256 (multiples of 8); native GQA, returns the LSE
    "auto"       the fastest of the kernels whose gradients are as exact as torch SDPA's for the
                 device, dtype and head dim: fa4 when installed, else flash (Note [Choosing the
                 local kernel])

Note [Choosing the local kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every distributed algorithm spends most of its time in these two calls, so the local kernel sets
the ceiling. Measured on one H200 (bf16, causal fwd+bwd, H = 32, D = 128, 8K-128K): flash-attn 4
603-623 TFLOP/s, cuDNN SDPA 530-546, torch's flash-attention-2 ~320 (one H100, D = 128, 8K-32K:
cuDNN 499-555, flash-attention-2 275-302). FA4 is an optional dependency (``pip install
flash-attn-4``); without it "auto" is flash-attention-2, not cuDNN, although cuDNN is faster:
cuDNN's BACKWARD kernel (torch 2.11, cuDNN 9 on an H100, bf16) gives the attention layers of
models with partial rotary embeddings gradients far less exact than every other kernel. Measured
on one H100 (Qwen3-Next-shaped and Bamba-shaped transformers models, S = 4096, bf16 autocast,
against the same model in fp32): q_norm / q_proj / k_proj gradients 0.37-0.45 from fp32 with
cuDNN, 0.013-0.017 with flash-attention-2, FA4, the memory-efficient kernel and the pure-torch
one, and 0.012-0.024 for transformers' own SDPA run; cuDNN's forward with flash-attention-2's
backward is as exact as the others, and Llama / Qwen3 (full rotary) are as exact with cuDNN too.
The same kernel given the captured q, k, v and dout alone is as exact as the others, so the error
is systematic (it adds up over the tokens in the weight gradients), not a large error per
element. A kernel whose gradient is wrong for some models without saying so is not a default for
them: "auto" takes cuDNN only for models that say their rotary embedding is full (the attention
modules' ``cudnn_exact``, set by ``apply_attention`` from the model's ``cudnn_attention_exact``: the
package's Llama, transformers models whose rotary covers the whole head and that have no
recurrent layers), flash-attention-2 for the others (partial rotary, latent attention, no rotary,
hybrids). Measured on one H100 with the Llama-3.2-1B shape at 32K (transformers model, bf16):
flash-attention-2 0.88x the unmodified transformers model, cuDNN 1.07x, FA4 1.18x; so without
FA4 a full-rotary model is no longer slower than plain transformers. ``backend="cudnn"`` forces it
for any model a user has checked. Short calls: flash-attention 4 costs more per call than cuDNN
(its CuTe DSL launch; one H200, Llama-3.2-1B shape on one GPU, 16 layers, no checkpointing, the same
call: 4K tokens 0.16 s per step with FA4 against 0.12 s with cuDNN, about 1.3 ms more per layer's
forward + backward, where the kernels' own work is ~0.5 ms; 32K: 1.07 s against 1.19 s, FA4 ahead).
Measured between (4 x H200 host, one process per GPU, the module's default loss chunks, 12 timed
steps): 4K FA4 28,524 tokens/s against cuDNN 29,555 (0.97x), 8K 39,482 against 37,655 (1.05x), 16K
38,132 against 34,737 (1.10x, 3 steps). So "auto" takes cuDNN below :data:`FA4_MIN_TOKENS` = 8K local
query tokens where cuDNN is exact for the model, FA4 from there on and for every model cuDNN is
not exact for. Every kernel takes the merged (final) lse in backward, as the algorithms need. Varlen
blocks (packed documents) also use FA4 when installed (``cu_seqlens``), else torch's
flash-attention-2 varlen kernel.

Packed documents (``varlen``): the block's rows are flattened over the batch into segments
(cu_seqlens, one per document piece) and a query attends only to the keys of its own segment;
``causal`` is then bottom-right aligned inside each segment (query i of a segment of Lq queries
sees keys j <= i + Lk - Lq), so a suffix of queries can attend to a longer prefix of keys. On
CUDA in bf16/fp16 this is torch's flash-attention-2 varlen kernel (``aten._flash_attention_forward``
with cu_seqlens; native GQA), elsewhere the pure-torch path with the equivalent mask.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch

Backend = Literal["auto", "fa4", "cudnn", "flash", "efficient", "math"]
BACKENDS: tuple[str, ...] = ("auto", "fa4", "cudnn", "flash", "efficient", "math")

aten = torch.ops.aten


@functools.cache
def fa4_interface():
    """flash-attn 4's interface module, or None when it is not installed (or cannot load)."""
    try:
        from flash_attn.cute import interface
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return interface


@torch.compiler.assume_constant_result
def _fa4_installed() -> bool:
    """Whether flash-attn 4 loads; a constant to torch.compile (the backend is chosen inside compiled blocks)."""
    return fa4_interface() is not None


def fa4_supports(head_dim: int, head_dim_v: int | None = None, major: int = 9) -> bool:
    """Head dims flash-attn 4 takes: multiples of 8, in 8..256 on Hopper (``major`` 9), in 8..128 or
    exactly 256 on Blackwell (``major`` 10)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if major == 10:
        return all(d % 8 == 0 and (8 <= d <= 128 or d == 256) for d in (head_dim, dv))
    return all(8 <= d <= 256 and d % 8 == 0 for d in (head_dim, dv))


def available_backends(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> tuple[str, ...]:
    """Concrete backends that can run on ``device`` for ``dtype`` (and ``head_dim``), in the order "auto"
    prefers them: the fastest exact one first (cuDNN after flash-attention-2: Note [Choosing the local kernel])."""
    device = torch.device(device)
    if device.type != "cuda":
        return ("math",)
    out: list[str] = []
    half = dtype in (torch.float16, torch.bfloat16)
    major, _ = torch.cuda.get_device_capability(device)
    if half and major in (9, 10) and (head_dim is None or fa4_supports(head_dim, major=major)) and _fa4_installed():
        out.append("fa4")
    if half and major >= 8:
        out.append("flash")
    if half and major >= 9 and torch.backends.cudnn.is_available():
        out.append("cudnn")
    out.append("efficient")
    out.append("math")
    return tuple(out)


FA4_MIN_TOKENS = 8192
"""``backend="auto"``: below this many local query tokens a call takes cuDNN over flash-attention 4 where cuDNN is exact
for the model (Note [Choosing the local kernel]: flash-attention 4's cost per call)."""


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None, *,
                    cudnn_exact: bool = False, seq_len: int | None = None) -> str:
    """Validate ``backend`` and turn "auto" into a concrete one: the first of :func:`available_backends`, except
    that cuDNN goes before flash-attention-2 when ``cudnn_exact`` says its backward is exact for the model, and
    before flash-attention 4 too for calls of fewer than :data:`FA4_MIN_TOKENS` query tokens (``seq_len``)
    (Note [Choosing the local kernel])."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    avail = available_backends(device, dtype, head_dim)
    if backend == "auto":
        short = seq_len is not None and seq_len < FA4_MIN_TOKENS
        if cudnn_exact and "cudnn" in avail and (avail[0] == "flash" or (avail[0] == "fa4" and short)):
            return "cudnn"
        return avail[0]
    if backend not in avail:
        why = ""
        if backend == "fa4":
            why = (" (fa4 needs `pip install flash-attn-4`, a CUDA device of compute capability 9.x/10.x, bf16/fp16 and a head "
                   "dim in 8..256, a multiple of 8)")
        raise ValueError(
            f"backend={backend!r} cannot run on device={device.type} with dtype={dtype}"
            f"{'' if head_dim is None else f' and head dim {head_dim}'}; available here: {avail}{why}"
        )
    return backend


_LOGGED: set[tuple[str, bool]] = set()  # (kernel, cudnn_exact) pairs already logged by this process


def auto_backends_run() -> list[str]:
    """The kernels ``backend="auto"`` has resolved to in this process so far (as :func:`log_auto_backend` logged them)."""
    return sorted({kernel for kernel, _ in _LOGGED})


def fa4_cuda13_libraries() -> bool:
    """Whether flash-attention 4's CUDA 13 libraries are installed (``nvidia-cutlass-dsl-libs-cu13``, what
    ``flash-attn-4[cu13]`` and the ``gpu-cu13`` extra add)."""
    from importlib import metadata

    try:
        metadata.distribution("nvidia-cutlass-dsl-libs-cu13")
    except metadata.PackageNotFoundError:
        return False
    return True


def auto_backend_message(backend: str, *, cudnn_exact: bool, fa4_installed: bool, seq_len: int | None = None,
                         torch_cuda: str | None = None, fa4_cu13: bool = True) -> str:
    """What ``backend="auto"`` runs and why (Note [Choosing the local kernel]); the install hint of the ``gpu`` extra
    (``gpu-cu13`` under a CUDA 13 torch) only where flash-attention 4 does not load. ``seq_len``: the call's local
    query tokens, None if unknown; ``torch_cuda``: ``torch.version.cuda``; ``fa4_cu13``: :func:`fa4_cuda13_libraries`. Under a CUDA 13 build of
    torch, flash-attention 4 without its CUDA 13 libraries is named: its docs install ``flash-attn-4[cu13]`` there "for
    best performance", and the package's GPU figures (docs/benchmarks.md) ran those libraries."""
    cuda13 = (torch_cuda or "").split(".")[0] == "13"
    if backend == "fa4":
        hint = ""
        if cuda13 and not fa4_cu13:
            hint = (" torch here is built for CUDA 13 and flash-attention 4's CUDA 13 libraries are not installed: "
                    "pip install 'lightning-seqpar[gpu-cu13]' (flash-attn-4[cu13], as its docs advise on CUDA 13; "
                    "the benchmarks ran them).")
        return "attention_backend='auto' runs flash-attention 4, the fastest exact kernel here." + hint
    if backend == "cudnn":
        what = "cuDNN (this model's rotary embedding is full, so its gradients are exact)"
    elif backend == "flash":
        what = "torch's flash-attention-2" + ("" if cudnn_exact else " (cuDNN's backward is not exact for models with "
                                              "partial rotary embeddings or recurrent layers)")
    else:
        what = backend
    if not fa4_installed:
        extra = "gpu-cu13" if cuda13 else "gpu"
        why = (f" Install flash-attention 4, the fastest exact kernel (pip install 'lightning-seqpar[{extra}]'; measured 1.18x "
               "plain transformers at 32K on one H100, Llama-3.2-1B shape).")
    elif backend == "cudnn" and seq_len is not None and seq_len < FA4_MIN_TOKENS:
        why = (f" flash-attention 4 is installed: a call of fewer than {FA4_MIN_TOKENS:,} query tokens "
               f"(as here) costs less with cuDNN, by design; calls from {FA4_MIN_TOKENS:,} tokens run flash-attention 4.")
    else:
        why = " flash-attention 4 is installed but cannot run this call (it needs compute capability 9.x / 10.x, bf16 / fp16, and a head dim it takes)."
    return f"attention_backend='auto' runs {what}.{why} (Note [Choosing the local kernel])"


def log_auto_backend(backend: str, *, cudnn_exact: bool, seq_len: int | None = None) -> None:
    """Say once per process (rank zero) which kernel ``backend="auto"`` runs and why, with the install hint of the
    ``gpu`` extra only where flash-attention 4 does not load (:func:`auto_backend_message`). Logged through
    Lightning's logger ("lightning.pytorch.seqpar"), whose handler a Trainer run shows."""
    key = (backend, cudnn_exact)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    import logging

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    message = auto_backend_message(backend, cudnn_exact=cudnn_exact, fa4_installed=fa4_interface() is not None, seq_len=seq_len,
                                   torch_cuda=torch.version.cuda, fa4_cu13=backend != "fa4" or fa4_cuda13_libraries())
    logging.getLogger("lightning.pytorch.seqpar").info(message)


def acc_dtype(dtype: torch.dtype, device: torch.device | str | None = None) -> torch.dtype:
    """Accumulation dtype of outputs, log-sum-exps and gradients: fp64 for fp64 inputs (gradient
    checks run at fp64 accuracy) and for fp32 inputs on the CPU, fp32 for everything else.

    Note [fp64 accumulation on the CPU]: the math path rebuilds P = exp(s - lse) in backward and
    takes dS = P * (dP - rowsum(dO * O)), a difference of near-equal terms; in fp32, with scores of
    |s| ~ 10 (an explicit scale of ~1, D = 8), that gave dq / dk errors of 2-4e-5, ~10x a plain
    fp32 softmax's, and the ring / all-gather merges added up to ~5x more. In fp64 the blocks and
    merges are exact to fp32 rounding of the result, at a cost only the CPU (tests, CPU recipes) pays."""
    if dtype == torch.float64 or (dtype == torch.float32 and device is not None and torch.device(device).type == "cpu"):
        return torch.float64
    return torch.float32


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, or 1/sqrt(head_dim) for None; a ValueError for anything but a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be None or a finite Python number (a tensor would get no gradient), got {scale!r}")
    return float(scale)


# ---------------------------------------------------------------------------------------------
# pure torch ("math"): the CPU path and the reference. fp32 accumulation, GQA without repeat.


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    acc = acc_dtype(q.dtype, q.device)
    qg = q.to(acc).view(B, Sq, Hkv, Hq // Hkv, D)  # (B, Sq, Hkv, G, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(acc)) * scale  # (B, Hkv, G, Sq, Sk)
    if allowed is not None:  # packed documents: the (Sq, Sk) mask of the segments
        s = s.masked_fill(~allowed, float("-inf"))
    elif causal:
        Sk = k.shape[1]
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0, so exp(s - lse) is 0, not NaN, there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _math_forward(q, k, v, causal: bool, scale: float, allowed: torch.Tensor | None = None):
    B, Sq, Hq, D = q.shape
    s = _scores(q, k, causal, scale, allowed)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq)
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(p.dtype)).reshape(B, Sq, Hq, v.shape[-1])
    return out.to(q.dtype), lse.reshape(B, Hq, Sq)


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, allowed: torch.Tensor | None = None):
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    s = _scores(q, k, causal, scale, allowed)
    lse = lse.reshape(B, Hkv, G, Sq)
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1))  # (B, Hkv, G, Sq, Sk)
    p = p.masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)  # rows with no key anywhere: P = 0
    acc, Dv = p.dtype, v.shape[-1]
    do = dout.to(acc).view(B, Sq, Hkv, G, Dv)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(acc))
    delta = (do * out.to(acc).view(B, Sq, Hkv, G, Dv)).sum(-1).permute(0, 2, 3, 1)  # (B, Hkv, G, Sq)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(acc)).reshape(B, Sq, Hq, D) * scale
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(acc).view(B, Sq, Hkv, G, D)) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# torch SDPA kernels (CUDA). They take [B, H, S, D] views.


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    B, S, H, D = dx.shape
    return dx.view(B, S, H // groups, groups, D).sum(3)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


# cuDNN takes fewer K/V heads than query heads (seen on H100/H200 with torch 2.11); the others need the repeat.
_NATIVE_GQA = ("cudnn",)


def _sdpa_forward(q, k, v, causal: bool, scale: float, backend: str):
    B, Sq, Hq, _ = q.shape
    G = 1 if backend in _NATIVE_GQA else Hq // k.shape[2]
    k, v = _expand_kv(k, G), _expand_kv(v, G)
    if backend == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(_t(q), _t(k), _t(v), None, True, 0.0, causal, False, scale=scale)[:2]
    elif backend == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(_t(q), _t(k), _t(v), 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(_t(q), _t(k), _t(v), None, True, 0.0, causal, scale=scale)[:2]
    lse = lse.reshape(B, Hq, -1)[..., :Sq].to(acc_dtype(q.dtype, q.device))
    return _t(out), lse


def _sdpa_backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str):
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    G = 1 if backend in _NATIVE_GQA else Hq // k.shape[2]
    ke, ve = _expand_kv(k, G), _expand_kv(v, G)
    # The kernels want dout laid out like out.
    out = out.contiguous()
    dout = dout.contiguous().to(out.dtype)
    qt, kt, vt, ot, dot = _t(q), _t(ke), _t(ve), _t(out), _t(dout)
    dev = q.device
    seed = torch.empty((), dtype=torch.int64, device=dev)
    offset = torch.empty((), dtype=torch.int64, device=dev)
    if backend == "cudnn":
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None, Sq, Sk, 0.0, causal, scale=scale
        )
    elif backend == "flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse.contiguous(), None, None, Sq, Sk, 0.0, causal, seed, offset, scale=scale
        )
    else:
        pad = (-Sq) % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)).contiguous() if pad else lse.contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dot, qt, kt, vt, None, ot, lse_p, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
    return _t(dq), _reduce_kv(_t(dk), G), _reduce_kv(_t(dv), G)


# ---------------------------------------------------------------------------------------------
# flash-attn 4 (CuTe DSL): [B, S, H, D] in, native GQA, lse [B, H, S] fp32 (varlen: [H, total])


def _fa4_forward(q, k, v, causal: bool, scale: float, varlen: Varlen | None = None):
    kw = {} if varlen is None else dict(cu_seqlens_q=varlen.cu_q, cu_seqlens_k=varlen.cu_k, max_seqlen_q=varlen.max_q,
                                        max_seqlen_k=varlen.max_k)
    out, lse = fa4_interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, **kw)[:2]
    return out, lse


def _fa4_backward(dout, q, k, v, out, lse, causal: bool, scale: float, varlen: Varlen | None = None):
    kw = {} if varlen is None else dict(cu_seqlens_q=varlen.cu_q, cu_seqlens_k=varlen.cu_k, max_seqlen_q=varlen.max_q,
                                        max_seqlen_k=varlen.max_k)
    dq, dk, dv = fa4_interface()._flash_attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                        dout.contiguous().to(out.dtype), lse.contiguous(), scale, causal, **kw)[:3]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# packed documents: variable-length segments


class Varlen(NamedTuple):
    """Segments of a block, flattened over the batch: queries ``cu_q[i]:cu_q[i+1]`` attend to keys ``cu_k[i]:cu_k[i+1]``."""

    cu_q: torch.Tensor  # int32 [n + 1], on the device of q
    cu_k: torch.Tensor  # int32 [n + 1]
    max_q: int
    max_k: int


def _varlen_allowed(vl: Varlen, causal: bool, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) bool mask of :class:`Varlen` segments (the pure-torch path)."""
    cu_q, cu_k = vl.cu_q.to(device, torch.int64), vl.cu_k.to(device, torch.int64)
    iq, ik = torch.arange(int(cu_q[-1]), device=device), torch.arange(int(cu_k[-1]), device=device)
    sq, sk = torch.searchsorted(cu_q[1:], iq, right=True), torch.searchsorted(cu_k[1:], ik, right=True)
    allowed = sq[:, None] == sk[None, :]
    if causal:  # bottom-right aligned inside each segment
        shift = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
        allowed &= (ik - cu_k[sk])[None, :] <= (iq - cu_q[sq] + shift[sq])[:, None]
    return allowed


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _varlen_uses_math(backend: str, dtype: torch.dtype) -> bool:
    return backend == "math" or dtype not in (torch.float16, torch.bfloat16)


def _varlen_forward(q, k, v, vl: Varlen, causal: bool, scale: float, backend: str):
    B, Sq, Hq, _ = q.shape
    if _varlen_uses_math(backend, q.dtype):
        out, lse = _math_forward(_flat(q)[None], _flat(k)[None], _flat(v)[None], causal, scale, _varlen_allowed(vl, causal, q.device))
        return out.view(B, Sq, Hq, -1), lse.view(Hq, B, Sq).transpose(0, 1)
    if backend == "fa4":
        out, lse = _fa4_forward(_flat(q), _flat(k), _flat(v), causal, scale, vl)
    else:
        out, lse = aten._flash_attention_forward(_flat(q), _flat(k), _flat(v), vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal, False,
                                                 scale=scale)[:2]
    if lse.ndim != 2:
        raise RuntimeError(f"unexpected varlen log-sum-exp shape {tuple(lse.shape)} from the {backend} varlen kernel")
    # rows whose segment has no key: the kernels write lse = +inf (FA2) or -inf; the merge wants -inf and out = 0
    lse = lse.to(acc_dtype(q.dtype, q.device))
    empty = torch.isinf(lse)
    lse = lse.masked_fill(empty, float("-inf"))
    out = out.masked_fill(empty[:, : B * Sq].transpose(0, 1).unsqueeze(-1), 0.0)
    return out.view(B, Sq, Hq, -1), lse[:, : B * Sq].reshape(Hq, B, Sq).transpose(0, 1)


def _varlen_backward(dout, q, k, v, out, lse, vl: Varlen, causal: bool, scale: float, backend: str):
    B, Sq, Hq, _ = q.shape
    lse_flat = lse.transpose(0, 1).reshape(Hq, B * Sq)
    if _varlen_uses_math(backend, q.dtype):
        dq, dk, dv = _math_backward(_flat(dout)[None], _flat(q)[None], _flat(k)[None], _flat(v)[None], _flat(out)[None],
                                    lse_flat[None], causal, scale, _varlen_allowed(vl, causal, q.device))
    elif backend == "fa4":
        dq, dk, dv = _fa4_backward(_flat(dout), _flat(q), _flat(k), _flat(v), _flat(out), lse_flat, causal, scale, vl)
    else:
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        offset = torch.empty((), dtype=torch.int64, device=q.device)
        o = _flat(out).contiguous()
        dq, dk, dv = aten._flash_attention_backward(_flat(dout).contiguous().to(o.dtype), _flat(q), _flat(k), _flat(v), o,
                                                    lse_flat.contiguous(), vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal,
                                                    seed, offset, scale=scale)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# ---------------------------------------------------------------------------------------------


def block_forward(q, k, v, *, causal: bool, scale: float, backend: str, varlen: Varlen | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k``/``v`` (one block): ``(out [B,Sq,Hq,D] in q.dtype, lse [B,Hq,Sq] fp32)``.

    ``varlen``: packed-document segments (module docstring); ``causal`` is then per segment.
    """
    if varlen is not None:
        out, lse = _varlen_forward(q, k, v, varlen, causal, scale, backend)
        return out.to(q.dtype).contiguous(), lse.contiguous()
    assert not causal or q.shape[1] == k.shape[1], "causal blocks are square"
    if backend == "math":
        out, lse = _math_forward(q, k, v, causal, scale)
    elif backend == "fa4":
        out, lse = _fa4_forward(q, k, v, causal, scale)
    else:
        out, lse = _sdpa_forward(q, k, v, causal, scale, backend)
    return out.contiguous(), lse.contiguous()


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, backend: str, varlen: Varlen | None = None):
    """Gradients of one block given the final ``out`` and ``lse`` of the rows of ``q``.

    Returns ``(dq, dk, dv)``; the pure-torch path returns fp32, the kernels the input dtype.
    """
    if varlen is not None:
        return _varlen_backward(dout, q, k, v, out, lse, varlen, causal, scale, backend)
    assert not causal or q.shape[1] == k.shape[1], "causal blocks are square"
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if backend == "fa4":
        return _fa4_backward(dout, q, k, v, out, lse, causal, scale)
    return _sdpa_backward(dout, q, k, v, out, lse, causal, scale, backend)  # contiguity: see api._attn_bwd
