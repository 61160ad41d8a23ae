"""Packed documents: which tokens may attend to which, and how documents are split over ranks.

Note [Packed documents and per-document zigzag]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A packed sample is many documents laid end to end; token t attends to token u only when both
belong to the same document (and u <= t under the causal mask). Attention never crosses a
document boundary, so the result equals running every document alone.

Cutting the packed sequence into the 2W chunks of the plain zigzag layout balances the causal
work of ONE long sequence, not of many documents: one 64K document in the first half and many
short ones in the second give the ranks holding the end of the long document several times the
work of the others. So documents are split one by one (per-document zigzag): every document of
length L is cut into P = 2W contiguous pieces of L // P or L // P + 1 tokens, and rank r holds
pieces r and 2W-1-r of EVERY document. Each rank then does the same share of every document's
causal work, whatever the mix of lengths.

    doc lengths 8 and 4, W = 2 (P = 4):
        doc 0  | a0 a0 | a1 a1 | a2 a2 | a3 a3 |      doc 1 | b0 | b1 | b2 | b3 |
        rank 0 holds  [a0 a0 b0 | a3 a3 b3]          (pieces 0 of all documents, then pieces 3)
        rank 1 holds  [a1 a1 b1 | a2 a2 b2]

Where the L % P leftover tokens go is chosen so that every piece index gets exactly S / P tokens
over the sample (a cursor walks the piece indices cyclically from one document to the next:
the leftovers of all documents sum to a multiple of P when P divides S), so every rank holds
exactly S / W tokens, S / P in each half, as under the plain zigzag.

Attention between a half of rank r (piece a of every document) and a half of rank s (piece b)
is then the same for every document: piece b < a is wholly before piece a (no mask), b == a
is the causal diagonal, b > a is wholly after (skipped). Each such pair is one variable-length
("varlen") kernel call whose segments are the documents (cu_seqlens from the piece lengths);
see ``lightning_seqpar.attention.varlen``. One rank (W = 1) keeps every document whole (P = 1).

The ``PackedDocuments`` of a batch is small ([B, N, P] piece lengths on the CPU); every rank
computes it from the full batch, before sharding, so no communication is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

__all__ = ["PackedDocuments", "current_documents", "packed_documents", "run_with_documents", "set_current_documents"]


def segment_indices(starts: Tensor, lengths: Tensor) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    starts, lengths = starts.reshape(-1), lengths.reshape(-1)
    total = int(lengths.sum())
    before = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - before, lengths, output_size=total) + torch.arange(total)


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """The documents of a packed batch, split over ``world`` context-parallel ranks.

    Build it with :meth:`from_document_ids` or :meth:`from_lengths`. Attributes:
        pieces: int64 ``[B, N, P]`` on the CPU: length of piece p of document n of sample b
            (documents past a sample's last have length 0). ``P = 2 * world`` (``1`` if world == 1).
        seq_len: S, the length of every sample.
        world: the number of context-parallel ranks the sequence is split over.
    """

    pieces: Tensor
    seq_len: int
    world: int

    # ------------------------------------------------------------------------------------- construction

    @classmethod
    def from_lengths(cls, lengths: Sequence[Sequence[int]] | Tensor, *, world: int = 1) -> PackedDocuments:
        """From the document lengths of each sample (each sample's lengths sum to the same S)."""
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        if isinstance(lengths, Tensor) and lengths.ndim == 1 or any(isinstance(r, int) for r in lengths):
            raise ValueError("lengths must hold one sequence of document lengths per sample, e.g. [[5, 1, 10]] for one sample")
        rows = [torch.as_tensor(list(r) if not isinstance(r, Tensor) else r, dtype=torch.int64).reshape(-1) for r in lengths]
        if not rows:
            raise ValueError("lengths must hold at least one sample")
        totals = {int(r.sum()) for r in rows}
        if len(totals) != 1:
            raise ValueError(f"every sample's document lengths must sum to the same sequence length; got sums {sorted(totals)}")
        if any(bool((r < 0).any()) for r in rows):
            raise ValueError("document lengths must be >= 0")
        seq_len = totals.pop()
        P = 1 if world == 1 else 2 * world
        if seq_len % P:
            raise ValueError(
                f"the sequence length {seq_len} must be divisible by 2 * world = {P} to split documents over {world} ranks "
                f"(per-document zigzag); pad the batch to a multiple of {P}"
            )
        N = max(len(r) for r in rows)
        L = torch.zeros(len(rows), N, dtype=torch.int64)
        for b, r in enumerate(rows):
            L[b, : len(r)] = r
        return cls(_split_pieces(L, P), seq_len, world)

    @classmethod
    def from_document_ids(cls, document_ids: Tensor, *, world: int = 1) -> PackedDocuments:
        """From per-token document ids ``[B, S]``: a new document starts wherever the id changes."""
        if not isinstance(document_ids, Tensor) or document_ids.ndim != 2 or document_ids.is_floating_point():
            raise ValueError(f"document_ids must be an integer tensor [batch, seq], got {getattr(document_ids, 'shape', type(document_ids).__name__)}")
        ids = document_ids.detach().cpu()
        lengths = [torch.unique_consecutive(row, return_counts=True)[1] for row in ids]
        return cls.from_lengths(lengths, world=world)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor, *, world: int = 1) -> PackedDocuments:
        """From positions that restart at 0 at every document start (the Hugging Face packing convention)."""
        if not isinstance(position_ids, Tensor) or position_ids.ndim != 2 or position_ids.is_floating_point():
            raise ValueError(f"position_ids must be an integer tensor [batch, seq], got {getattr(position_ids, 'shape', type(position_ids).__name__)}")
        starts = position_ids.detach().cpu() == 0
        starts[:, 0] = True
        return cls.from_document_ids(torch.cumsum(starts.long(), dim=1), world=world)

    # ------------------------------------------------------------------------------------- properties

    @property
    def batch(self) -> int:
        return self.pieces.shape[0]

    @property
    def num_pieces(self) -> int:
        return self.pieces.shape[2]

    @property
    def lengths(self) -> Tensor:
        """int64 ``[B, N]`` document lengths."""
        return self.pieces.sum(-1)

    def position_ids(self, device: torch.device | str | None = None) -> Tensor:
        """``[B, S]`` position of every token within its document (0 at each document start)."""
        out = []
        for lengths in self.lengths:
            starts = exclusive_cumsum(lengths, 0)
            out.append(torch.arange(self.seq_len) - torch.repeat_interleave(starts, lengths, output_size=self.seq_len))
        return torch.stack(out).to(device)

    def token_lengths(self, device: torch.device | str | None = None) -> Tensor:
        """``[B, S]`` length of every token's document (what a layer reading the sequence length sees of the
        document alone: Note [Length-dependent rotary embeddings] in ``lightning_seqpar.hf.rope``)."""
        return torch.stack([torch.repeat_interleave(lengths, lengths, output_size=self.seq_len) for lengths in self.lengths]).to(device)

    def piece_of(self, rank: int, half: int) -> int:
        """The piece index that ``half`` (0 or 1) of ``rank``'s shard holds (P = 1: the whole document)."""
        return 0 if self.num_pieces == 1 else (rank if half == 0 else self.num_pieces - 1 - rank)

    # ------------------------------------------------------------------------------------- sharding

    def index(self, rank: int) -> Tensor:
        """``[B, S / world]``: positions (in the sample) of ``rank``'s tokens, in local order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} must be in [0, {self.world})")
        piece_starts = exclusive_cumsum(self.pieces, 2) + exclusive_cumsum(self.lengths, 1).unsqueeze(-1)  # [B, N, P]
        halves = (0,) if self.num_pieces == 1 else (0, 1)
        rows = []
        for b in range(self.batch):
            parts = [segment_indices(piece_starts[b, :, self.piece_of(rank, h)], self.pieces[b, :, self.piece_of(rank, h)]) for h in halves]
            rows.append(torch.cat(parts))
        return torch.stack(rows)

    def rank_order(self) -> Tensor:
        """``[B, S]``: positions of the tokens of rank 0, then rank 1, ... (what an all-gather gives)."""
        return torch.cat([self.index(r) for r in range(self.world)], dim=1)

    def shard(self, x: Tensor, rank: int, *, dim: int = 1, hp: int = 1, hp_rank: int = 0) -> Tensor:
        """``rank``'s shard of the full ``x`` (``x.shape[0]`` the batch, ``x.shape[dim]`` the sequence).

        With a 2-D ("hp", "cp") mesh, ``rank`` is the cp rank and the cp shard is then split
        contiguously over ``hp`` (Note [Sequence layouts]).
        """
        dim = dim % x.ndim
        if dim == 0 or x.shape[0] != self.batch or x.shape[dim] != self.seq_len:
            raise ValueError(
                f"x of shape {tuple(x.shape)} must have the batch ({self.batch}) on dim 0 and the sequence ({self.seq_len}) "
                f"on dim {dim}"
            )
        idx = self.index(rank)
        if hp > 1:
            idx = idx.chunk(hp, dim=1)[hp_rank]
        idx = idx.to(x.device)
        shape = [1] * x.ndim
        shape[0], shape[dim] = idx.shape
        return torch.gather(x, dim, idx.view(shape).expand(*x.shape[:dim], idx.shape[1], *x.shape[dim + 1 :]))

    def unshard(self, shards: Sequence[Tensor], *, dim: int = 1) -> Tensor:
        """The full tensor from every rank's shard (rank order): the inverse of :meth:`shard`."""
        x = torch.cat(list(shards), dim=dim)
        dim = dim % x.ndim
        pos = self.rank_order().to(x.device)
        shape = [1] * x.ndim
        shape[0], shape[dim] = pos.shape
        return torch.empty_like(x).scatter_(dim, pos.view(shape).expand_as(x), x)

    def check(self, *, batch: int, local_len: int, world: int, what: str = "documents") -> None:
        """ValueError unless these documents describe ``batch`` samples split over ``world`` ranks of ``local_len`` tokens."""
        if self.world != world or self.batch != batch or self.seq_len != local_len * world:
            raise ValueError(
                f"{what} were split for batch={self.batch}, seq_len={self.seq_len}, world={self.world}, but the attention "
                f"input holds batch={batch} samples of {local_len} tokens on each of {world} ranks (seq_len {local_len * world}); "
                "build them with PackedDocuments.from_document_ids(document_ids, world=<context-parallel size>) from the full batch"
            )


def _split_pieces(lengths: Tensor, P: int) -> Tensor:
    """``[B, N, P]`` piece lengths: L // P each, the L % P leftovers at cyclically advancing piece indices."""
    q, m = lengths // P, lengths % P
    cursor = exclusive_cumsum(m, 1) % P  # [B, N]: where this document's leftovers start
    p = torch.arange(P)
    extra = ((p.view(1, 1, P) - cursor.unsqueeze(-1)) % P) < m.unsqueeze(-1)
    return q.unsqueeze(-1) + extra.long()


# ------------------------------------------------------------------------------------------ the batch's documents


def batch_documents(batch: dict, *, world: int) -> PackedDocuments | None:
    """The packed documents of a dict batch of full sequences, or None.

    From ``batch["document_ids"]`` ([B, S], a new document wherever the id changes), else from
    ``batch["position_ids"]`` when they restart at 0 inside a sample (the Hugging Face packing
    convention, e.g. ``DataCollatorWithFlattening``). Plain positions ``0..S-1`` mean one sequence.
    """
    ids = batch.get("document_ids")
    if isinstance(ids, Tensor):
        shape = tuple(batch["input_ids"].shape) if isinstance(batch.get("input_ids"), Tensor) else None
        if shape is not None and tuple(ids.shape) != shape:
            raise ValueError(f"batch['document_ids'] has shape {tuple(ids.shape)}; expected {shape} (the shape of input_ids): "
                             "the document of every input token")
        return PackedDocuments.from_document_ids(ids, world=world)
    pos = batch.get("position_ids")
    if isinstance(pos, Tensor) and pos.ndim == 2 and pos.shape[1] > 1 and bool((pos[:, 1:] == 0).any()):
        return PackedDocuments.from_position_ids(pos.expand(batch["input_ids"].shape[0], -1), world=world)
    return None


def documents_error(owner: str, why: str) -> ValueError:
    """The error for a batch of packed documents that ``owner`` cannot mask, ``why`` saying why and what to do."""
    return ValueError(f"{owner}: the batch holds packed documents (document_ids / position_ids restarting at 0), {why}")


# Note [Per-call state]
# ~~~~~~~~~~~~~~~~~~~~~
# The packed documents of a batch are needed deep inside the model (every ``Attention`` module,
# ``HFCausalLM``'s checks) but are not an argument of the model's forward. They travel in one
# per-thread slot (the attribute ``documents`` of ``_DOCUMENTS`` below, a ``threading.local``: its
# value belongs to the thread that set it; the module holds only the handle, no state):
#
# * set: by ``SequenceParallelStrategy`` for every batch it shards, and by ``CausalLMModule`` for
#   every batch outside the strategy, with :func:`set_current_documents` (the batch's documents,
#   or None when it has none); by code of one's own with ``with packed_documents(docs): ...``,
#   which restores the value before it on exit.
# * read: with :func:`current_documents` at FORWARD time (``Attention.forward``; the strategy's
#   ``gather_sequence``; callbacks of the same step). The attention op receives the documents'
#   piece lengths as an argument and autograd saves them with the other inputs, so its backward
#   reads nothing.
# * captured for backward: activation checkpointing recomputes a block in backward, and on a GPU
#   the autograd engine runs backward in its own threads, where the slot has its default (None).
#   So ``lightning_seqpar.parallel.activation_checkpointing`` runs every checkpointed block through
#   :func:`run_with_documents` with the documents read at forward time: the recomputation masks
#   by the same documents whatever thread it runs in. A checkpoint of one's own around
#   ``Attention`` modules must do the same.
# * under torch.compile: Dynamo traces the read (an attribute of a ``threading.local``, read with
#   ``getattr`` and a default, as it traces any Python object's attribute) instead of breaking the
#   graph, as it did on a ``contextvars.ContextVar`` (``ContextVar.get`` / ``set`` are not
#   traceable in torch 2.11 - 2.13: every compiled block broke at each read, and a checkpointed
#   block was not captured at all; issue #56). What the graph depends on is guarded, not baked
#   in: None or a ``PackedDocuments`` (one graph each), the documents' ``seq_len`` / ``world``, the
#   shape of their ``pieces``, which enter the graph as an input tensor: a new batch's documents
#   of the same shapes reuse the graph (after a first change of the document count Dynamo makes
#   that size dynamic: one graph more, and one for a count of one), and the guards are checked in the calling thread, so a
#   thread without documents never runs a graph traced with another's. (A ``threading.local``
#   subclass with a class-level default is not traced by torch 2.11's Dynamo: it guards on the
#   default as a constant.) A compiled checkpoint needs no :func:`run_with_documents`: its
#   recomputation is part of the compiled backward, whose inputs already hold the pieces (Note
#   [Checkpoints under torch.compile] in ``lightning_seqpar.parallel.activation_checkpointing``).
# * reset: by the next batch, and to None by the strategy's and the module's ``teardown`` (the end
#   of every fit / validate / predict, also after a failure), so nothing outlives a run; two
#   threads never see each other's documents.
#
# (A ``ContextVar`` would also follow asyncio tasks; nothing here runs a model in them, and a thread's
# slot is what the autograd engine's threads and torch.compile's guards both see.)


_DOCUMENTS = threading.local()


def _checked(documents: PackedDocuments | None) -> PackedDocuments | None:
    if documents is not None and not isinstance(documents, PackedDocuments):
        raise ValueError(f"documents must be a PackedDocuments or None, got {type(documents).__name__}")
    return documents


def set_current_documents(documents: PackedDocuments | None) -> None:
    """Make ``documents`` the packed documents that ``Attention`` modules mask by in this context (None: no documents).

    ``SequenceParallelStrategy`` calls it for every batch it shards (``document_ids`` in the
    batch, or ``position_ids`` that restart at 0) and with None at teardown; the setting lasts
    until the next batch (Note [Per-call state]). Code of one's own uses :func:`packed_documents`.
    """
    _DOCUMENTS.documents = _checked(documents)


def current_documents() -> PackedDocuments | None:
    """The packed documents of this context (Note [Per-call state]); None when the batch has none."""
    return getattr(_DOCUMENTS, "documents", None)


@contextmanager
def packed_documents(documents: PackedDocuments | None) -> Iterator[PackedDocuments | None]:
    """``with packed_documents(docs): model(...)`` — documents for the calls inside, restored after."""
    before, _DOCUMENTS.documents = current_documents(), _checked(documents)
    try:
        yield documents
    finally:
        _DOCUMENTS.documents = before


def run_with_documents(documents: PackedDocuments | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``documents`` current, the value before restored after: what a checkpoint runs,
    ``documents`` read at forward time, so that its recomputation in backward masks by them (Note [Per-call state])."""
    before, _DOCUMENTS.documents = current_documents(), documents
    try:
        return fn(*args, **kwargs)
    finally:
        _DOCUMENTS.documents = before
