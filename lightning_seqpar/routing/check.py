"""The check at setup that a user's own model is exact under the split, or its refusal with the cause.

Note [Split against whole at setup]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Routing the SDPA calls (Note [Routing a model's own SDPA calls]) makes attention exact; it cannot
make exact what a model computes from where its tokens sit by other means: positions from
``torch.arange(T)`` inside forward, a table sliced in a way the router does not see, attention
written as ``softmax(q @ k.T)``, a convolution or a scan along the sequence. So before the first
step, on every rank, the strategy runs one short random sequence (``CHECK_TOKENS`` tokens, two
rows; seconds on a CPU) through the model twice, in eval mode and without gradients:

  whole   every rank the whole sequence, SDPA as one process runs it (no collective);
  split   the sequence sharded with the run's layout, the routed attention over the
          sequence-parallel ranks, the block outputs gathered back.

Each block's output must match the whole run's (max |split - whole| / max |whole| under 1e-4 in
fp32, 2e-2 in 16-bit). The first block that does not names the model's defect: the check
counts what the split run did (aranges of the shard's length, blocks that called no SDPA, the
position tables it read at global positions) and refuses the model with the likeliest cause and
what to change, before the first training step. Every rank compares the same gathered tensors,
so every rank raises the same error: nobody waits in a collective. ``check_model=False`` skips
it. Dropout does not take part (eval mode): attention dropout is refused under the split anyway.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_seqpar.routing.sdpa import CheckRecord, Routing
from lightning_seqpar.sharding.layouts import required_multiple, shard_sequence, unshard_sequence

__all__ = ["CHECK_TOKENS", "check_split_matches_whole"]

CHECK_TOKENS = 256
"""Tokens per sequence of the check (fewer where the model takes fewer, rounded to the layout's multiple)."""


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, Tensor)), None)
    if isinstance(out, dict):
        return next((o for o in out.values() if isinstance(o, Tensor)), None)
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, Tensor) else None


