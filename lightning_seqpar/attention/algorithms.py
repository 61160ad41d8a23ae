"""The names of the attention algorithms, in one place: the public choice and what one op call runs.

``Algorithm`` is what a user picks (``sequence_parallel_attention(algorithm=...)``, the strategy's
``attention=`` option without "lasp" / "auto", the cost model's candidates). ``OpKind`` is what one
``seqpar::attn_fwd`` call runs (Note [Custom ops] in ``lightning_seqpar.attention.api``): a ring or
an all-gather over a process group, ``"local"`` attention on this rank (one rank, Ulysses' inner
attention after the head all-to-all, or 2D's ring over a cp of one), or ``"gathered"`` (local
queries over K/V this rank already gathered: ``gathered_kv_attention``). Ulysses and 2D are not op
kinds: 2D (and Ulysses with sinks) is head all-to-alls around op calls; Ulysses otherwise runs in
its own op pair, ``seqpar::ulysses_fwd`` / ``ulysses_bwd`` (Note [Overlapped Ulysses]).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ALGORITHMS", "OP_KINDS", "Algorithm", "OpKind"]

Algorithm = Literal["ring", "allgather", "ulysses", "2d"]
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)

OpKind = Literal["local", "ring", "allgather", "gathered"]
OP_KINDS: tuple[OpKind, ...] = get_args(OpKind)
