"""How a benchmark script finds its device and, under torchrun, its sequence-parallel mesh."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def device_and_mesh(device_type: str) -> tuple[torch.device, object | None, int, int]:
    """(device, 1-D mesh named "sp" or None, rank, world) for a plain launch (world 1) or torchrun (WORLD_SIZE > 1:
    the process group is initialised here, NCCL on CUDA, gloo on the CPU)."""
    world, mesh, rank = int(os.environ.get("WORLD_SIZE", "1")), None, 0
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("sp",))
    return device, mesh, rank, world
