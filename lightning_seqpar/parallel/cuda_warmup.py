"""Creating the backward pass's GPU library handles before the first step.

Note [Library handles of the backward thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Autograd runs a GPU's backward ops on a worker thread of its own, and cuBLAS / cuBLASLt (and
cuDNN) handles are per thread: the first backward creates that thread's handles, and the
libraries take their device memory straight from the driver (``cudaMalloc``), outside PyTorch's
caching allocator. At the longest contexts the first backward starts right after the forward,
when the allocator has reserved nearly the whole card: PyTorch frees its cached blocks and
retries when one of *its* allocations fails, but nothing does that for a library's, and the step
ends in ``CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)`` (llama-7b at 1M tokens
on 4 H200, docs/benchmarks.md) with memory to spare inside the allocator.
:func:`warm_up_backward_handles` runs a tiny forward + backward of the kinds of ops a transformer's
backward calls (fp32 and bf16 matmuls, a matmul with bias for cuBLASLt, and cuDNN's attention when
it runs here) before the first step, while the card is still empty, so that the handles exist and
are reused by every later backward. It keeps no tensors of its own; what stays is what a first
step would create anyway: the handles, and their cuBLAS workspaces (tens of MiB, which PyTorch
allocates from its caching allocator and keeps per handle and stream).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

__all__ = ["warm_up_backward_handles"]


def warm_up_backward_handles(device: torch.device) -> bool:
    """Create this process's backward-thread cuBLAS / cuBLASLt / cuDNN handles on ``device`` now
    (Note [Library handles of the backward thread]); a no-op (False) off CUDA."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
            bias = torch.zeros(16, device=device, dtype=dtype, requires_grad=True)
            (F.linear(a, a, bias).sum() + (a @ a).sum()).backward()  # cuBLASLt (addmm + bias) and cuBLAS (mm)
        q = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        try:  # cuDNN's fused attention, where this build and GPU have it
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        except RuntimeError:
            pass
        torch.cuda.synchronize(device)
    return True
