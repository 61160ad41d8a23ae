"""torch.compile(fullgraph=True) of the attention: no graph break, same forward and backward as eager."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import expected_index_on, make_case, mesh_1d, take

BATCH, SEQ_LEN, H_Q, H_KV, HEAD_DIM = 1, 16, 4, 2, 8
COMPILE_TIMEOUT = 420.0  # inductor builds C++ on CPU; two ranks share two cores


def _setup_compile() -> None:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    inductor_config.compile_threads = 1  # no compile worker pool next to the gloo ranks


def _eager_and_compiled(fn, case, index):
    """(out, dq, dk, dv) of ``fn`` eager and compiled (fullgraph), on this rank's shards."""
    results = []
    for f in (fn, torch.compile(fn, backend="inductor", fullgraph=True)):
        q, k, v = (take(t, index).detach().requires_grad_() for t in (case.q, case.k, case.v))
        out = f(q, k, v)
        out.backward(take(case.grad_out, index))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    return results


def _compile_worker(rank: int, world_size: int, algorithm: str, head_chunks: int = 1) -> None:
    from lightning_seqpar.attention import sequence_parallel_attention

    _setup_compile()
    mesh = mesh_1d(world_size)
    layout = "zigzag"
    case = make_case(BATCH, SEQ_LEN, H_Q, H_KV, HEAD_DIM, causal=True, seed=3)
    index = expected_index_on(mesh, SEQ_LEN, layout)

    def f(q, k, v):
        out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=algorithm, causal=True, layout=layout, head_chunks=head_chunks)
        return torch.tanh(out) * 2.0 + 1.0

    eager, compiled = _eager_and_compiled(f, case, index)
    for name, e, c in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert c is not None, f"{algorithm}: compiled {name} is None"
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{algorithm} compiled vs eager {n}\n{m}")


@pytest.mark.parametrize(("algorithm", "head_chunks"), [("ring", 1), ("allgather", 1), ("ulysses", 1), ("ring", 2)])
def test_compiled_matches_eager(algorithm, head_chunks):
    run_distributed(_compile_worker, 2, algorithm, head_chunks, timeout=COMPILE_TIMEOUT, pool="compile")


def test_local_attention_compiles_fullgraph():
    from lightning_seqpar.attention import local_attention

    _setup_compile()
    case = make_case(BATCH, SEQ_LEN, H_Q, H_KV, HEAD_DIM, causal=True, seed=4)
    full = torch.arange(SEQ_LEN)

    def f(q, k, v):
        return torch.tanh(local_attention(q, k, v, causal=True)) * 2.0 + 1.0

    eager, compiled = _eager_and_compiled(f, case, full)
    for name, e, c in zip(("out", "dq", "dk", "dv"), eager, compiled):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"local compiled vs eager {n}\n{m}")
