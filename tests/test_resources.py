"""Every Trainer run releases what the strategy created (Note [What a run releases] in lightning_seqpar/parallel/resources.py).

Ten consecutive fits in one process, each with a new strategy, Trainer and module (as a user's
script or notebook runs them), keep the process's threads, open file descriptors and resident
memory within a small bound (a run's groups live as long as its module; the module is freed):

* world 1, in a fresh Python process (the strategy creates the default process group, and
  destroys it again);
* world 2, on the pooled gloo ranks (the default group belongs to the worker and stays).

Before the fix every fit left its five mesh groups behind: +15 threads and +20 file descriptors
per fit on gloo (2 ``pt_gloo_runloop`` + 1 ``gloo_tcp_loop`` threads per group).

The bounds, measured from the state after the second fit (the first one loads code, creates
torch's intra-op pool and Lightning's lazily built objects once per process):

* threads: at most ``THREAD_SLACK`` more, and no more ``pt_gloo_runloop`` (the test drops each
  fit's module and runs the cycle collector, as the next fit's teardown would);
* file descriptors: at most ``FD_SLACK`` more;
* RSS: at most ``RSS_SLACK_MB`` MiB more over eight fits (the allocator keeps some freed pages;
  a leak of a tiny model's state per fit would still be far below it, so the thread and
  descriptor bounds are the sharp ones).

On one GPU (``@pytest.mark.gpu``): ``torch.cuda.memory_allocated`` returns to its value before
the fit once the run's objects are gone, and pinned host memory taken by ``offload_checkpoints``
and ``offload_params`` is given back (torch's pinned-memory cache is emptied in teardown).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_distributed, thread_names

TESTS = Path(__file__).parent
FITS = 10
THREAD_SLACK = 2
FD_SLACK = 4
RSS_SLACK_MB = 64


def _usage() -> dict[str, Any]:
    import torch.distributed as dist

    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    names = thread_names()
    return {"threads": sum(names.values()), "names": names, "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
            "initialized": dist.is_available() and dist.is_initialized()}


def _one_fit(world_size: int, *, module: Any = None, strategy: Any = None, then_validate: bool = False) -> Any:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    strategy = strategy or SequenceParallelStrategy(sequence_parallel_size=world_size, attention="ring", timeout=60)
    module = module or CausalLMModule("tiny", warmup_steps=0, max_steps=1)  # one step: a fit's set-up and release are measured
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    data = DataLoader(CopyTaskDataset(vocab_size=256, seq_len=32, num_samples=2 * world_size, supervise="all"), batch_size=2)
    trainer.fit(module, train_dataloaders=data)
    if then_validate:  # the same Trainer (and strategy) on the same module: its meshes are reused
        module.usage_after_fit = _usage()
        trainer.validate(module, dataloaders=data)
    return module


def _fits(rank: int, world_size: int, n: int) -> list[dict[str, Any]]:
    """``n`` fits, each with a new strategy, Trainer and module; the usage after each."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import gc

    usage = [_usage()]
    for _ in range(n):
        _one_fit(world_size)  # the module is dropped; the next fit's teardown would free it
        gc.collect()  # free it now (and with it its groups: Note [What a run releases])
        usage.append(_usage())
    return usage


def _check_bounded(usage: list[dict[str, Any]], *, default_group_after: bool) -> None:
    start = usage[2]  # after the second fit
    for i, after in enumerate(usage[3:], start=3):
        where = f"after fit {i} (fit 2: {start['threads']} threads {start['names']}, fit {i}: {after['names']})"
        assert after["threads"] <= start["threads"] + THREAD_SLACK, where
        assert after["names"].get("pt_gloo_runloop", 0) <= start["names"].get("pt_gloo_runloop", 0), where
        assert after["fds"] <= start["fds"] + FD_SLACK, f"{where}: {start['fds']} -> {after['fds']} file descriptors"
        assert after["initialized"] is default_group_after
    growth = usage[-1]["rss_mb"] - start["rss_mb"]
    assert growth <= RSS_SLACK_MB, f"RSS grew by {growth:.1f} MiB from fit 2 to fit {len(usage) - 1}"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    return env


def fits_to_file(path: str) -> None:
    """Run in a process of its own: the usage after every fit, to ``path`` (json)."""
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects frozen out of the collector's scans, as in the pooled workers (dist_utils.py)
    usage = _fits(0, 1, FITS)
    with open(path, "w") as f:
        json.dump(usage, f)


@pytest.mark.timeout(600)
def test_ten_fits_in_one_process_release_threads_descriptors_and_the_default_group(tmp_path):
    # a process of its own with no process group, forked from the pools' server (Note [Processes forked
    # from the server] in dist_utils: the fork server imported torch and the package, and ran nothing)
    from dist_utils import ForkedProcess

    log, out = tmp_path / "fits.log", tmp_path / "usage.json"
    with ForkedProcess(fits_to_file, (str(out),), _env(), str(log)) as proc:
        assert proc.wait(timeout=540) == 0, log.read_text()[-4000:]
    usage = json.loads(out.read_text())
    assert len(usage) == FITS + 1
    assert not usage[0]["initialized"]
    _check_bounded(usage, default_group_after=False)  # the strategy created the default group, and destroyed it


