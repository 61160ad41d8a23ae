"""The short causal convolution over sequence shards: the depthwise convolution in front of the recurrent mixers
(Mamba, Gu & Dao 2023, §3.4; gated DeltaNet / Qwen3-Next, Mamba2, LFM2's short convolution), exact under sequence
sharding by a halo exchange and, with packed documents, by a history chain (Note [Documents in a recurrence] in
``base.py``).

Note [Halo exchange for the short convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A causal depthwise convolution of kernel k reads the current and the k-1 previous inputs. Each
piece needs the last k-1 inputs of the previous piece (zeros before the first piece): one
message of [B, k-1, C] from the owner of the previous piece, all posted at once (no chain); the
backward sends the gradient of the halo back to its owner, which adds it to the gradient of its
last k-1 inputs. Pieces shorter than k-1 tokens would need several predecessors and are refused.

"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.comm import P2P, process_group
from lightning_seqpar.attention.recurrent.base import StateChain, check_documents, check_mesh_layout, piece_owner, pieces_of
from lightning_seqpar.sharding.documents import PackedDocuments, exclusive_cumsum, segment_indices
from lightning_seqpar.sharding.layouts import chunk_ids, num_chunks

_ACTIVATIONS: dict[str | None, Callable[[Tensor], Tensor]] = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


# the halo exchange (Note [Halo exchange for the short convolution])


class _Halo(torch.autograd.Function):
    """x [B, T, C] -> halos [P, B, width, C]: the last ``width`` inputs before each local piece."""

    @staticmethod
    def forward(ctx, x: Tensor, width: int, group_name: str, layout: str) -> Tensor:
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, layout), num_chunks(world, layout)
        parts = x.chunk(len(pieces), dim=1)
        halos = x.new_zeros((len(pieces), x.shape[0], width, x.shape[2]))
        sends, recvs = [], []
        for i, p in enumerate(pieces):
            if p > 0:
                src = piece_owner(p - 1, world, layout)
                if src == rank:
                    halos[i] = parts[i - 1][:, -width:]
                else:
                    recvs.append((halos[i], src))
            if p < n - 1 and piece_owner(p + 1, world, layout) != rank:
                sends.append((parts[i][:, -width:].contiguous(), piece_owner(p + 1, world, layout)))
        comm = P2P(group)
        comm.wait(comm.post(sends, recvs))
        ctx.args = (width, group_name, layout, x.shape[1])
        return halos

    @staticmethod
    def backward(ctx, dhalos: Tensor):
        width, group_name, layout, T = ctx.args
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, layout), num_chunks(world, layout)
        P, B, _, C = dhalos.shape
        dtails = dhalos.new_zeros(P, B, width, C)  # gradient of each local piece's last `width` inputs
        sends, recvs = [], []
        for i, p in enumerate(pieces):
            if p > 0:
                dst = piece_owner(p - 1, world, layout)
                if dst == rank:
                    dtails[i - 1] += dhalos[i]
                else:
                    sends.append((dhalos[i].contiguous(), dst))
            if p < n - 1 and piece_owner(p + 1, world, layout) != rank:
                buf = dhalos.new_zeros(B, width, C)
                recvs.append((buf, piece_owner(p + 1, world, layout)))
        comm = P2P(group)
        comm.wait(comm.post(sends, recvs))
        received = iter(buf for buf, _ in recvs)
        for i, p in enumerate(pieces):
            if p < n - 1 and piece_owner(p + 1, world, layout) != rank:
                dtails[i] += next(received)
        return _tails_to_input(dtails, T), None, None, None


def _tails_to_input(dtails: Tensor, T: int) -> Tensor:
    """[P, B, width, C] gradients of each piece's last ``width`` rows -> [B, T, C]."""
    P, B, width, C = dtails.shape
    per = T // P
    dx = dtails.new_zeros(B, P, per, C)
    dx[:, :, per - width:] = dtails.transpose(0, 1)
    return dx.reshape(B, T, C)


# ---------------------------------------------------------------------------------------------
# the short convolution with packed documents (Note [Documents in a recurrence])


def _extended_layout(lengths: Tensor, T: int, width: int) -> dict[str, Tensor]:
    """Each segment's rows preceded by its ``width`` history rows, segments end to end.

    lengths: int64 [B, N] (CPU), rows summing to T. Rows are numbered as in ``cat([x.reshape(B * T, C),
    history.reshape(B * N * width, C)])``. Returns ``gather`` [E] (the row at each extended position),
    ``token`` [B * T] (the extended position of every token) and ``tail`` [B * N * width] (the
    extended positions of the last ``width`` rows of every segment: its history for what follows).
    """
    B, N = lengths.shape
    flat = lengths.reshape(-1)
    block = flat + width
    estart = exclusive_cumsum(block, 0)  # (B N,)
    starts = (torch.arange(B)[:, None] * T + exclusive_cumsum(lengths, 1)).reshape(-1)
    j = torch.arange(width)
    hist_pos = (estart[:, None] + j).reshape(-1)  # where each history row goes
    tok_pos = segment_indices(estart + width, flat)
    src = segment_indices(starts, flat)
    gather = torch.empty(int(block.sum()), dtype=torch.int64)
    gather[hist_pos] = B * T + torch.arange(B * N * width)
    gather[tok_pos] = src
    token = torch.empty(B * T, dtype=torch.int64)
    token[src] = tok_pos
    tail = (estart[:, None] + flat[:, None] + j).reshape(-1)
    return {"gather": gather, "token": token, "tail": tail}


