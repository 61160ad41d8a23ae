"""The head interface (lightning_seqpar.head): a plain head's operands, refusals by name, and a library's adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_seqpar.head import USE_FULL_LOGITS, head_operands, is_plain, is_plain_linear, logits_head


def test_a_plain_head_gives_its_own_weight():
    head = nn.Linear(8, 16, bias=False)
    hidden = torch.randn(2, 3, 8)
    h, w = head_operands(head, hidden)
    assert h is hidden and w is head.weight
    assert logits_head(head, "M") is head


class _Hooked(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # computes with more than its weight
        return super().forward(x) + 1


@pytest.mark.parametrize("head, what", [(nn.Linear(8, 16), "Linear with a bias"), (_Hooked(8, 16, bias=False), "_Hooked"),
                                        (nn.Embedding(16, 8), "Embedding")])
def test_a_head_the_chunked_loss_would_get_wrong_is_refused_by_name(head, what):
    with pytest.raises(ValueError, match=f"^Owner: lm_head is a {what}, not a plain nn.Linear") as error:
        head_operands(head, torch.randn(2, 8), "Owner")
    assert USE_FULL_LOGITS in str(error.value)
    assert not is_plain_linear(head)


def test_is_plain_reads_the_class_forward():
    assert is_plain(nn.Conv1d(2, 2, 3), nn.Conv1d) and not is_plain(_Hooked(2, 2), nn.Linear)


class _Widened(nn.Module):
    """A wrapper that adds a rank-1 term: h W^T + (h a) b^T = [h | h a] @ [W | b]^T."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 16, bias=False)
        self.a = nn.Parameter(torch.randn(8, 1))
        self.b = nn.Parameter(torch.randn(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a) @ self.b.T


class _Adapter:
    def resolve(self, head, owner):
        return head if isinstance(head, _Widened) else None

    def operands(self, layer, hidden):
        return torch.cat([hidden, hidden @ layer.a], dim=-1), torch.cat([layer.base.weight, layer.b], dim=-1)


def test_an_adapter_writes_its_wrapper_as_one_product_and_leaves_plain_heads_alone():
    head, hidden = _Widened(), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="lm_head is a _Widened"):
        head_operands(head, hidden)  # no adapter: refused
    h, w = head_operands(head, hidden, adapters=(_Adapter(),))
    torch.testing.assert_close(h @ w.T, head(hidden))
    assert logits_head(head, "M", adapters=(_Adapter(),)) is head
    plain = nn.Linear(8, 16, bias=False)
    h, w = head_operands(plain, hidden, adapters=(_Adapter(),))
    assert h is hidden and w is plain.weight
