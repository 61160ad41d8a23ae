import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import close_pools, pool_threads  # noqa: E402


# Note [Test groups]
# ~~~~~~~~~~~~~~~~~~
# Every test is in one of three groups (markers registered in pyproject.toml):
# * ``gpu``: marked by hand; skipped without CUDA.
# * ``distributed``: runs several processes (the gloo worker pools of dist_utils, torchrun, the
#   ``nccl_world`` fixture). Marked here, at collection, from what the test runs: its function, its
#   fixtures and the module-level helpers they call (transitively, also in the tests' helper modules)
#   name ``run_distributed`` / ``get_pool`` / ``DistPool`` / ``nccl_world`` or ``torch.distributed.run``.
# * ``unit``: everything else: one process, CPU, seconds. ``pytest -m unit`` (the same as
#   ``-m "not distributed and not gpu"``) is the fast first stage of CI.
_LAUNCHERS = frozenset({"run_distributed", "get_pool", "DistPool", "nccl_world"})
_LAUNCHER_STRINGS = ("torch.distributed.run", "torchrun")


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _code_objects(const)


def _launches_processes(obj, seen: set[int]) -> bool:
    """Whether ``obj`` (a function, or a pytest fixture) runs other processes, following the functions it names."""
    import inspect
    import sys

    obj = getattr(obj, "__pytest_wrapped__", None) and obj.__pytest_wrapped__.obj or obj  # a fixture's function
    obj = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(obj, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    tests_dir = os.path.dirname(__file__)
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    for c in _code_objects(code):
        names = set(c.co_names) | set(c.co_varnames)
        if names & _LAUNCHERS or any(isinstance(k, str) and any(x in k for x in _LAUNCHER_STRINGS) for k in c.co_consts):
            return True
        for name in c.co_names:
            target = getattr(module, name, None)
            if target is not None and os.path.dirname(getattr(inspect.getmodule(target), "__file__", "") or "") == tests_dir:
                if _launches_processes(target, seen):
                    return True
    return False


def _mark_groups(items) -> None:
    import inspect

    distributed, unit = pytest.mark.distributed, pytest.mark.unit
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        module = inspect.getmodule(function)
        fixtures = [getattr(module, name, None) for name in getattr(item, "fixturenames", ())]
        if "nccl_world" in getattr(item, "fixturenames", ()) or any(
                _launches_processes(f, set()) for f in (function, *fixtures) if f is not None):
            item.add_marker(distributed)
        elif "gpu" not in item.keywords and "slow" not in item.keywords:
            item.add_marker(unit)


# Note [Slow tests first]
# ~~~~~~~~~~~~~~~~~~~~~~~
# pytest-xdist's worksteal hands each worker a contiguous share of the collection and lets an idle
# worker take half of another's pending tests; a test that starts last runs alone, one core idle.
# The tests below (real process launches: torchrun, `seqpar fit`, Lightning's launcher; torch.compile;
# 8-rank pools) take 15-50 s each on a loaded 2-core machine, so they go to the front of the collection
# (in this order, the rest in theirs): they start while the short ones fill the other worker. Order
# only: every test still runs.
SLOW_FIRST = (
    "tests/test_multinode.py::",
    "tests/test_fault_tolerance.py::",
    "tests/test_benchmarks_cpu.py::test_longest_passes_offload_params_through",
    "tests/test_benchmarks_cpu.py::test_train_several_lengths_in_one_process",
    "tests/test_benchmarks_driver.py::test_driver_runs_a_suite_within_its_budget",
    "tests/test_cli.py::test_console_script_two_processes",
    "tests/test_parity.py::test_training_parity_compile",  # Inductor; then the compile pool's other tests of the file,
    "tests/test_parity.py::test_training_parity_mlp_tiles_compiled_without_checkpointing",  # on the same worker (one pool)
    "tests/test_parity.py::test_training_parity_offload_params_compiled",
    "tests/test_checkpoint_compile.py::test_parallelize_compiles_checkpointed_and_offloaded_blocks",
    "tests/test_checkpoint_compile.py::test_strategy_trains_compiled_checkpointed_and_offloaded_blocks_like_one_device",
    "tests/test_hf_hybrid.py::test_more_families_train_exactly_under_the_strategy",
    "tests/test_attention.py::test_eight_ranks_match_full_sequence_attention",
    "tests/test_hf_support.py::test_ci_subset_is_exact_or_refused",
    "tests/test_resources.py::test_ten_fits_in_one_process_release_threads_descriptors_and_the_default_group",
)


def _slow_first(items) -> None:
    def rank(item) -> int:
        nodeid = item.nodeid if item.nodeid.startswith("tests/") else "tests/" + item.nodeid
        return next((i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


def pytest_collection_modifyitems(config, items):
    import torch

    _mark_groups(items)
    _slow_first(items)

    if config.pluginmanager.hasplugin("rerunfailures"):
        # A test whose gloo worker died from a signal (dist_utils.WorkerCrashed: a native crash, not
        # an assertion or a Python error) runs once more on a fresh pool; pytest reports the rerun.
        rerun = pytest.mark.flaky(reruns=1, only_rerun=["WorkerCrashed"])
        for item in items:
            item.add_marker(rerun)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; recorded from runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, Lightning, transformers, the package, the test modules):
    the strategy runs the cycle collector twice per fit (Note [What a run releases]), and tests run
    it too; a collection that scans those ~450,000 objects cost 0.2-0.5 s each time. Frozen objects
    are left out of it; everything a test creates is not frozen. (Pooled workers do the same.)"""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test and its fixtures' teardown, what is left alive is frozen as well, once a collection has freed
    the test's cycles: the modules that tests import (transformers' model files, torch's and Lightning's submodules)
    and the fixtures kept for later tests, which each collection of the later tests (the strategy runs two per fit)
    scanned again. The pools' workers do the same after each task (Note [Frozen between tasks] in dist_utils)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def nccl_world() -> int:
    """The NCCL world of a ``torchrun --nproc_per_node=N -m pytest`` run (GPU tests); skips elsewhere."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("needs CUDA and torchrun with WORLD_SIZE > 1")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    yield dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()


_POOL_THREADS = pytest.StashKey[object]()


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools(request):
    yield
    try:  # counted before the pools close; printed by pytest_terminal_summary
        request.config.stash[_POOL_THREADS] = pool_threads()
    except Exception as error:  # noqa: BLE001 - a broken pool must not hide the test results
        request.config.stash[_POOL_THREADS] = f"could not count threads ({error})"
    close_pools()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line with the thread count of every live pool worker (a leak of process groups shows here)."""
    counts = config.stash.get(_POOL_THREADS, None)
    if isinstance(counts, str):
        terminalreporter.write_line(f"gloo pool workers: {counts}")
    elif counts:
        terminalreporter.write_line("gloo pool worker threads at the end (pool-world: per rank): "
                                    + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
