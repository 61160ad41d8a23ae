"""A user's own model under the strategy: its ``F.scaled_dot_product_attention`` calls run sequence-parallel attention.

Note [Routing a model's own SDPA calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model written for one device (nanoGPT, a Llama with ``freqs_cis``, LitGPT's ``GPT``) computes
attention with ``torch.nn.functional.scaled_dot_product_attention(q, k, v)`` on ``(B, H, S, D)``
tensors. Under the strategy each rank holds a shard of every sequence, and attention must see the
whole sequence. ``install_sdpa_routing`` gives every block of such a model an ``Attention`` child
(``seqpar_sdpa``; no parameters, so the state dict does not change) and runs the block's forward
under a ``TorchFunctionMode`` (``_Router``) that sends the block's SDPA calls to that child: the
strategy's algorithm over its mesh (ring, all-gather, Ulysses, 2D, double ring), its local kernel,
the batch's packed documents. Per call::

    F.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)     q: (B, H_q, S_local, D)
      -> Attention(q.T, k.T, v.T, causal=is_causal, scale=scale)           (B, S_local, H, D)
      -> (B, H_q, S_local, D)

What the call cannot say under the split is refused by name, before any collective: ``dropout_p >
0`` (random: no two layouts draw the same mask), K/V of another length than the queries (cross
attention to a tensor that is not split with the sequence), GQA without ``enable_gqa`` (SDPA
itself refuses it), and a mask, unless it shows a sliding window shorter than the shard (a mask
built from the local length that looks causal cannot show a longer window: pass ``is_causal=True``).
LitGPT's windowed layers build such masks; their window is read from the layer's config.

Note [K/V repeated before the call]: a model with fewer K/V heads than query heads may repeat K and V
(``repeat_interleave``, LitGPT, torchtitan's ``repeat_kv``) before calling SDPA without ``enable_gqa``.
Exact as it is, but the ring, the all-gather and Ulysses would then move every repeated copy (4x the
K/V traffic for Llama-3-8B). Where the model's config says it has g query heads per K/V head
(``attention_heads``: LitGPTModule, transformers configs) and the block's first call shows K and V
made of g equal copies per group, the routed call takes one head per group (a strided view): the same
attention, and since the copies' gradients add up in the model's repeat, the same gradients.

Every mode is entered per block forward (so the recomputation of a checkpointed block in backward
routes as its forward did) and once around the whole training / validation / predict step (for
what the model does outside its blocks: an SDPA call there is refused, and position tables).

Note [Position tables under the split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Positions are global: the token at global position p must see row p of a rotary table or a learned
position embedding on every rank. Positions that come from the batch (``position_ids``) are
sharded with the tokens and are right. A model that slices a table by its input's length
(``self.cos[:T]``, ``self.freqs_cis[0:T]``) reads rows ``0..T_local-1`` on every rank: wrong on
every rank but the first of a contiguous split. The router sees such reads: a buffer or tensor
attribute of the model (not a parameter) sliced ``[:T_local]`` along dim 0 returns the rows of
this rank's global positions instead (``table[index]``: the zigzag or contiguous index of the
shard, or the packed documents' split). That is torch's ``context_parallel(buffers=...)``, found
instead of declared; the check at setup (``lightning_seqpar.routing.check``) confirms that the
model is then exact, and says which tables it found. Positions computed with ``torch.arange(T)``
inside forward cannot be told apart from any other arange: the check finds them and refuses the
model, naming the cause (read ``position_ids`` from the batch instead).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_seqpar.attention import Attention, LinearAttention
from lightning_seqpar.attention.recurrent import Recurrence
from lightning_seqpar.routing.guard import OutsideAttentionGuard
from lightning_seqpar.sharding.documents import current_documents
from lightning_seqpar.sharding.layouts import mesh_sizes, sequence_index

__all__ = ["ROUTED_NAME", "Routing", "install_sdpa_routing", "own_model_routing", "routed_step", "routing_of"]

ROUTED_NAME = "seqpar_sdpa"
"""The ``Attention`` child each routed block gets."""

_SDPA = F.scaled_dot_product_attention
_GETITEM = Tensor.__getitem__
_ROUTING_ATTR = "_seqpar_routing"


@dataclass
class CheckRecord:
    """What the split forward of the check (``lightning_seqpar.routing.check``) saw: the clues to a model that differs."""

    local_len: int
    aranges: int = 0
    """``torch.arange`` calls of the shard's length from 0: positions computed inside forward."""
    tables: set[str] = field(default_factory=set)
    """Position tables read at the shard's global positions (Note [Position tables under the split])."""
    sdpa_by_block: dict[int, int] = field(default_factory=dict)
    """Routed SDPA calls per block index."""


