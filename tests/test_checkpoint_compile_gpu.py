"""torch.compile (Inductor, ``fullgraph=True``) of checkpointed Llama blocks on one GPU; skipped on CPU.

    pytest -s tests/test_checkpoint_compile_gpu.py

(one process: not under torchrun). ``fullgraph=True`` raises at the first graph break, so each test passing says
the block, its checkpoint, the attention's kernel choice (``attention_backend="auto"``) and the packed documents
trace into one graph with the GPU's own code paths (Note [Checkpoints under torch.compile]); outputs and gradients
against the same block eager in bf16 (atol 8e-3 x the output's scale, the DESIGN bound for W = 1); the attention
forward once per step under Selective Checkpoint++ and twice under full.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_seqpar.parallel.activation_checkpointing import HostOffload, checkpoint_block, compile_target
from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents
from lightning_seqpar.models import LlamaConfig
from lightning_seqpar.models.llama import LlamaBlock, rope_freqs_cis

pytestmark = pytest.mark.gpu

S = 8192
CONFIG = dict(vocab_size=256, n_embd=512, n_layer=1, n_head=8, n_kv_head=2, intermediate_size=1408)


def _step(block, x0, freqs, documents):
    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with packed_documents(documents):
        y = block(x, freqs)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in block.parameters()]


@pytest.mark.parametrize(("mode", "offload", "attention_forwards"),
                         [("selective++", False, 1), ("full", False, 2), ("selective++", True, 1)])
def test_checkpointed_block_compiles_fullgraph_on_gpu(mode, offload, attention_forwards, monkeypatch):
    import torch._dynamo

    from test_checkpoint_compile import _count_attention_forwards

    torch._dynamo.reset()
    calls = _count_attention_forwards(monkeypatch)
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    plain = LlamaBlock(config).to("cuda", torch.bfloat16)
    eager = checkpoint_block(plain, mode, offload=HostOffload() if offload else None)
    compiled = checkpoint_block(copy.deepcopy(plain), mode, offload=HostOffload() if offload else None)
    compile_target(compiled).compile(fullgraph=True)
    x0 = torch.randn(1, S, config.n_embd, device="cuda", dtype=torch.bfloat16)
    for lengths in ([[1000, 3000, 4192]], None, [[4096, 4096]], [[8192]]):
        documents = None if lengths is None else PackedDocuments.from_lengths(lengths)
        positions = (torch.arange(S)[None] if documents is None else documents.position_ids()).to("cuda")
        freqs = rope_freqs_cis(positions, head_dim=config.head_dim, theta=config.rope_theta)
        expected = _step(eager, x0, freqs, documents)
        calls["n"] = 0
        got = _step(compiled, x0, freqs, documents)
        assert calls["n"] == attention_forwards, f"{mode}: the attention ran {calls['n']} times in one step"
        for i, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, atol=8e-3 * float(e.abs().max()), rtol=1e-2,
                                       msg=lambda m, i=i: f"{mode} offload={offload}, documents {lengths}, tensor {i}: {m}")
