"""Token cross-entropy sums, the chunked head, and the global-count mean (single process and gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from lightning_seqpar.loss import IGNORE_INDEX, chunked_cross_entropy_sum, global_mean_loss, token_cross_entropy_sum


def _data(B=2, S=10, d=16, V=50, seed=0, n_ignored=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, d, generator=g)
    weight = torch.randn(V, d, generator=g) * 0.5
    labels = torch.randint(0, V, (B, S), generator=g)
    labels.view(-1)[torch.randperm(B * S, generator=g)[:n_ignored]] = IGNORE_INDEX
    return hidden, weight, labels


def test_ignore_index_value():
    assert IGNORE_INDEX == -100


def test_token_cross_entropy_sum():
    hidden, weight, labels = _data()
    logits = hidden @ weight.T
    loss_sum, n = token_cross_entropy_sum(logits, labels)
    valid = labels != IGNORE_INDEX
    ref = -(logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid).sum()
    torch.testing.assert_close(loss_sum, ref, atol=1e-5, rtol=1e-6)
    assert n.dtype == torch.int64 and n.item() == 15
    # bf16 logits give an fp32 loss, computed from the upcast logits.
    loss_bf16, _ = token_cross_entropy_sum(logits.bfloat16(), labels)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, token_cross_entropy_sum(logits.bfloat16().float(), labels)[0])
    with pytest.raises(ValueError, match="logits .* and labels .* disagree"):
        token_cross_entropy_sum(logits[:, :-1], labels)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 20, 4096])
@pytest.mark.parametrize("n_ignored", [0, 5])
def test_chunked_equals_full_values_and_grads(chunk_size, n_ignored):
    hidden, weight, labels = _data(n_ignored=n_ignored)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, n_ref = token_cross_entropy_sum(h_ref @ w_ref.T, labels)
    (2.5 * ref).backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out, n = chunked_cross_entropy_sum(h, w, labels, chunk_size=chunk_size)
    (2.5 * out).backward()
    assert out.dtype == torch.float32 and n.dtype == torch.int64 and n == n_ref
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [3, 4096])
def test_chunked_softcap_equals_capped_logits(chunk_size):
    """Gemma 2's final_logit_softcapping c: logits c * tanh(z / c), values and gradients."""
    hidden, weight, labels = _data(n_ignored=5)
    h_ref, w_ref = (3 * hidden).requires_grad_(), weight.clone().requires_grad_()
    z = h_ref @ w_ref.T
    ref, _ = token_cross_entropy_sum(2.0 * torch.tanh(z / 2.0), labels)
    ref.backward()
    h, w = (3 * hidden).requires_grad_(), weight.clone().requires_grad_()
    out, _ = chunked_cross_entropy_sum(h, w, labels, chunk_size=chunk_size, softcap=2.0)
    out.backward()
    uncapped, _ = chunked_cross_entropy_sum(3 * hidden, weight, labels, chunk_size=chunk_size)
    assert not torch.allclose(out, uncapped)  # the cap bites on these logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap must be None or a number > 0"):
        chunked_cross_entropy_sum(hidden, weight, labels, softcap=0.0)


def test_chunked_partial_grads_no_grad_and_all_ignored():
    hidden, weight, labels = _data()
    ref, _ = token_cross_entropy_sum(hidden @ weight.T, labels)
    with torch.no_grad():
        out, _ = chunked_cross_entropy_sum(hidden.requires_grad_(), weight, labels, chunk_size=4)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # Frozen head: only the hidden gradient.
    h = hidden.detach().clone().requires_grad_()
    out, _ = chunked_cross_entropy_sum(h, weight, labels, chunk_size=4)
    out.backward()
    assert h.grad is not None and weight.grad is None
    # Nothing valid: zero loss, zero (not NaN) gradients.
    h, w = hidden.detach().clone().requires_grad_(), weight.clone().requires_grad_()
    out, n = chunked_cross_entropy_sum(h, w, torch.full_like(labels, IGNORE_INDEX), chunk_size=4)
    out.backward()
    assert out.item() == 0 and n.item() == 0
    assert not h.grad.any() and not w.grad.any()


