"""The loss: ``cross_entropy.py`` (token cross-entropy sums, the chunked head, ``global_mean_loss``; Note [Loss
normalisation under sequence parallelism]) and ``head.py`` (the output head's operands for the chunked loss). Both
stand below ``models/`` and ``hf/``: the loss path imports nothing of peft. The public names are this face:
``from lightning_seqpar.loss import global_mean_loss, token_cross_entropy_sum``.
"""

from __future__ import annotations

from lightning_seqpar.loss.cross_entropy import (
    IGNORE_INDEX,
    GlobalMeanCalls,
    chunked_cross_entropy_sum,
    counting_global_mean_calls,
    global_mean_loss,
    global_token_count,
    token_cross_entropy_sum,
)

__all__ = ["IGNORE_INDEX", "GlobalMeanCalls", "chunked_cross_entropy_sum", "counting_global_mean_calls", "global_mean_loss",
           "global_token_count", "token_cross_entropy_sum"]
