"""Offloading checkpointed block inputs on a GPU: the side-stream copies to pinned host memory
(in pieces) and back give the same loss and gradients, and the GPU memory held between forward
and backward drops by the offloaded inputs; skipped on CPU.

    pytest -s tests/test_checkpointing_gpu.py

A 4-block Llama (d = 1024, S = 8192, fp32 with TF32 off, so that the only difference between
the runs is the summation order of the tiled MLP) on one GPU; the last block is left
uncheckpointed, so three inputs of 8192 x 1024 x 4 bytes (32 MiB each) go to the host.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.parallelize import apply_ac, apply_mlp_tiles

pytestmark = pytest.mark.gpu

S, D, LAYERS = 8192, 1024, 4


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(ids).float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base  # what forward leaves for backward (logits included)
    loss.backward()
    torch.cuda.synchronize()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, held


@pytest.mark.parametrize("mode", ["full", "selective++"])
@pytest.mark.parametrize("piece_bytes,chunk", [(1 << 28, None), (1 << 20, 1000)])
def test_offload_on_gpu_is_exact_and_frees_the_inputs(mode, piece_bytes, chunk):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, n_embd=D, n_layer=LAYERS, n_head=8, n_kv_head=2, intermediate_size=2816, max_seq_len=S)
    base = Llama(cfg).cuda()
    ids = torch.randint(0, 256, (1, S), device="cuda")
    plain = copy.deepcopy(base)
    apply_mlp_tiles(plain, chunk)
    apply_ac(plain, mode, uncheckpointed_blocks=1)
    offloaded = copy.deepcopy(base)
    apply_mlp_tiles(offloaded, chunk)
    apply_ac(offloaded, mode, uncheckpointed_blocks=1, offload=True)
    host = offloaded.layers[0].checkpoint_fn.keywords["offload"]
    host.piece_bytes = piece_bytes
    loss_p, grads_p, held_p = _run(plain, ids)
    loss_o, grads_o, held_o = _run(offloaded, ids)
    torch.testing.assert_close(loss_o, loss_p, rtol=1e-6, atol=0)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_o[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    inputs = 3 * S * D * 4  # three checkpointed blocks' inputs, fp32
    assert host.packed_bytes == inputs
    print(f"[offload-gpu] {mode} piece={piece_bytes} chunk={chunk}: held after forward {held_p / 2**20:.0f} MiB "
          f"-> {held_o / 2**20:.0f} MiB (inputs {inputs / 2**20:.0f} MiB)", flush=True)
    assert held_p - held_o >= 0.9 * inputs
