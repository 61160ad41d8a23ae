"""What every causal LM of the package shares: global position ids and the forward contract."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lightning_seqpar.loss.head import head_operands


def global_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Position ids (B, S) for ``input_ids`` (B, S): ``arange(S)`` when None, a (1, S) row expanded.

    Under sequence parallelism a rank's tokens come from anywhere in the sequence, so models take
    the *global* positions (sharded with the same layout as the input ids), never ``arange`` of
    the local length.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if position_ids is None:
        return torch.arange(S, device=input_ids.device).expand(B, S)
    if position_ids.shape == input_ids.shape:
        return position_ids
    if position_ids.ndim == 2 and position_ids.shape[0] == 1 and position_ids.shape[1] == S:
        return position_ids.expand(B, S)
    raise ValueError(
        f"position_ids must have the shape of input_ids {tuple(input_ids.shape)} (or (1, {S})), "
        f"got {tuple(position_ids.shape)}; shard position ids with the same layout as input ids"
    )


class CausalLM(nn.Module):
    """Base of the package's models: ``forward`` = ``forward_hidden`` then ``lm_head``."""

    lm_head: nn.Linear

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        output: Literal["logits", "hidden"] = "logits",
    ) -> torch.Tensor:
        """Logits (B, S, V) of the next token at every position, or with ``output="hidden"`` the
        final normed hidden states (B, S, d) for a chunked loss over ``lm_head.weight``."""
        if output not in ("logits", "hidden"):
            raise ValueError(f"output={output!r} is not supported; expected 'logits' or 'hidden'")
        hidden = self.forward_hidden(input_ids, position_ids)  # (B, S, d)
        return hidden if output == "hidden" else self.lm_head(hidden)  # (B, S, V)

    def head_operands(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, lm_head.weight)``: what a chunked loss multiplies to get the logits of ``hidden`` (B, S, d)
        (``lightning_seqpar.loss.head``; a head other than a plain ``nn.Linear`` without bias is refused by name)."""
        return head_operands(self.lm_head, hidden, type(self).__name__)
