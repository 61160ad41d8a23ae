"""Note [Merging partial attention]: the online-softmax merge is exact and NaN-safe."""

from __future__ import annotations

import torch

from lightning_seqpar.attention.local import block_backward, block_forward
from lightning_seqpar.attention.merge import merge_, new_accumulators


def test_merge_of_two_key_blocks_equals_one_block():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    full_out, full_lse = block_forward(q, k, v, causal=False, scale=0.3, backend="math")
    out, lse = new_accumulators(q)
    for cols in (slice(0, 7), slice(7, 10)):
        merge_(out, lse, *block_forward(q, k[:, cols], v[:, cols], causal=False, scale=0.3, backend="math"))
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-6)
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
    torch.testing.assert_close(out[:, 1], blk_out[:, 1])
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