class Routing:
    """The routed SDPA of one model (Note [Routing a model's own SDPA calls]): its blocks' ``Attention`` children,
    its position tables, and the state of the step that runs."""

    def __init__(self, root: nn.Module, blocks: Sequence[nn.Module], *, owner: str, blocks_name: str) -> None:
        self.root = root
        self.owner = owner
        self.blocks_name = blocks_name
        self.attentions: list[Attention] = []
        self.local_len: int | None = None  # the current step's local sequence length (None: outside a step)
        self.whole = False  # the check's reference pass: plain SDPA, tables as they are
        self.record: CheckRecord | None = None
        self._inside = 0  # > 0 while a routed call runs (its own kernels' SDPA calls pass through)
        self.kv_groups = 1  # query heads per K/V head from the model's config, where known (Note [K/V repeated before the call])
        self._table_ids: dict[int, str] = {}
        self._index: Tensor | None = None
        for i, block in enumerate(blocks):
            attention = Attention(causal=True)
            attention.block_index = i  # type: ignore[attr-defined]
            attention.routed_window = _litgpt_window(block)  # type: ignore[attr-defined]
            block.add_module(ROUTED_NAME, attention)
            object.__setattr__(block, _ROUTING_ATTR, self)
            block.__class__ = _routed_class(type(block))
            self.attentions.append(attention)

    # ----------------------------------------------------------------------------------------- the step

    @property
    def sp(self) -> int:
        mesh = self.attentions[0].mesh if self.attentions else None
        return 1 if mesh is None else mesh.size()

    @contextmanager
    def step(self, local_len: int | None) -> Iterator[None]:
        """Route the SDPA calls and table reads of one step whose batch holds ``local_len`` tokens per sequence."""
        self.local_len, self._index = local_len, None
        self._table_ids = _tables(self.root)
        with _Router(self, None):
            yield

    def global_index(self, like: Tensor) -> Tensor:
        """This rank's global token positions (S_local,), for the current step's layout and packed documents."""
        if self._index is None or self._index.device != like.device:
            attention = self.attentions[0]
            mesh, local = attention.mesh, int(self.local_len or 0)
            hp, hp_rank, cp, cp_rank = mesh_sizes(mesh)  # type: ignore[arg-type]
            documents = current_documents()
            if documents is None:
                index = sequence_index(local * hp * cp, mesh, attention.layout, device=like.device)  # type: ignore[arg-type]
            else:
                full = torch.arange(local * hp * cp, device=like.device).expand(documents.batch, -1)
                rows = documents.shard(full, cp_rank, hp=hp, hp_rank=hp_rank)
                if not bool((rows == rows[:1]).all()):
                    raise ValueError(
                        f"{self.owner}: the model slices a position table by the sequence length (Note [Position tables under "
                        "the split]) and the batch's packed documents split each sequence differently, so one table cannot "
                        "serve every row; read positions from the batch's position_ids, or use one sequence per batch")
                index = rows[0]
            self._index = index
        return self._index

    # ----------------------------------------------------------------------------------------- the calls

    def _unrepeated(self, attention: Attention, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """K / V with one head per group where the model repeated them before the call (Note [K/V repeated before the
        call]): decided at the block's first eager call, then a strided view every call."""
        groups = getattr(attention, "kv_repeat", None)
        if groups is None:
            if torch.compiler.is_compiling():
                return key, value
            g = self.kv_groups
            k, v = key.unflatten(1, (-1, g)), value.unflatten(1, (-1, g))  # (B, H_kv, g, S, D)
            repeated = torch.equal(k, k[:, :, :1].expand_as(k)) and torch.equal(v, v[:, :, :1].expand_as(v))
            groups = attention.kv_repeat = g if repeated else 1  # type: ignore[assignment]
        return (key, value) if groups == 1 else (key[:, ::groups], value[:, ::groups])

    def table_rows(self, table: Tensor, index: Any) -> Tensor | None:
        """``table[index]`` read at this rank's global positions, where ``index`` slices the shard's length from 0 along
        dim 0 of a position table (Note [Position tables under the split]); None for every other read."""
        name = self._table_ids.get(id(table))
        if name is None or self.whole or self.local_len is None or self.sp == 1:
            return None
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if not isinstance(first, slice) or first.start not in (None, 0) or first.step not in (None, 1) or first.stop != self.local_len:
            return None
        if self.record is not None:
            self.record.tables.add(name)
        self._inside += 1  # the index's own aranges and slices are not the model's
        try:
            rows = table.index_select(0, self.global_index(table))
            return _GETITEM(rows, (slice(None), *rest)) if rest else rows
        finally:
            self._inside -= 1

    def sdpa(self, attention: Attention | None, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
        """One ``F.scaled_dot_product_attention`` call of the model, routed (Note [Routing a model's own SDPA calls])."""
        plain = lambda: _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,  # noqa: E731
                              scale=scale, enable_gqa=enable_gqa)
        if self._inside or self.whole:
            return plain()
        sp = self.sp
        where = f"{self.owner}: F.scaled_dot_product_attention"
        if attention is None:
            if sp > 1:
                raise ValueError(
                    f"{where} was called outside the transformer blocks ({self.blocks_name}), on tensors the strategy does not "
                    "know to be split along the sequence; call attention inside the blocks, or name the module list that "
                    "holds every attention call with SequenceParallelStrategy(blocks='path.to.list')")
            return plain()
        block = f"{where} in block {attention.block_index}"  # type: ignore[attr-defined]
        window, known = None, getattr(attention, "routed_window", None)
        shown = _mask_pattern(attn_mask, query.shape[-2]) if attn_mask is not None and query.dim() == 4 else None
        if query.dim() != 4 or key.dim() != 4:
            why = f"{block}: routed attention takes (B, H, S, D) tensors, got q {tuple(query.shape)}, k {tuple(key.shape)}"
        elif key.shape[-2] != query.shape[-2]:
            why = (f"{block}: keys of length {key.shape[-2]} for queries of length {query.shape[-2]}: attention to a tensor "
                   "that is not the sequence (cross attention, latents, a cache) is not split with the sequence, so it cannot "
                   "be made exact under sequence parallelism")
        elif dropout_p:
            why = (f"{block}: dropout_p={dropout_p} draws a random mask, which no split can reproduce; train with attention "
                   "dropout 0 (as long-context training does) or pass dropout_p=0 when self.training is False only")
        elif attn_mask is not None and (shown is None or (shown[1] is None and known is None)):
            why = (f"{block}: an explicit attn_mask {tuple(attn_mask.shape)} is built from the shard, not the sequence; pass "
                   "is_causal=True (causal), attn_mask=None (bidirectional), document_ids in the batch (packed documents: the "
                   "strategy masks them), or a sliding-window mask")
        else:
            why = None
        if why is not None:  # refused under the split; one process runs it as it is
            if sp > 1:
                raise ValueError(why)
            return plain()
        if shown is not None:
            is_causal, window = True, (known if known is not None else shown[1])
        elif known is not None and is_causal:
            window = known
        h_q, h_kv = query.shape[1], key.shape[1]
        if h_q != h_kv and not enable_gqa:
            raise ValueError(f"{where}: {h_q} query heads and {h_kv} key/value heads need enable_gqa=True (as SDPA itself requires)")
        if h_q == h_kv and self.kv_groups > 1:  # Note [K/V repeated before the call]
            key, value = self._unrepeated(attention, key, value)
        if self.record is not None:
            index = attention.block_index  # type: ignore[attr-defined]
            self.record.sdpa_by_block[index] = self.record.sdpa_by_block.get(index, 0) + 1
        self._inside += 1
        try:
            out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=bool(is_causal),
                            scale=scale, window=window)
        finally:
            self._inside -= 1
        return out.transpose(1, 2)


