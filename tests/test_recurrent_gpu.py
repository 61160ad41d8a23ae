"""fla-core's kernels (``chunk_gated_delta_rule``, ``chunk_simple_gla``) against the torch kernels of
lightning_seqpar/attention/recurrent/chunked.py on one GPU, fp32 inputs, with an initial state in and the
final state's gradient (the hand-off of the state chain); skipped without CUDA and fla-core.

    pip install fla-core-*.whl   (no internet on the GPU machine: carry the wheel)
    pytest -s tests/test_recurrent_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_seqpar.attention.recurrent import gated_delta_rule_chunked, ssd_scan_chunked

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (pip install fla-core)")]


def _run(fn, inputs, dout, dstate):
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, state = fn(*leaves)
    torch.autograd.backward([out, state], [dout, dstate])
    return [out.detach(), state.detach(), *(x.grad for x in leaves)]


def _fla_refused() -> str | None:
    from lightning_seqpar.attention.recurrent.chunked import fla_unusable

    return fla_unusable(torch.cuda.current_device()) if torch.cuda.is_available() else "needs CUDA"


@pytest.mark.skipif(_fla_refused() is not None, reason=f"fla-core does not run here: {_fla_refused()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["delta", "ssd"])
def test_fla_kernels_match_torch(which, dtype):
    """fp32: both kernels on the same fp32 inputs (fla-core's TF32 / fp32 accumulation against torch fp32): < 2e-3.
    bf16: q, k, v in bf16 (as a bf16 model passes them; the torch kernels compute in fp32 from them, fla-core's
    matmuls take bf16): < 2e-2."""
    torch.manual_seed(0)
    B, T, H, Dk, Dv = 2, 1024, 4, 64, 64
    dev = "cuda"
    q = (torch.nn.functional.normalize(torch.randn(B, T, H, Dk, device=dev), dim=-1) * Dk ** -0.5).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, Dk, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, Dv, device=dev).to(dtype)
    g = -torch.rand(B, T, H, device=dev) * 0.1
    beta = torch.rand(B, T, H, device=dev)
    s0 = torch.randn(B, H, Dk, Dv, device=dev) * 0.1
    dout, dstate = torch.randn(B, T, H, Dv, device=dev), torch.randn(B, H, Dk, Dv, device=dev)
    if which == "delta":
        inputs = [q, k, v, g, beta, s0]
        call = lambda kernel: lambda q, k, v, g, b, s: gated_delta_rule_chunked(q, k, v, g, b, initial_state=s, kernel=kernel)  # noqa: E731
    else:
        inputs = [q, k, v, g, s0]
        call = lambda kernel: lambda q, k, v, g, s: ssd_scan_chunked(q, k, v, g, initial_state=s, kernel=kernel)  # noqa: E731
    ref = _run(call("torch"), inputs, dout, dstate)
    got = _run(call("fla"), inputs, dout, dstate)
    names = ["out", "state", "dq", "dk", "dv", "dg", *(["dbeta"] if which == "delta" else []), "dstate0"]
    bound = 2e-3 if dtype == torch.float32 else 2e-2
    for name, a, r in zip(names, got, ref):
        err = ((a.float() - r.float()).norm() / r.float().norm()).item()
        print(f"[recurrent-gpu] {which} {str(dtype)[6:]} {name}: rel. L2 error {err:.2e}")
        assert err < bound, f"{which} {dtype} {name}: relative L2 error {err:.2e} (fla-core against the torch kernels)"