@pytest.mark.timeout(600)
def test_ten_fits_on_two_pooled_ranks_stay_bounded():
    for usage in run_distributed(_fits, 2, FITS, timeout=540):
        assert usage[0]["initialized"]
        _check_bounded(usage, default_group_after=True)  # the worker's default group is not the strategy's


def _failed_setup_and_reuse(rank: int, world_size: int) -> dict[str, Any]:
    """A fit whose set-up fails after the mesh exists; then fit + validate (one Trainer) + full state dict of one module."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import gc

    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_seqpar import SequenceParallelStrategy

    class NoBlocks(L.LightningModule):  # setup() refuses it (no transformer blocks) after the mesh was built
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.head(batch["input_ids"].float()[:, :4]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out: dict[str, Any] = {}
    _one_fit(world_size)  # warm-up: per-process state that the first fit creates
    gc.collect()
    out["before"] = _usage()
    strategy = SequenceParallelStrategy(sequence_parallel_size=world_size, attention="ring", timeout=60)
    try:
        _one_fit(world_size, module=NoBlocks(), strategy=strategy)
    except ValueError as error:
        out["error"] = str(error)
    out["after_failure"] = _usage()
    module = _one_fit(world_size, then_validate=True)
    out["after_fit"] = module.usage_after_fit
    out["after_validate"] = _usage()
    # the module's groups outlive the run: its full state can be gathered after fit
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_shapes"] = {k: tuple(v.shape) for k, v in state.items() if k.endswith("embed_tokens.weight")}
    del module, state
    gc.collect()
    out["after_release"] = _usage()
    return out


def test_a_failed_setup_releases_and_a_module_keeps_its_groups_while_it_lives():
    for rank, out in enumerate(run_distributed(_failed_setup_and_reuse, 2, timeout=300)):
        assert "found no transformer blocks in NoBlocks" in out["error"]
        runloops = {k: out[k]["names"].get("pt_gloo_runloop", 0) for k in ("before", "after_failure", "after_fit",
                                                                             "after_validate", "after_release")}
        assert runloops["after_failure"] <= runloops["before"], runloops  # the failed run's groups are gone
        assert runloops["after_validate"] == runloops["after_fit"], runloops  # validate reused the module's meshes
        # the module freed: its five groups too (torch may hold on to one destroyed group's objects a
        # while longer: at most 2 runloop threads, not more with more fits, as the ten-fits tests show)
        assert runloops["after_release"] <= runloops["before"] + 2, runloops
        assert runloops["after_release"] < runloops["after_fit"], runloops
        assert out["after_release"]["fds"] <= out["before"]["fds"] + 2 * FD_SLACK, out  # as above: one group's sockets
        assert out["after_release"]["fds"] < out["after_fit"]["fds"], out
        if rank == 0:  # the full state dict (cpu_offload=True) is gathered to rank 0
            assert out["full_shapes"] == {"embed_tokens.weight": (256, 64)}, out["full_shapes"]


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_fit(**strategy_kwargs: Any) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    strategy = SequenceParallelStrategy(sequence_parallel_size=1, timeout=60, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=3, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    data = DataLoader(CopyTaskDataset(vocab_size=256, seq_len=256, num_samples=8, supervise="all"), batch_size=2)
    trainer.fit(CausalLMModule("tiny", warmup_steps=0, max_steps=3), train_dataloaders=data)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["offload_checkpoints", "offload_params"])
def test_gpu_memory_and_pinned_host_memory_return_to_baseline(offload):
    import gc

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("one process (run without torchrun)")
    warnings.filterwarnings("ignore")
    torch.cuda.init()
    _gpu_fit()  # warm-up: CUDA context, cuBLAS workspaces, kernels loaded once per process
    gc.collect()
    allocated = torch.cuda.memory_allocated()
    host_stats = getattr(torch.cuda, "host_memory_stats", None)  # the pinned allocator's statistics (newer torch)
    pinned = host_stats()["allocated_bytes.current"] if host_stats is not None else None
    for _ in range(3):
        _gpu_fit(**{offload: True})
        gc.collect()  # the Trainer and module of the fit (reference cycles) are gone
        assert torch.cuda.memory_allocated() == allocated
        # nothing of the run holds pinned host memory any more: no live pinned tensor, and what torch's
        # caching host allocator still counts (blocks freed while a copy's event was pending, kept for
        # reuse, as the device allocator keeps its blocks) goes back once the cache is emptied, as the
        # strategy does at the start and end of every run (Note [What a run releases])
        live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.is_pinned()]
        assert not live, [tuple(t.shape) for t in live[:5]]
        if host_stats is not None and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
            assert host_stats()["allocated_bytes.current"] <= pinned, host_stats()
        assert not torch.distributed.is_initialized()
    if host_stats is None:
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.host_memory_stats: pinned memory not measured "
                    "(device memory was)")


class _Setter:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.error = error

    def __call__(self, conf: str) -> None:
        self.calls.append(conf)
        if self.error is not None:
            raise self.error


def _fake_allocator(monkeypatch, env: str | None) -> _Setter:
    """A recording stand-in for torch's allocator-settings call; PYTORCH_CUDA_ALLOC_CONF = ``env`` (None: unset)."""
    setter = _Setter()
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if env is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    return setter