class _Router(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` to ``routing.sdpa`` with this block's ``attention`` (None: outside the
    blocks), position-table slices to ``routing.table_rows``, and counts aranges for the check."""

    def __init__(self, routing: Routing, attention: Attention | None) -> None:
        super().__init__()
        self.routing = routing
        self.attention = attention

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.routing.sdpa(self.attention, *args, **kwargs)
        if func is _GETITEM:
            rows = self.routing.table_rows(*args)
            if rows is not None:
                return rows
        elif func is torch.arange and self.routing.record is not None and not self.routing._inside:
            self._count_arange(args, kwargs)
        return func(*args, **kwargs)

    def _count_arange(self, args: tuple, kwargs: dict) -> None:
        numbers = [a for a in args if isinstance(a, (int, float))]
        start, end = (0, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1]) if len(numbers) >= 2 else (0, kwargs.get("end"))
        record = self.routing.record
        if record is not None and start == 0 and end == record.local_len:
            record.aranges += 1


_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """``cls`` whose forward runs under the block's router: the block's class, so ``isinstance`` and its methods hold."""
    if getattr(cls, "_seqpar_routed", False):
        return cls
    if cls not in _ROUTED_CLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with _Router(getattr(self, _ROUTING_ATTR), getattr(self, ROUTED_NAME)):
                return cls.forward(self, *args, **kwargs)

        _ROUTED_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_seqpar_routed": True,
                                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _ROUTED_CLASSES[cls]


def _tables(root: nn.Module) -> dict[int, str]:
    """The tensors of ``root`` that may be position tables: buffers and plain tensor attributes (never parameters)."""
    tables = {id(t): name for name, t in root.named_buffers() if t is not None and t.dim() >= 1}
    for name, module in root.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) and value.dim() >= 1 and not attr.startswith("_"):
                tables.setdefault(id(value), f"{name}.{attr}" if name else attr)
    return tables


def _mask_pattern(mask: Tensor, length: int) -> tuple[bool, int | None] | None:
    """What an explicit SDPA mask of one (S, S) pattern shows: (True, w) a causal window of w < S keys, (True, None)
    plain causal; None for anything else (padding, documents, per-row masks, biases)."""
    m = mask
    while m.dim() > 2 and m.shape[0] == 1:
        m = m[0]
    if m.dim() != 2 or tuple(m.shape) != (length, length):
        return None
    if m.dtype == torch.bool:
        allowed = m
    else:
        allowed, blocked = m == 0, torch.isneginf(m)
        if not bool((allowed | blocked).all()):
            return None
    i = torch.arange(length, device=m.device)
    causal = i[None, :] <= i[:, None]
    if torch.equal(allowed, causal):
        return True, None
    w = int(allowed[-1].sum())
    if 0 < w < length and torch.equal(allowed, causal & (i[:, None] - i[None, :] < w)):
        return True, w
    return None


def _litgpt_window(block: nn.Module) -> int | None:
    """A LitGPT block's sliding window (its layers build the window's mask from the local length)."""
    attn = getattr(block, "attn", None)
    if not type(block).__module__.startswith("litgpt") or not getattr(attn, "apply_sliding_window_attention", False):
        return None
    return int(attn.config.sliding_window_size)  # type: ignore[union-attr]


def routing_of(module: nn.Module) -> Routing | None:
    """The routing installed in ``module`` (a root of the strategy), or None."""
    for m in module.modules():
        routing = getattr(m, _ROUTING_ATTR, None)
        if isinstance(routing, Routing):
            return routing
    return None


def install_sdpa_routing(root: nn.Module, blocks: Sequence[nn.Module], *, owner: str, blocks_name: str) -> Routing:
    """Give every block of ``root`` its ``Attention`` child and route the block's SDPA calls to it (Note [Routing a
    model's own SDPA calls]); returns the ``Routing`` (installed once: a second call returns the first)."""
    existing = routing_of(root)
    if existing is not None:
        return existing
    return Routing(root, blocks, owner=owner, blocks_name=blocks_name)


def own_model_routing(root: nn.Module, blocks: Sequence[tuple[nn.Module, str]], *, owner: str,
                      heads: tuple[int, int, Any] | None = None) -> Routing | None:
    """Install the routed SDPA in ``root`` (whose blocks are ``getattr(parent, name)`` of ``blocks``) where it computes
    no attention through the package's modules; the routing already installed, or None for the package's models."""
    existing = routing_of(root)
    if existing is not None or any(isinstance(m, (Attention, LinearAttention, Recurrence)) for m in root.modules()):
        return existing
    names = {id(m): n for n, m in root.named_modules()}
    blocks_name = (names.get(id(blocks[0][0])) if blocks else None) or type(root).__name__
    routing = install_sdpa_routing(root, [getattr(p, n) for p, n in blocks], owner=owner, blocks_name=blocks_name)
    if heads is not None and heads[1] and heads[0] % heads[1] == 0:
        routing.kv_groups = heads[0] // heads[1]
    return routing


@contextmanager
def routed_step(routings: Sequence[Routing], batch: Any, guard: OutsideAttentionGuard | None = None) -> Iterator[None]:
    """One training / validation / predict step of models with routed SDPA (``Routing.step``), for ``batch``; the
    first step of models with the package's attention modules under ``guard`` (Note [SDPA outside the package's
    attention] in ``lightning_seqpar.routing.guard``)."""
    if not routings and (guard is None or not guard.armed):
        yield
        return
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    local_len = int(ids.shape[1]) if isinstance(ids, Tensor) and ids.dim() >= 2 else None
    with ExitStack() as stack:
        for routing in routings:
            stack.enter_context(routing.step(local_len))
        if guard is not None:
            stack.enter_context(guard.step())
        yield
