"""Long-context evaluation metrics, exact under sequence parallelism: loss by position, passkey retrieval.

Both are torchmetrics ``Metric`` s whose states are sums (reduced with ``dist_reduce_fx="sum"``
over every rank of the default process group: the sequence-parallel AND data-parallel ranks). A
rank updates them with what it holds of a sharded batch (its tokens, whatever the layout), so the
sum over ranks is the count of the whole batch and ``compute`` gives the single-device value.

Note [Loss by position under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`LossByPosition` puts the loss of each valid token (the loss of predicting token t + 1 at
position t) into the bucket of ITS position, ``bucket = position * num_buckets // max_length``,
and keeps per bucket the sum of the losses (float64) and the token count (int64). Under the
strategy a rank holds the zigzag (or per-document zigzag) pieces of the sequence, so positions
are not ``0..S_local - 1``: the position of every token comes from the batch's ``position_ids``,
which the strategy's batch hook shards with the tokens. Sums of independent per-token terms do not
depend on which rank holds a token, so the reduced state is the single-device state up to the
order of float64 additions.

Packed documents: ``position_ids`` restart at every document there (the strategy replaces them
with the positions inside each document, ``CausalLMModule`` does the same on one device), and
buckets are by the position INSIDE the document, the context a token actually had: the natural
measure of how a model uses a long context (a token at stream position 60,000 that starts a
document has no more context than one at position 0). A document that continues from the
previous window restarts at 0 there too (Note [Packed documents] in ``lightning_seqpar.data.hf_text``).

Note [Passkey retrieval]
~~~~~~~~~~~~~~~~~~~~~~~~
Mohtashami & Jaggi (2023, "Landmark Attention", section 4.2) hide a random number in a long
run of filler text and ask for it at the end; :func:`lightning_seqpar.data.passkey_prompts` builds
such prompts with the run's tokenizer at chosen lengths and depths (where the passkey sits), the
passkey's tokens as the only labels. The model's greedy answer is right when the argmax of the
logits at every answer position is the passkey's next token: with teacher forcing, if every
one of those argmaxes matches, greedy decoding produces the passkey exactly, and if one does
not, greedy decoding leaves the passkey at that token. So one forward pass of the prompt
(sharded like any batch) decides it, with no decoding loop.

:class:`PasskeyAccuracy` keeps, for every prompt, its count of answer tokens and of mispredicted
answer tokens (int64 sums, indexed by the prompt's id). The answer tokens of one prompt may sit on
several ranks; the sums over ranks are the prompt's counts, and a prompt is retrieved when its
count of mispredictions is 0. ``compute`` gives the fraction of retrieved prompts in every
(depth, length) cell and the fraction of answer tokens right. Exact: integer counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX

__all__ = ["LossByPosition", "PasskeyAccuracy"]


class LossByPosition(Metric):
    """The mean token loss in ``num_buckets`` position buckets over ``max_length`` positions
    (Note [Loss by position under sequence parallelism]).

    ``update(token_losses, position_ids, labels)`` with this rank's (sharded) tensors ``(B, S_local)``
    (``position_ids`` may be ``(1, S_local)``); valid tokens are those whose label is not -100.
    ``compute()`` -> ``(num_buckets,)`` fp32 mean losses, NaN for a bucket without tokens.

    Args:
        max_length: positions ``0 .. max_length - 1`` are bucketed (the sequence length); a valid
            token at a position outside raises a ValueError.
        num_buckets: equal buckets of ``max_length / num_buckets`` positions (bucket b holds
            positions ``ceil(b * max_length / num_buckets)`` up to the next bucket's first).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    loss_sum: Tensor
    count: Tensor

    def __init__(self, *, max_length: int, num_buckets: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        name = type(self).__name__
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"{name}: max_length must be a positive integer (positions), got {max_length!r}")
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or not 1 <= num_buckets <= max_length:
            raise ValueError(f"{name}: num_buckets must be an integer in [1, max_length={max_length}], got {num_buckets!r}")
        self.max_length, self.num_buckets = max_length, num_buckets
        self.add_state("loss_sum", torch.zeros(num_buckets, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(num_buckets, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, token_losses: Tensor, position_ids: Tensor, labels: Tensor) -> None:
        name = type(self).__name__
        if token_losses.shape != labels.shape or token_losses.ndim != 2:
            raise ValueError(f"{name}: token_losses {tuple(token_losses.shape)} and labels {tuple(labels.shape)} must both be (B, S)")
        if position_ids.ndim != 2 or position_ids.shape[1] != labels.shape[1] or position_ids.shape[0] not in (1, labels.shape[0]):
            raise ValueError(f"{name}: position_ids {tuple(position_ids.shape)} must be (B, S) or (1, S) with labels {tuple(labels.shape)}")
        valid = labels != IGNORE_INDEX  # (B, S)
        positions = position_ids.expand_as(labels)[valid].to(torch.int64)  # (N,)
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_length):
            raise ValueError(f"{name}: a valid token sits at position {int(positions.max())} (or below 0), outside "
                             f"max_length={self.max_length}; set max_length to the sequence length")
        bucket = positions * self.num_buckets // self.max_length  # (N,)
        self.loss_sum.index_add_(0, bucket, token_losses[valid].to(torch.float64))
        self.count += torch.bincount(bucket, minlength=self.num_buckets)

    def compute(self) -> Tensor:
        mean = self.loss_sum / self.count.clamp(min=1)
        return torch.where(self.count > 0, mean, torch.nan).float()

    def bucket_starts(self) -> Tensor:
        """The first position of every bucket, ``(num_buckets,)`` int64."""
        b = torch.arange(self.num_buckets, dtype=torch.int64)
        return (b * self.max_length + self.num_buckets - 1) // self.num_buckets


class PasskeyAccuracy(Metric):
    """Passkey retrieval accuracy over a grid of depths x lengths (Note [Passkey retrieval]).

    ``update(predictions, labels, prompt_ids)``: this rank's (sharded) greedy predictions (the argmax of
    the logits, or the logits ``(B, S, V)`` themselves) and labels ``(B, S_local)``, with the id of each
    sample's prompt ``(B,)``: ``(depth_index * len(lengths) + length_index) * samples + sample_index``
    (``passkey_prompts`` gives it as ``prompt_id``).
    ``compute()`` -> ``{"accuracy": (D, L), "token_accuracy": (D, L)}`` fp32: the fraction of the cell's
    prompts whose every passkey token is predicted, and of its passkey tokens predicted (NaN for a
    cell without an evaluated prompt); and the counts of every prompt, ``"misses"`` and
    ``"answer_tokens"`` (D, L, samples) int64.

    Args:
        depths: where the passkey sits, as fractions of the filler (0: first, 1: last).
        lengths: prompt lengths in tokens.
        samples: prompts (different passkeys) per cell.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    misses: Tensor
    answer_tokens: Tensor

    def __init__(self, *, depths: Sequence[float], lengths: Sequence[int], samples: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        name = type(self).__name__
        depths, lengths = [float(d) for d in depths], [int(n) for n in lengths]
        if not depths or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"{name}: depths must be fractions in [0, 1], at least one; got {depths!r}")
        if not lengths or not all(n > 0 for n in lengths):
            raise ValueError(f"{name}: lengths must be positive token counts, at least one; got {lengths!r}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"{name}: samples must be a positive integer (prompts per cell), got {samples!r}")
        self.depths, self.lengths, self.samples = depths, lengths, samples
        prompts = len(depths) * len(lengths) * samples
        self.add_state("misses", torch.zeros(prompts, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("answer_tokens", torch.zeros(prompts, dtype=torch.int64), dist_reduce_fx="sum")

    def prompt_id(self, depth_index: int, length_index: int, sample_index: int) -> int:
        """The flat id of a prompt of the grid."""
        return (depth_index * len(self.lengths) + length_index) * self.samples + sample_index

    def update(self, predictions: Tensor, labels: Tensor, prompt_ids: Tensor) -> None:
        name = type(self).__name__
        if predictions.is_floating_point():
            predictions = predictions.argmax(-1)  # logits (B, S, V) -> (B, S)
        if predictions.shape != labels.shape or labels.ndim != 2:
            raise ValueError(f"{name}: predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} must both be (B, S)")
        prompt_ids = prompt_ids.reshape(-1).to(torch.int64)
        if prompt_ids.shape[0] != labels.shape[0]:
            raise ValueError(f"{name}: prompt_ids has {prompt_ids.shape[0]} entries for a batch of {labels.shape[0]}")
        if prompt_ids.numel() and (int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= self.misses.numel()):
            raise ValueError(f"{name}: prompt_ids must be in [0, {self.misses.numel()}) for {len(self.depths)} depths x "
                             f"{len(self.lengths)} lengths x {self.samples} samples, got {prompt_ids.tolist()}")
        valid = labels != IGNORE_INDEX  # (B, S): the passkey's tokens
        wrong = valid & (predictions != labels)
        self.misses.index_add_(0, prompt_ids, wrong.sum(dim=1))
        self.answer_tokens.index_add_(0, prompt_ids, valid.sum(dim=1))

    def compute(self) -> dict[str, Tensor]:
        shape = (len(self.depths), len(self.lengths), self.samples)
        misses, tokens = self.misses.view(shape), self.answer_tokens.view(shape)
        seen = tokens > 0  # (D, L, N)
        retrieved = (seen & (misses == 0)).sum(-1)  # (D, L)
        prompts = seen.sum(-1)
        right = (tokens - misses).sum(-1)
        total = tokens.sum(-1)
        return {"accuracy": torch.where(prompts > 0, retrieved / prompts.clamp(min=1), torch.nan).float(),
                "token_accuracy": torch.where(total > 0, right / total.clamp(min=1), torch.nan).float(),
                "misses": misses.clone(), "answer_tokens": tokens.clone()}
