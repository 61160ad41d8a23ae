"""The CPU optimizer step of ``offload_params`` (Note [Offloading parameters to host memory]):
fused AdamW chosen for offloaded parameters, the step's thread count raised and restored, and the
fused CPU kernel's arithmetic against torch's default on FSDP2's DTensor shards. The whole path
on a GPU: tests/test_activation_checkpointing_gpu.py::test_offload_params_on_gpu_matches_and_frees_the_model_states."""

from __future__ import annotations

import os
import types

import pytest
import torch

from lightning_seqpar import CausalLMModule
from lightning_seqpar.parallel.parallelize import host_optimizer_threads, with_cpu_threads


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_step_runs_with_the_given_threads_and_restores_them(restore_threads):
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.full((4,), 0.5)
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    with_cpu_threads(opt, 2)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))  # after the raise
    opt.step()
    opt.step()
    assert seen == [2, 2] and torch.get_num_threads() == 1
    assert torch.all(w < 1)  # the step ran


def test_threads_are_the_cores_shared_by_the_processes(restore_threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    torch.set_num_threads(1)
    assert host_optimizer_threads(4) == 16 and host_optimizer_threads(1) == 64 and host_optimizer_threads(0) == 64
    assert host_optimizer_threads(128) == 1
    torch.set_num_threads(3)  # a larger OMP_NUM_THREADS than the share is kept
    assert host_optimizer_threads(64) == 3


def _module_on(root: str, param_device: str) -> tuple[CausalLMModule, torch.nn.Module]:
    module = CausalLMModule("tiny")
    model = torch.nn.Linear(2, 2, device=param_device)
    module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(root)))
    return module, model


def test_fused_is_chosen_for_parameters_offloaded_from_cuda():
    module, model = _module_on("cuda", "cpu")
    assert module._parameters_offloaded(model)
    module, model = _module_on("cpu", "cpu")  # CPU training: not offloaded, torch's default stays
    assert not module._parameters_offloaded(model)
    module._trainer = None
    assert not module._parameters_offloaded(model)


def test_fused_cpu_adamw_on_dtensor_shards_matches_the_default():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        values = [torch.randn(s, generator=g) for s in ((8, 4), (4,), (16, 8))]
        grads = [[torch.randn(v.shape, generator=g) for v in values] for _ in range(3)]
        out = {}
        for fused in (True, False):
            params = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values]
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused or None)
            for step in grads:
                for p, gr in zip(params, step):
                    p.grad = distribute_tensor(gr.clone(), mesh, [Shard(0)])
                opt.step()
            out[fused] = [p.full_tensor() for p in params]
        for a, b, v in zip(out[True], out[False], values):
            assert (a - v).abs().mean() > 5e-3  # three steps at lr 1e-2 moved the weights
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    finally:
        if owned:
            dist.destroy_process_group()
