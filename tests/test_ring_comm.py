"""The ring moves K/V with their own H_kv heads, never repeated to H_q (GQA/MQA without KV repeat).

``torch.distributed.batch_isend_irecv`` is the ring's only communication call: it is wrapped
with a recorder during the forward, and the sizes of the tensors sent are checked against
B * S_local * H_kv * D (one K or V shard).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import expected_index_on, make_case, mesh_1d, record_p2p, take

BATCH = 2
SEQ_LEN = 40  # S_local = 10 at W = 4 (no size coincides with a head count)
HEAD_DIM = 4
WORLD = 4


def _ring_forward_traffic_worker(rank: int, world_size: int, h_q: int, h_kv: int) -> dict[str, int]:
    from lightning_seqpar.sharding.agreement import RankAgreement
    from lightning_seqpar.attention import sequence_parallel_attention

    mesh = mesh_1d(world_size)
    s_local = SEQ_LEN // world_size
    kv_shard = BATCH * s_local * h_kv * HEAD_DIM
    q_shard = BATCH * s_local * h_q * HEAD_DIM
    totals = {}
    for causal, layout in ((True, "zigzag"), (True, "contiguous"), (False, "zigzag")):
        label = f"H_q={h_q} H_kv={h_kv} causal={causal} layout={layout} rank={rank}"
        case = make_case(BATCH, SEQ_LEN, h_q, h_kv, HEAD_DIM, causal=causal)
        index = expected_index_on(mesh, SEQ_LEN, layout)
        q, k, v = (take(t, index).requires_grad_() for t in (case.q, case.k, case.v))
        # the first call with an agreement also all-gathers the ranks' input signatures (Note [Inputs that differ across ranks])
        agreed = RankAgreement()
        sequence_parallel_attention(q.detach(), k.detach(), v.detach(), mesh=mesh, algorithm="ring", causal=causal, layout=layout,
                                    agreement=agreed)
        with record_p2p() as (record, ops):
            out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm="ring", causal=causal, layout=layout, agreement=agreed)
        assert record.calls > 0, (
            f"{label}: the ring forward never called torch.distributed.batch_isend_irecv "
            f"(dispatcher saw {sorted(set(ops.ops))})"
        )
        other = sorted({op for op in ops.ops if not op.startswith(("c10d.send", "c10d.recv"))})
        assert not other, f"{label}: the ring forward ran other collectives besides P2P: {other}"
        for numel, shape in zip(record.sent_numel, record.sent):
            assert numel % kv_shard == 0, f"{label}: sent {tuple(shape)} ({numel} elements), not a multiple of one K/V shard ({kv_shard})"
            assert numel != q_shard, f"{label}: sent an H_q-headed tensor {tuple(shape)}"
        total = sum(record.sent_numel)
        expected = (world_size - 1) * 2 * kv_shard
        assert total == expected, f"{label}: sent {total} elements in the forward, expected (W-1)*2*B*S_local*H_kv*D = {expected}"
        assert sum(record.received_numel) == total, f"{label}: received {sum(record.received_numel)} != sent {total}"
        # the recorded run is also a correct run
        torch.testing.assert_close(out, take(case.out, index).float(), atol=2e-6, rtol=1e-5)
        totals[f"{causal}-{layout}"] = total
    return totals


@pytest.mark.parametrize(("h_q", "h_kv"), [(8, 2), (4, 1)], ids=["GQA-8-2", "MQA-4-1"])
def test_ring_sends_only_kv_heads(h_q, h_kv):
    results = run_distributed(_ring_forward_traffic_worker, WORLD, h_q, h_kv)
    assert all(r == results[0] for r in results), f"ranks sent different amounts: {results}"
