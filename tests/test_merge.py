"""Note [Merging partial attention]: the online-softmax merge is exact and NaN-safe."""

from __future__ import annotations

import torch

from lightning_seqpar.attention.local import acc_dtype, block_backward, block_forward
from lightning_seqpar.attention.merge import merge_, new_accumulators


def test_merge_of_two_key_blocks_equals_one_block():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    full_out, full_lse = block_forward(q, k, v, causal=False, scale=0.3, backend="math")
    out, lse = new_accumulators(q)
    for cols in (slice(0, 7), slice(7, 10)):
        merge_(out, lse, *block_forward(q, k[:, cols], v[:, cols], causal=False, scale=0.3, backend="math"))
    # accumulators in fp64 for fp32 on the CPU (Note [fp64 accumulation on the CPU])
    assert out.dtype == lse.dtype == full_lse.dtype == acc_dtype(q.dtype, q.device) == torch.float64
    torch.testing.assert_close(out.float(), full_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)


def test_rows_that_see_no_key_stay_zero_without_nan():
    out, lse = new_accumulators(torch.zeros(1, 3, 2, 4))
    blk_out = torch.randn(1, 3, 2, 4)
    blk_lse = torch.full((1, 2, 3), float("-inf"))
    blk_lse[:, :, 1] = 0.5  # only row 1 has seen keys
    merge_(out, lse, blk_out, blk_lse)
    merge_(out, lse, torch.randn(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf")))  # -inf merged into -inf
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    torch.testing.assert_close(out[:, 1], blk_out[:, 1].to(out.dtype))
    assert torch.isinf(lse[:, :, 0]).all() and torch.isinf(lse[:, :, 2]).all()


def test_backward_of_a_fully_masked_row_is_zero_not_nan():
    # A causal block whose first query sees only a key that we then hide with lse = -inf:
    # the backward must treat the row as having no keys (P = 0), not produce NaN.
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(1, 4, 2, 8) for _ in range(4))
    out, lse = block_forward(q, k, v, causal=True, scale=0.35, backend="math")
    lse[:, :, 0] = float("-inf")
    out[:, 0] = 0.0
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=True, scale=0.35, backend="math")
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0]))


def test_accumulation_dtype():
    """fp64 for fp64 anywhere and for fp32 on the CPU; fp32 for fp32 elsewhere and for half types."""
    assert acc_dtype(torch.float64) == acc_dtype(torch.float32, "cpu") == acc_dtype(torch.float32, torch.device("cpu")) == torch.float64
    assert acc_dtype(torch.float32) == acc_dtype(torch.float32, "cuda") == acc_dtype(torch.bfloat16, "cpu") == torch.float32
    assert acc_dtype(torch.float16, "cuda:0") == torch.float32


def test_fp32_on_the_cpu_is_exact_to_fp32_rounding_at_a_large_scale():
    """Note [fp64 accumulation on the CPU]: scores of |s| ~ 10 (scale 1.3, D = 8). The rebuilt
    P = exp(s - lse) and dS = P * (dP - rowsum(dO * O)) in fp32 gave dq errors of ~2e-5 here;
    now every output and gradient is within a few fp32 ulps of the fp64 result."""
    gen = torch.Generator().manual_seed(2000054)
    q, k, v, dout = (torch.randn(1, 48, h, 8, generator=gen, dtype=torch.float64) for h in (4, 1, 1, 4))
    ref = block_forward(q, k, v, causal=True, scale=1.3, backend="math")[0]
    ref_grads = block_backward(dout, q, k, v, ref, block_forward(q, k, v, causal=True, scale=1.3, backend="math")[1],
                               causal=True, scale=1.3, backend="math")
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, dout))
    out, lse = block_forward(q32, k32, v32, causal=True, scale=1.3, backend="math")
    assert out.dtype == torch.float32
    grads = block_backward(do32, q32, k32, v32, out, lse, causal=True, scale=1.3, backend="math")
    torch.testing.assert_close(out.double(), ref, atol=2e-7, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=2e-6, rtol=1e-6)
