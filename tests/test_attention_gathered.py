"""``gathered_kv_attention``: local queries over K/V that the caller gathered itself (LSS fused
communication). K/V are all-gathered in rank order with torch's autograd all-gather, whose
backward reduce-scatters: the local shards' gradients must equal the full-sequence reference."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._functional_collectives import all_gather_tensor_autograd

from dist_utils import run_distributed
from seqpar_testing import LAYOUTS, compare_to_reference, expected_index_on, make_case, mesh_1d, run_sharded


def _gathered(rank, world, heads):
    from lightning_seqpar.attention import gathered_kv_attention

    mesh = mesh_1d(world)
    group = mesh.get_group()

    def attn(q, k, v, **kw):
        k_all, v_all = (all_gather_tensor_autograd(t.contiguous(), gather_dim=1, group=group) for t in (k, v))
        return gathered_kv_attention(q, k_all, v_all, mesh=mesh, **kw)

    for causal in (True, False):
        for layout in LAYOUTS:
            h_q, h_kv = heads
            case = make_case(2, 8 * world, h_q, h_kv, 8, causal=causal, seed=world)
            index = expected_index_on(mesh, 8 * world, layout)
            got = run_sharded(attn, case, index, causal=causal, layout=layout)
            compare_to_reference(got, case, index, f"W={world} causal={causal} {layout} heads={heads}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_gathered_kv_matches_reference(world, heads):
    run_distributed(_gathered, world, heads)


def _bad_length(rank, world):
    from lightning_seqpar.attention import gathered_kv_attention

    mesh = mesh_1d(world)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="k.shape"):
        gathered_kv_attention(q, q, q, mesh=mesh)


def test_gathered_kv_rejects_local_kv():
    run_distributed(_bad_length, 2)