def test_chunked_bf16():
    hidden, weight, labels = _data()
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    out, _ = chunked_cross_entropy_sum(h, w, labels, chunk_size=3)
    out.backward()
    assert out.dtype == torch.float32 and h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    h_ref, w_ref = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    ref, _ = token_cross_entropy_sum(h_ref @ w_ref.T, labels)
    ref.backward()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=2e-2, rtol=2e-2)


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest number of rows of any (rows, V) tensor an op produces."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size, self.max_rows = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab_size:
                self.max_rows = max(self.max_rows, t.numel() // self.vocab_size)
        return out


def test_chunked_never_materialises_more_than_chunk_size_logits():
    # 64 tokens; d = 4 < chunk_size so that the (d, V) view weight.T does not count as logits.
    hidden, weight, labels = _data(B=2, S=32, d=4, V=97)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with _LargestVocabTensor(97) as mode:
        out, _ = chunked_cross_entropy_sum(h, w, labels, chunk_size=5)
        out.backward()
    assert 0 < mode.max_rows <= 5
    with _LargestVocabTensor(97) as mode:  # the check itself sees full logits
        token_cross_entropy_sum(h @ w.T, labels)[0].backward()
    assert mode.max_rows == 64


def test_chunked_bad_args():
    hidden, weight, labels = _data()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        chunked_cross_entropy_sum(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="hidden .* and labels .* disagree"):
        chunked_cross_entropy_sum(hidden, weight, labels[:, 1:])


def test_global_mean_loss_single_process():
    hidden, weight, labels = _data()
    logits = (hidden @ weight.T).requires_grad_()
    loss = global_mean_loss(*token_cross_entropy_sum(logits, labels))
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 50), labels.view(-1)))
    # Zero valid tokens: 0 with a (zero) gradient, not NaN.
    loss = global_mean_loss(*token_cross_entropy_sum(logits, torch.full_like(labels, IGNORE_INDEX)))
    loss.backward()
    assert loss.item() == 0 and loss.requires_grad and not logits.grad.any()
    with pytest.raises(ValueError, match="n_valid must be a scalar"):
        global_mean_loss(loss, torch.tensor([1, 2]))


def _dist_global_mean(rank: int, world_size: int) -> list[float]:
    """Two ranks hold unequal shares of one sequence ("uneven": 9 + 7 tokens; "no valid": rank 0's
    4 tokens are all ignored). The sum of their losses is the single-process mean loss of the
    whole sequence and their gradients are slices of its gradient, with a process group or a mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
    hidden, weight, labels = _data(B=1, S=16, n_ignored=6, seed=3)
    no_valid = labels.clone()
    no_valid[0, :4] = IGNORE_INDEX
    results = []
    for sizes, case_labels in (([9, 7], labels), ([4, 12], no_valid)):
        full_logits = (hidden @ weight.T).requires_grad_()
        ref = F.cross_entropy(full_logits.view(-1, 50), case_labels.view(-1), ignore_index=IGNORE_INDEX)
        ref.backward()
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        for group in (dist.group.WORLD, mesh):
            logits = full_logits.detach()[:, lo:hi].clone().requires_grad_()
            loss = global_mean_loss(*token_cross_entropy_sum(logits, case_labels[:, lo:hi]), group)
            loss.backward()
            reported = loss.detach().clone()
            dist.all_reduce(reported)  # the reported loss: sum of the shares
            torch.testing.assert_close(reported, ref.detach(), atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(logits.grad, full_logits.grad[:, lo:hi], atol=2e-6, rtol=1e-5)
            assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
            results.append(loss.item())
    return results


def test_global_mean_loss_two_ranks():
    per_rank = run_distributed(_dist_global_mean, 2)
    assert per_rank[0][2] == per_rank[0][3] == 0.0  # a rank without valid labels adds 0, not NaN
    for i in range(4):
        assert per_rank[0][i] + per_rank[1][i] > 0