@pytest.mark.parametrize("env", [None, "expandable_segments:True"])
def test_offloading_on_cuda_pins_host_memory_on_eight_threads(monkeypatch, env):
    # Note [Pinning host memory in parallel]: torch's documented keys, set only for CUDA and only these keys
    from lightning_seqpar.parallel.resources import PARALLEL_PINNING, pinning_in_effect, prefer_parallel_pinning

    setter = _fake_allocator(monkeypatch, env)
    assert prefer_parallel_pinning(torch.device("cpu")) is False and setter.calls == []
    monkeypatch.setattr("lightning_seqpar.parallel.resources._SET", {})
    assert pinning_in_effect() == "default (cudaHostAlloc)"
    assert prefer_parallel_pinning(torch.device("cuda", 0)) is True
    assert setter.calls == [PARALLEL_PINNING] and pinning_in_effect() == PARALLEL_PINNING
    assert PARALLEL_PINNING == "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_pinned_settings_win(monkeypatch, var):
    from lightning_seqpar.parallel.resources import pinning_in_effect, prefer_parallel_pinning

    setter = _Setter()
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.setattr("lightning_seqpar.parallel.resources._SET", {})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "expandable_segments:True,pinned_use_cuda_host_register:False")
    assert prefer_parallel_pinning(torch.device("cuda", 0)) is False
    assert setter.calls == [] and pinning_in_effect() == "pinned_use_cuda_host_register:False"


@pytest.mark.parametrize("prefer, key, warning", [
    ("prefer_parallel_pinning", "pinned_use_cuda_host_register", "pinned host memory stays on one thread"),
    ("prefer_expandable_segments", "expandable_segments", "device memory keeps torch's fixed segments")])
def test_an_allocator_refusing_the_keys_warns_and_leaves_it_alone(monkeypatch, prefer, key, warning):
    import lightning_seqpar.parallel.resources as resources

    setter = _Setter(RuntimeError(f"Unrecognized key '{key}' in CUDA allocator config."))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.warns(UserWarning, match=warning):
        assert getattr(resources, prefer)(torch.device("cuda", 0)) is False
    assert len(setter.calls) == 1


def test_the_strategy_turns_parallel_pinning_on_only_when_it_offloads(monkeypatch):
    # the strategy's set-up calls it with the root device exactly when checkpoints go to the host
    import lightning_seqpar.strategy as strategy_module
    from lightning_seqpar import SequenceParallelStrategy

    seen: list[torch.device] = []
    monkeypatch.setattr(strategy_module, "prefer_parallel_pinning", lambda device: seen.append(device) or False)
    for offload, expected in ((False, 0), (True, 1)):
        seen.clear()
        _one_fit(1, strategy=SequenceParallelStrategy(sequence_parallel_size=1, memory="manual", timeout=60,
                                                      activation_checkpointing="full", offload_checkpoints=offload))
        assert len(seen) == expected and all(d.type == "cpu" for d in seen), (offload, seen)


@pytest.mark.parametrize("env", [None, "pinned_use_cuda_host_register:True", "expandable_segments:False"])
def test_cuda_runs_grow_expandable_segments_unless_the_user_says(monkeypatch, env):
    # Note [Expandable segments by default]: set for CUDA only, and never over the user's own key
    from lightning_seqpar.parallel.resources import EXPANDABLE_SEGMENTS, prefer_expandable_segments, segments_in_effect

    setter = _fake_allocator(monkeypatch, env)
    monkeypatch.setattr("lightning_seqpar.parallel.resources._SET", {})
    assert prefer_expandable_segments(torch.device("cpu")) is False and setter.calls == []
    users = env is not None and env.startswith("expandable_segments")
    assert segments_in_effect() == (env if users else "default (fixed segments)")
    assert prefer_expandable_segments(torch.device("cuda", 0)) is (not users)
    assert setter.calls == ([] if users else [EXPANDABLE_SEGMENTS])
    assert segments_in_effect() == (env if users else "expandable_segments:True")


def test_every_run_of_the_strategy_asks_for_expandable_segments_on_its_device(monkeypatch):
    import lightning_seqpar.strategy as strategy_module
    from lightning_seqpar import SequenceParallelStrategy

    seen: list[torch.device] = []
    monkeypatch.setattr(strategy_module, "prefer_expandable_segments", lambda device: seen.append(device) or False)
    _one_fit(1, strategy=SequenceParallelStrategy(sequence_parallel_size=1, memory="manual", timeout=60))
    assert [d.type for d in seen] == ["cpu"]
