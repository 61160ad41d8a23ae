"""Head-parallel attention (DeepSpeed-Ulysses; LoongTrain §4.2) and its all-to-alls.

Note [Ulysses]
~~~~~~~~~~~~~~
An all-to-all turns sequence shards into head shards: rank p gives up all but heads
[p*H/P, (p+1)*H/P) of its tokens and receives those heads for every token. Each rank then runs
ordinary attention over the whole sequence for its heads, and a second all-to-all turns the
output back into sequence shards.

    [B, S/P, H, D] --a2a--> [B, S, H/P, D] --attention--> [B, S, H/P, D] --a2a--> [B, S/P, H, D]

The gathered sequence arrives in rank order: under zigzag it is put into global order (one
index_select) before the causal attention and back after.

GQA: the query heads of one rank must share the K/V heads it holds. When P does not divide H_kv,
each K/V head is repeated r times first (r the smallest divisor of H_q / H_kv with
P | H_kv * r; LoongTrain §4.2), so that query head h still meets K/V head h // (H_q / H_kv).
The repeat's backward sums the gradients of the copies. H_q must be divisible by P.

Two implementations. With sinks, and inside 2D attention (where the inner attention is the ring
over cp), the all-to-alls are torch's functional collectives with autograd around the attention
op (``seq_to_head`` / ``head_to_seq``): they trace under torch.compile and their backward is the
reverse all-to-all. Otherwise Ulysses runs inside one custom op pair (``seqpar::ulysses_fwd`` /
``ulysses_bwd``, registered in ``lightning_seqpar.attention.api``) that overlaps its all-to-alls
with the attention (Note [Overlapped Ulysses]).

Note [Overlapped Ulysses]
~~~~~~~~~~~~~~~~~~~~~~~~~
Done as above, every all-to-all is exposed: the attention waits for all of q, k and v, and the
output's all-to-all waits for all of the attention (measured on 4 x H200, llama3-8b at 128K: 0.23 s
of a 10 s step with the compute stream idle, waiting for the all-to-alls). The heads are
independent, so each rank's heads are cut into ``n`` stages (K/V heads with their query heads,
as Note [Head chunks]); one all-to-all per stage carries the stage's q, k and v together:

    forward:   post a2a(qkv_0)
               stage c: post a2a(qkv_c+1); wait qkv_c; attend c; wait out_c-1; post a2a(out_c)
               wait out_n-1
    backward:  the same with dout_c in and (dq dk dv)_c out

so stage i's attention runs while stage i+1's inputs and stage i-1's outputs travel; only the
first stage's inputs and the last stage's outputs are exposed (1/n of the traffic each way). One
stage runs ahead, so the buffers of at most two stages are alive at a time.
Measured since (2026-11-28, 4 x H200, 128K, one machine; docs/benchmarks.md): with and without the overlap
(SEQPAR_ULYSSES_STAGES=1) the step is the same within 0.3% (Llama-3-8B 3,130 / 3,137 tokens/s/GPU, Qwen3-8B 3,151 /
3,158): an all-to-all of a stage's size takes 0.4-0.6 ms alone, NCCL's kernels get little of it done beside the
attention kernel, and the waits the profile shows are for the slowest GPU. The stages stay: they cost nothing.
Results are bitwise those of one stage: the same kernels on the same heads. The op returns,
beside the output, the head-layout q, k, v, out and lse of every stage, which its backward reads
(autograd saves them as the functional version saves the all-to-alls' outputs; Selective
Checkpoint++ keeps them as it keeps the op's outputs): no all-to-all of the forward is repeated.

Layouts: the received pieces are copied once into the stage's [B, S, h, D] tensors anyway. Under
"contiguous" that copy is in rank order, which is global order. Under zigzag, rank p's shard is
global chunks (p, 2P-1-p): the first halves in rank order are chunks 0..P-1 and the second halves
in reverse rank order are chunks P..2P-1, so the same copy, in two strided halves, puts the
sequence in global order (the functional version uses an index_select, whose backward is an
atomic index_add: 0.11 s of the 10 s step above). The reversed halves are copied one rank at a time: ``flip()``
is not a view in torch, and copying through it cost a second copy of half the traffic (1,024 ``flip`` kernels,
38 ms of a 7.1 s step, 2 x H200, Llama-3-8B at 64K). Zigzag stays the default split under Ulysses:
packed documents need it (their per-document zigzag), and here it costs nothing.

Note [Wide copies]
~~~~~~~~~~~~~~~~~~
Every layout copy above moves rows of h x D contiguous elements between strided places (a stage's heads of each
token, a rank's piece of the sequence), so torch runs them with its generic strided copy kernel, one 2-byte bf16
element per thread step: 3,584 such copies took 130 ms of a 6.9 s step (2 x H200, Llama-3-8B at 64K, 2026-11-28),
several times the time the same bytes take in a contiguous copy. A copy does no arithmetic, so it may move any
same-sized words: ``_copy`` reinterprets both sides as 8-byte words (``Tensor.view(torch.int64)``, a view when the last
dimension is contiguous and every other stride and the offset are whole words; D = 128 bf16 is 32 words) and copies
those: a quarter of the elements, each a wider load, bit for bit the same bytes. Other tensors (an odd row length,
an unaligned view) take the plain copy.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

#: At most this many stages (Note [Overlapped Ulysses]): more hide more of the traffic but make
#: smaller kernels and messages. The environment variable SEQPAR_ULYSSES_STAGES lowers it (1: no
#: overlap), for benchmarks that compare the two on one machine.
MAX_STAGES = 4


def stage_limit() -> int:
    """MAX_STAGES, or SEQPAR_ULYSSES_STAGES when set (a positive int)."""
    value = os.environ.get("SEQPAR_ULYSSES_STAGES")
    if value is None:
        return MAX_STAGES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SEQPAR_ULYSSES_STAGES={value!r}: expected a positive int")
    return int(value)


def _a2a(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x, None, None, group_name))


def seq_to_head(x: torch.Tensor, degree: int, group_name: str) -> torch.Tensor:
    """[B, S_local, H, D] -> [B, degree * S_local, H / degree, D] (sequence in rank order)."""
    B, S, H, D = x.shape
    y = x.reshape(B, S, degree, H // degree, D).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, S, H/P, D)
    y = _a2a(y, group_name)  # y[p]: rank p's tokens, my heads
    return y.permute(1, 0, 2, 3, 4).reshape(B, degree * S, H // degree, D)


def head_to_seq(x: torch.Tensor, degree: int, group_name: str) -> torch.Tensor:
    """[B, degree * S_local, H_local, D] -> [B, S_local, degree * H_local, D]; inverse of seq_to_head."""
    B, S_all, Hl, D = x.shape
    S = S_all // degree
    y = x.reshape(B, degree, S, Hl, D).permute(1, 0, 2, 3, 4).contiguous()  # (P, B, S, Hl, D)
    y = _a2a(y, group_name)  # y[p]: my tokens, rank p's heads
    return y.permute(1, 2, 0, 3, 4).reshape(B, S, degree * Hl, D)


def ulysses_stages(h_kv_local: int, limit: int | None = None) -> int:
    """Stages of the overlapped Ulysses for ``h_kv_local`` K/V heads per rank: the largest divisor up to ``limit``
    (default: :func:`stage_limit`)."""
    limit = stage_limit() if limit is None else limit
    return max(n for n in range(1, min(limit, h_kv_local) + 1) if h_kv_local % n == 0)


_WORD = 8  # bytes: Note [Wide copies]


def _wide(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as int64 words (a view), or None when its rows or strides are not whole words (Note [Wide copies])."""
    size = t.element_size()
    if size >= _WORD or t.dim() == 0 or t.stride(-1) != 1 or (t.shape[-1] * size) % _WORD:
        return None
    if (t.storage_offset() * size) % _WORD or any((st * size) % _WORD for st in t.stride()[:-1]):
        return None
    return t.view(torch.int64)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one dtype and shape, as 8-byte words where both allow it (Note [Wide copies])."""
    wide_dst, wide_src = (_wide(dst), _wide(src)) if dst.dtype == src.dtype else (None, None)
    if wide_dst is not None and wide_src is not None:
        wide_dst.copy_(wide_src)
    else:
        dst.copy_(src)


def _to_gathered(dst: torch.Tensor, src: torch.Tensor, zigzag: bool) -> None:
    """``dst`` [B, P * S, h, D] (global order) <- ``src`` [P, B, S, h, D] (rank p's tokens at p); one copy."""
    P, B, S, h, D = src.shape
    if not zigzag:
        _copy(dst.view(B, P, S, h, D), src.permute(1, 0, 2, 3, 4))
        return
    halves = src.view(P, B, 2, S // 2, h, D)
    d = dst.view(B, 2 * P, S // 2, h, D)
    _copy(d[:, :P], halves[:, :, 0].permute(1, 0, 2, 3, 4))
    for p in range(P):  # the second halves in reverse rank order: a copy each (flip() would copy twice)
        _copy(d[:, 2 * P - 1 - p], halves[p, :, 1])


def _to_ranks(dst: torch.Tensor, src: torch.Tensor, zigzag: bool) -> None:
    """``dst`` [P, B, S, h, D] (rank p's tokens at p) <- ``src`` [B, P * S, h, D] (global order); inverse of ``_to_gathered``."""
    P, B, S, h, D = dst.shape
    if not zigzag:
        _copy(dst, src.view(B, P, S, h, D).permute(1, 0, 2, 3, 4))
        return
    s = src.view(B, 2 * P, S // 2, h, D)
    halves = dst.view(P, B, 2, S // 2, h, D)
    _copy(halves[:, :, 0], s[:, :P].permute(1, 0, 2, 3, 4))
    for p in range(P):  # as _to_gathered: no flip()
        _copy(halves[p, :, 1], s[:, 2 * P - 1 - p])


def _post(send: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, object]:
    recv = torch.empty_like(send)
    return recv, send, dist.all_to_all_single(recv, send, group=group, async_op=True)


def _stage_heads(x: torch.Tensor, P: int, n: int, c: int) -> torch.Tensor:
    """[B, S, P * n * h, D] -> stage c's heads of every rank, [P, B, S, h, D] (a view)."""
    B, S, H, D = x.shape
    return x.view(B, S, P, n, H // (P * n), D)[:, :, :, c].permute(2, 0, 1, 3, 4)


def overlapped_forward(q, k, v, *, group, stages: int, zigzag: bool, local_forward):
    """Ulysses over ``group`` in ``stages`` overlapped stages (Note [Overlapped Ulysses]).

    q: [B, S, Hq, D], k, v: [B, S, Hkv, D] (this rank's sequence shard; P * stages divides Hkv);
    ``zigzag``: put the gathered sequence in global order from the zigzag split;
    ``local_forward(q, k, v) -> (out, lse)`` over the whole sequence for a stage's heads.
    Returns (out [B, S, Hq, D], qh, kh, vh, oh [stages, B, P * S, h, D], lse [stages, B, hq, P * S]).
    One stage ahead is in flight at a time: the buffers of at most two stages live at once.
    """
    P, n = dist.get_world_size(group), stages
    B, S, Hq, D = q.shape
    hq, hk, Dv = Hq // (P * n), k.shape[2] // (P * n), v.shape[-1]

    def post_inputs(c):
        send = q.new_empty((P, B, S, hq + 2 * hk, D))
        _copy(send[..., :hq, :], _stage_heads(q, P, n, c))
        _copy(send[..., hq:hq + hk, :], _stage_heads(k, P, n, c))
        _copy(send[..., hq + hk:, :], _stage_heads(v, P, n, c))
        return _post(send, group)

    def finish_output(c, posted):
        recv, _, work = posted
        work.wait()
        _copy(_stage_heads(out, P, n, c), recv)

    qh, oh = q.new_empty((n, B, P * S, hq, D)), q.new_empty((n, B, P * S, hq, Dv))
    kh, vh = k.new_empty((n, B, P * S, hk, D)), v.new_empty((n, B, P * S, hk, D))
    out = q.new_empty((B, S, Hq, Dv))
    lse, inputs, output = None, post_inputs(0), None
    for c in range(n):
        ahead = post_inputs(c + 1) if c + 1 < n else None  # travels during this stage's attention
        recv, send, work = inputs
        work.wait()
        _to_gathered(qh[c], recv[..., :hq, :], zigzag)
        _to_gathered(kh[c], recv[..., hq:hq + hk, :], zigzag)
        _to_gathered(vh[c], recv[..., hq + hk:, :], zigzag)
        del recv, send, work, inputs
        o, l = local_forward(qh[c], kh[c], vh[c])
        if lse is None:
            lse = l.new_empty((n, *l.shape))
        oh[c].copy_(o)
        lse[c].copy_(l)
        del o, l
        if output is not None:  # the previous stage's output travelled during this attention
            finish_output(c - 1, output)
        send = q.new_empty((P, B, S, hq, Dv))
        _to_ranks(send, oh[c], zigzag)
        output, inputs = _post(send, group), ahead
        del send
    finish_output(n - 1, output)
    return out, qh, kh, vh, oh, lse


def overlapped_backward(dout, qh, kh, vh, oh, lse, *, group, zigzag: bool, local_backward):
    """The backward of :func:`overlapped_forward`: ``dout`` [B, S, Hq, D] -> (dq, dk, dv) of its q, k, v;
    ``local_backward(dout, q, k, v, out, lse) -> (dq, dk, dv)`` for a stage's heads."""
    P, n = dist.get_world_size(group), qh.shape[0]
    B, S, Hq, Dv = dout.shape
    hq, hk, D = qh.shape[3], kh.shape[3], qh.shape[4]

    def post_dout(c):
        send = dout.new_empty((P, B, S, hq, Dv))
        _copy(send, _stage_heads(dout, P, n, c))
        return _post(send, group)

    def finish_grads(c, posted):
        recv, _, work = posted
        work.wait()
        _copy(_stage_heads(dq, P, n, c), recv[..., :hq, :])
        _copy(_stage_heads(dk, P, n, c), recv[..., hq:hq + hk, :])
        _copy(_stage_heads(dv, P, n, c), recv[..., hq + hk:, :])

    dq = qh.new_empty((B, S, Hq, D))
    dk, dv = kh.new_empty((B, S, hk * P * n, D)), vh.new_empty((B, S, hk * P * n, D))
    incoming, grads = post_dout(0), None
    for c in range(n):
        ahead = post_dout(c + 1) if c + 1 < n else None
        recv, send, work = incoming
        work.wait()
        doh = dout.new_empty((B, P * S, hq, Dv))
        _to_gathered(doh, recv, zigzag)
        del recv, send, work, incoming
        g_q, g_k, g_v = local_backward(doh, qh[c], kh[c], vh[c], oh[c], lse[c])
        del doh
        if grads is not None:
            finish_grads(c - 1, grads)
        send = qh.new_empty((P, B, S, hq + 2 * hk, D))
        _to_ranks(send[..., :hq, :], g_q, zigzag)
        _to_ranks(send[..., hq:hq + hk, :], g_k, zigzag)
        _to_ranks(send[..., hq + hk:, :], g_v, zigzag)
        del g_q, g_k, g_v
        grads, incoming = _post(send, group), ahead
        del send
    finish_grads(n - 1, grads)
    return dq, dk, dv