def _vocab(root: nn.Module, owner: str) -> int:
    embedding = next((m for m in root.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(f"{owner}: the check of a model's own attention (check_model=True) feeds it token ids, but "
                         f"{type(root).__name__} has no nn.Embedding; pass check_model=False to skip the check")
    return embedding.num_embeddings


def _call(root: nn.Module, ids: Tensor, positions: Tensor) -> Any:
    """``root(ids)``, with ``position_ids`` where its forward takes them (as the batch gives them in training)."""
    try:
        params = inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return root(ids, **({"position_ids": positions} if "position_ids" in params else {}))


def _relative(split: Tensor, whole: Tensor) -> float:
    scale = float(whole.detach().abs().max().clamp_min(1e-6))
    return float((split.detach().float() - whole.detach().float()).abs().max()) / scale


def check_split_matches_whole(routing: Routing, *, blocks: list[nn.Module], owner: str, tokens: int = CHECK_TOKENS) -> CheckRecord:
    """Refuse the model of ``routing`` if its split run differs from its whole run (Note [Split against whole at
    setup]); returns what the split run saw. Collective over the routed attention's mesh (every rank calls it)."""
    root = routing.root
    mesh = routing.attentions[0].mesh
    layout = routing.attentions[0].layout
    assert mesh is not None, "the check runs under sequence parallelism only"
    multiple = required_multiple(mesh, layout)
    vocab = _vocab(root, owner)
    param = next(root.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    was_training = {m: m.training for m in root.modules()}
    outputs: list[Tensor | None] = []
    hooks = [b.register_forward_hook(lambda _m, _a, out: outputs.append(_first_tensor(out))) for b in blocks]
    root.eval()
    try:
        with torch.no_grad():
            length, whole, error = max(multiple, tokens - tokens % multiple), None, None
            while length >= multiple:  # the longest sequence the model takes, up to CHECK_TOKENS
                ids = torch.randint(0, vocab, (2, length), generator=generator).to(device)
                positions = torch.arange(length, device=device).expand(2, length)
                outputs.clear()
                routing.whole = True
                try:
                    whole = _first_tensor(_call(root, ids, positions))
                    break
                except Exception as e:  # noqa: BLE001 - the model's own limit (max positions): try a shorter sequence
                    error = e
                    length = (length // 2) - (length // 2) % multiple
                finally:
                    routing.whole = False
            if whole is None:
                raise ValueError(f"{owner}: the check of a model's own attention could not run {type(root).__name__} on "
                                 f"random token ids ({error!r}); pass check_model=False to skip the check") from error
            whole_blocks = list(outputs)
            local_ids = shard_sequence(ids, mesh, dim=1, layout=layout)  # type: ignore[arg-type]
            local_positions = shard_sequence(positions, mesh, dim=1, layout=layout)  # type: ignore[arg-type]
            local_len = local_ids.shape[1]
            outputs.clear()
            routing.record = record = CheckRecord(local_len=local_len)
            try:
                with routing.step(local_len):
                    split = _first_tensor(_call(root, local_ids, local_positions))
            finally:
                routing.record = None
            split_blocks = list(outputs)
            worst = None
            for i, (w, s) in enumerate(zip(whole_blocks, split_blocks)):
                if w is None or s is None or s.dim() < 2 or s.shape[1] != local_len or w.shape[1] != length:
                    continue
                err = _relative(unshard_sequence(s, mesh, dim=1, layout=layout), w)  # type: ignore[arg-type]
                if err > _tolerance(w.dtype):
                    worst = (i, err)
                    break
            if worst is None and split is not None and whole is not None and split.dim() >= 2 and split.shape[1] == local_len:
                err = _relative(unshard_sequence(split, mesh, dim=1, layout=layout), whole)  # type: ignore[arg-type]
                if err > _tolerance(whole.dtype):
                    worst = (len(blocks), err)
    finally:
        for h in hooks:
            h.remove()
        for m, flag in was_training.items():
            m.train(flag)
    if worst is not None:
        raise ValueError(_refusal(routing, record, worst, blocks=len(blocks), length=length, sp=mesh.size(), owner=owner))
    if record.tables:
        rank_zero_info(f"{owner}: {type(root).__name__} slices position tables by the sequence length; each rank reads them at "
                       f"its tokens' global positions: {', '.join(sorted(record.tables))} (Note [Position tables under the split])")
    return record


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _refusal(routing: Routing, record: CheckRecord, worst: tuple[int, float], *, blocks: int, length: int, sp: int, owner: str) -> str:
    index, err = worst
    where = f"block {index} of {routing.blocks_name}" if index < blocks else "the output after the blocks"
    causes = []
    if record.aranges:
        causes.append(
            f"positions computed inside forward: torch.arange of the shard's length ({record.local_len}) was called "
            f"{record.aranges} time(s), so every rank numbers its tokens from 0. Read position_ids from the batch instead "
            "(the strategy shards them with the tokens: global positions; missing ones are made 0..S-1), e.g. "
            "forward(idx, position_ids) and wpe(position_ids) / freqs_cis[position_ids]")
    silent = [i for i in range(blocks) if not record.sdpa_by_block.get(i)]
    if silent:
        causes.append(
            f"block(s) {silent[:8]} call no F.scaled_dot_product_attention: attention written out (softmax(q @ k.T), "
            "softcapping), flex_attention, or a mixer along the sequence (convolution, scan) sees only its shard; "
            "call F.scaled_dot_product_attention(q, k, v, is_causal=True) in every block")
    if not causes:
        causes.append(
            "something computed from where the tokens sit that the strategy cannot see: a mask or position built from the "
            "local length, a table indexed other than [:T], a cumulative op along the sequence; compute it from the "
            "batch's position_ids (sharded with the tokens)")
    return (f"{owner}: {type(routing.root).__name__} is not exact under sequence parallelism: a {length}-token sequence split "
            f"over {sp} ranks gives outputs of {where} that differ from the whole sequence's (max relative difference "
            f"{err:.2e}; Note [Split against whole at setup]). Likely cause: " + "; ".join(causes) +
            ". SequenceParallelStrategy(check_model=False) skips this check and trains the model as it is.")


def broadcast_initial_weights(root: nn.Module, *, owner: str) -> bool:
    """Give every rank rank 0's parameters and buffers where the ranks built different ones (a model of the user's own
    initialised without a common seed), as DDP does at wrap time; FSDP2 would otherwise shard each rank's own copy.
    One all-gather of a fingerprint; the broadcast only where they differ. Returns whether it broadcast."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    tensors = [t for t in (*root.parameters(), *root.buffers()) if t.is_floating_point() or t.is_complex()]
    if not tensors:
        return False
    device = tensors[0].device
    with torch.no_grad():
        fingerprint = torch.stack([t.detach().double().abs().sum() if not t.is_complex() else t.detach().abs().double().sum()
                                   for t in tensors]).sum().reshape(1).to(device)
        gathered = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, fingerprint)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return False
        for t in tensors:
            dist.broadcast(t.data, src=0)
    rank_zero_info(f"{owner}: the ranks built {type(root).__name__} with different initial weights (no common seed): every rank "
                   "now starts from rank 0's, as DDP does (seed_everything(...) before building the model avoids the broadcast)")
    return True