def _extended(x: Tensor, history: Tensor, lengths: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """x [B, T, C], history [B, N, width, C] -> the extended rows [E, C] and their layout."""
    B, T, C = x.shape
    lay = {n: i.to(x.device) for n, i in _extended_layout(lengths, T, history.shape[2]).items()}
    return torch.cat([x.reshape(B * T, C), history.reshape(-1, C)])[lay["gather"]], lay


def _tail_kernel(x: Tensor, s_in: Tensor | None, *, piece: int, pieces: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """One piece of the convolution's history chain: (its entering histories [B, N * width, C], leaving histories
    [B, N, width, C]); the history of a document is its last ``width`` inputs so far (zeros before its start)."""
    B, _, C = x.shape
    lengths = pieces[:, :, piece]
    N = lengths.shape[1]
    if s_in is None:
        s_in = x.new_zeros(B, N, width, C)
    rows, lay = _extended(x, s_in, lengths)
    return s_in.reshape(B, N * width, C), rows[lay["tail"]].reshape(B, N, width, C)


def _conv_segments(x: Tensor, history: Tensor, lengths: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The causal conv of every segment of x [B, T, C] over its own history [B, N, width, C] only."""
    B, T, C = x.shape
    rows, lay = _extended(x, history, lengths)  # (E, C)
    out = F.conv1d(rows.t()[None], weight[:, None], bias, groups=C)[0].t()  # (E - width, C): row e ends at e + width
    return out[lay["token"] - history.shape[2]].reshape(B, T, C)


# ---------------------------------------------------------------------------------------------
# the public function


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str | None = None,
                  mesh: DeviceMesh | None = None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                  documents: PackedDocuments | None = None) -> Tensor:
    """Depthwise causal convolution of kernel k over the sequence (shards): ``out_t = act(bias +
    sum_j weight[:, j] x_{t-k+1+j})``, zero before the first token (Note [Halo exchange for the short
    convolution]).

    Args:
        x: ``[B, T_local, C]`` — this rank's shard (``layout``); weight ``[C, k]``; bias ``[C]`` or None.
        activation: None or "silu".
        mesh: the sequence-parallel ranks (1-D), or None / one rank: the whole sequence on one device.
        documents: packed documents (built with ``world`` = the mesh size; x sharded by
            ``PackedDocuments.shard``, layout "zigzag"): no window reaches into the previous
            document (Note [Documents in a recurrence]).

    Returns:
        ``[B, T_local, C]`` in x's dtype, computed in the weight's dtype as transformers does.
    """
    check_mesh_layout(mesh, layout)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {tuple(_ACTIVATIONS)}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"x must be [B, T, C] and weight [C, k] with the same C; got x={tuple(x.shape)}, weight={tuple(weight.shape)}")
    width = weight.shape[1] - 1
    P = pieces_of(x.shape[1], mesh, layout)
    pieces = check_documents(documents, x.shape[0], x.shape[1], mesh, layout)
    xs = x.to(weight.dtype)
    if pieces is not None and width:
        B, T, C = xs.shape
        N = pieces.shape[1]
        if mesh is None or mesh.size() == 1:
            history = xs.new_zeros(P, B, N * width, C)
            ids = [0]
        else:
            kernel = functools.partial(_tail_kernel, pieces=pieces, width=width)
            history = StateChain.apply(kernel, mesh.get_group().group_name, layout, (B, N, width, C), xs)
            history = torch.stack(history.chunk(P, dim=1))  # (P, B, N width, C)
            ids = chunk_ids(mesh.get_local_rank(), mesh.size(), layout)
        outs = [_conv_segments(part, history[i].reshape(B, N, width, C), pieces[:, :, ids[i]], weight, bias)
                for i, part in enumerate(xs.chunk(P, dim=1))]
        return _ACTIVATIONS[activation](torch.cat(outs, dim=1)).to(x.dtype)
    if P == 1 and (mesh is None or mesh.size() == 1):
        padded = [F.pad(xs, (0, 0, width, 0))]
    else:
        if width > x.shape[1] // P:
            raise ValueError(f"a convolution of kernel {width + 1} needs the {width} previous tokens of every piece, but "
                             f"the pieces of layout={layout!r} hold {x.shape[1] // P} tokens; use shorter kernels, fewer "
                             "ranks or longer sequences")
        halos = _Halo.apply(xs, width, mesh.get_group().group_name, layout) if width else None  # (P, B, width, C)
        parts = xs.chunk(P, dim=1)
        padded = [parts[i] if halos is None else torch.cat([halos[i], parts[i]], dim=1) for i in range(P)]
    outs = [F.conv1d(p.transpose(1, 2), weight[:, None], bias, groups=weight.shape[0]).transpose(1, 2) for p in padded]
    return _ACTIVATIONS[activation](torch.cat(outs, dim=1)).to(x.dtype)

