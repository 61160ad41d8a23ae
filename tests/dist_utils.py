"""A pool of gloo worker processes for multi-process CPU tests.

Starting a process and importing torch costs seconds, so each world size gets one pool of
workers for the whole test session, forked from a server process that imported torch and the
package once (``_context``). A test sends a module-level function; every rank runs
``fn(rank, world_size, *args)`` and the pool returns the per-rank results. A worker that raises
sends its traceback back (the test fails with it); a run that does not finish within
``timeout`` seconds kills the pool (the next test gets a fresh one) and fails the test, so a
hang never stalls CI.

A worker that dies from a signal (a native crash: SIGSEGV, or SIGABRT from the C allocator's
heap checks) fails the test with ``WorkerCrashed``, naming the rank and the signal, instead of
the other ranks' "connection reset" errors; faulthandler prints the dead rank's Python stack to
the test's captured stderr. conftest.py lets pytest-rerunfailures (a dev dependency) run such a
test once more on a fresh pool, and only such a test: an assertion or a Python exception in a
worker is never rerun, and a second crash fails. Tests that load torch.compile's generated code
run in pools of their own (``pool="compile"``), so that code never shares a process with the rest.

Workers stay clean between tasks: after each one a worker destroys every process group except
its default group (tests that build meshes themselves create groups, each with threads of its
own: without this a worker of a full run grew to over 1,100 threads) and runs the garbage
collector, so that the threads of the destroyed groups end (the objects of torch and the package,
imported once when a worker starts, are frozen out of those collections: scanning them after every
task cost more than the task itself in short tests). ``pool_threads()`` reports the
thread count of each live worker (conftest.py prints it at the end of the session).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT = float(os.environ.get("SEQPAR_TEST_TIMEOUT", "240"))


class WorkerCrashed(RuntimeError):
    """A pooled worker process died from a signal (see the module docstring)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_names() -> dict[str, int]:
    """{thread name: count} of this process, from /proc (Linux)."""
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we listed
            continue
        names[name] = names.get(name, 0) + 1
    return names


def _thread_names_task(rank: int, world_size: int) -> dict[str, int]:
    return thread_names()


def release_task_groups() -> int:
    """Destroy every process group of this process except the default one (the worker's); return how many.

    Reads torch's group registry (``distributed_c10d._world.pg_names``, private: torch has no public
    list of groups), which this test helper may do and the package does not.
    """
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    default = dist.group.WORLD
    groups = [pg for pg in list(dist.distributed_c10d._world.pg_names) if pg is not default and pg != default]
    for pg in groups:
        dist.destroy_process_group(pg)
    if groups:
        from lightning_seqpar.parallel.mesh import forget_cached_meshes

        forget_cached_meshes()  # DTensor's caches would hand an equal mesh of a later task these groups
    gc.collect()  # a group's threads end when its last reference goes (meshes, FSDP state in cycles)
    return len(groups)


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, environ: dict[str, str]) -> None:
    os.environ.clear()  # the test process's environment now, as a spawned worker had (not the fork server's)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import datetime
    import faulthandler

    # A native crash (SIGSEGV, SIGABRT from the allocator) prints this rank's Python stack to the
    # test's captured stderr, so the report says where the rank died, not only that it did.
    faulthandler.enable(all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    # The package (and with it Lightning, torchmetrics, transformers: ~450,000 objects) is imported by
    # the fork server already (a no-op here, unless its import failed there), and after every task
    # ``release_task_groups`` runs the cycle collector, as the strategy does twice per fit, which would
    # scan them all each time (0.2-0.5 s per rank). Frozen, they are left out of those collections; the
    # objects that the tasks create and drop (process groups, meshes, modules) are not frozen.
    #
    # Note [Frozen between tasks]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Tasks import more than the server preloaded (transformers' model files, torch's DTensor ops and
    # checkpoint code, Lightning's loops, the test modules): after a few tests a worker held ~70,000
    # unfrozen objects that live to its end, and each of the strategy's two collections per fit and
    # the one after every task scanned them all again (~40-60 ms each; about a fifth of the CPU time of
    # the pools' fits, by a sampling profile of a full run). So after each task, once its cycles are
    # collected and its groups destroyed, the worker freezes whatever survived. A frozen object is still
    # freed when its last reference goes; only one that later becomes part of an unreachable cycle would
    # stay (memory only: the task's groups are destroyed and collected before the freeze).
    try:
        import lightning_seqpar  # noqa: F401
    except Exception:  # noqa: BLE001 - a task that needs the package reports the import error itself
        pass
    import gc

    gc.collect()
    gc.freeze()
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            out = fn(rank, world_size, *args, **kwargs)
            release_task_groups()
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            results.put((rank, False, traceback.format_exc()))
        gc.freeze()  # what the task left alive (Note [Frozen between tasks])
    dist.destroy_process_group()
    # The interpreter's shutdown collects every object of torch, Lightning and the tests' modules (seconds
    # per worker on a loaded machine, for each of a session's pools); frozen objects are left to the OS.
    gc.freeze()


def _context() -> Any:
    """Workers are forked from a server process that imported torch and the package once per session
    ("forkserver", with those modules preloaded): a spawned worker imported them itself, 5-6 s of CPU
    per worker, paid again for every pool (2, 3, 4 and 8 ranks, the compile pools) and every restart
    after a crash or a timeout. The server runs no torch operation, so a fork of it starts clean (no
    thread pools, no process group)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning_seqpar"])
    return ctx


class DistPool:
    """``world_size`` gloo ranks kept alive between tests."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results, dict(os.environ)),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results by rank."""
        self.submit(fn, *args, **kwargs)
        return self.collect(fn.__qualname__, timeout=timeout)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Send ``fn`` to every rank without waiting (``collect`` waits); ``run`` does both."""
        module, name = fn.__module__, fn.__qualname__
        if module == "__main__" or "." in name:
            raise ValueError(f"{fn!r} must be a module-level function of an importable module")
        for t in self._tasks:
            t.put((module, name, args, kwargs))

    def collect(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        """The results by rank of the task ``submit`` sent (``name``: the function's, for messages)."""
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, value = self._results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        crashed = self._crashed(wait=0.0)
                        self.close(kill=True)
                        if crashed:
                            raise WorkerCrashed(f"{name}: {crashed} (finished ranks: {sorted(out)})") from None
                        why = f"worker ranks {dead} died" if dead else f"did not finish within {timeout}s"
                        raise TimeoutError(f"{name}: {why} (finished ranks: {sorted(out)})") from None
            if ok:
                out[rank] = value
            else:
                # A rank whose peer crashed fails in its next collective; name the crash, not that.
                crashed = self._crashed(wait=1.0)
                # The other ranks may now wait forever in a collective: do not wait for them.
                self.close(kill=True)
                if crashed:
                    raise WorkerCrashed(f"{name}: {crashed}; rank {rank} then failed with:\n{value}")
                raise AssertionError(f"{name} failed on rank {rank}:\n{value}")
        return [out[r] for r in range(self.world_size)]

    def _crashed(self, wait: float) -> str:
        """'worker rank R died from SIGNAL ...' for the workers a signal ended (waiting up to ``wait``
        seconds for one), or ''."""
        import signal

        deadline = time.monotonic() + wait
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            crashed = [(r, -code) for r, code in dead if code is not None and code < 0]
            if crashed or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return "; ".join(f"worker rank {r} died from {signal.Signals(sig).name} (a native crash; its Python stack, "
                         f"from faulthandler, is in the captured stderr)" for r, sig in crashed)

    def close(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.join()

    def stop(self, kill: bool = False) -> None:
        """Ask every worker to exit (or kill it) without waiting; ``join`` waits."""
        for p, t in zip(self._procs, self._tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                t.put(None)

    def join(self, timeout: float = 10) -> None:
        """Wait up to ``timeout`` seconds for every worker to exit; kill those that do not."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()


_POOLS: dict[tuple[int, str], DistPool] = {}


def get_pool(world_size: int, pool: str = "default") -> DistPool:
    key = (world_size, pool)
    found = _POOLS.get(key)
    if found is None or not found.alive:
        found = _POOLS[key] = DistPool(world_size)
    return found


def pool_threads() -> dict[str, list[int]]:
    """{pool: thread count of each rank} for every live pool (one task on each)."""
    live = {f"{name}-{world_size}": pool for (world_size, name), pool in list(_POOLS.items()) if pool.alive}
    for pool in live.values():  # every pool counts at the same time
        pool.submit(_thread_names_task)
    return {key: [sum(c.values()) for c in pool.collect(_thread_names_task.__name__, timeout=60)]
            for key, pool in live.items()}


def close_pools() -> None:
    """Stop every pool, all at once: a worker's exit takes seconds (the interpreter's shutdown, and a
    compile pool's Inductor workers), so pools closed one after another added up to over 20 s."""
    for pool in _POOLS.values():
        pool.stop()
    for pool in _POOLS.values():
        pool.join(timeout=20)
    _POOLS.clear()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
                    pool: str = "default", **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (pooled; ``pool`` names a
    separate set of workers, e.g. "compile"); results by rank."""
    return get_pool(world_size, pool).run(fn, *args, timeout=timeout, **kwargs)


# ---------------------------------------------------------------------------------------------- forked processes
# Note [Processes forked from the server]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A test that needs a process of its own (a rank that a test kills, in a session of its own, with
# the environment a cluster scheduler gives it) can start it from the same fork server as the
# pools instead of a new interpreter: ``python -m lightning_seqpar.cli`` imports torch, Lightning,
# torchmetrics, transformers and the package first, 7-8 s of CPU per process on the CI machine.
# The child starts its own session (``start_new_session``), writes stdout and stderr to the log,
# replaces its environment with the one given (the C environment too: OpenMP and gloo read it
# later) and calls the function; an exception ends it with exit code 1 and its traceback in the
# log, a signal with minus the signal's number, as for a subprocess. Lightning's own launcher
# re-executes the command line, so runs that use it stay real subprocesses.


def _forked_main(module: str, name: str, args: tuple, environ: dict[str, str], log: str) -> None:
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    getattr(importlib.import_module(module), name)(*args)


class ForkedProcess:
    """``fn(*args)`` in a process forked from the pools' server (Note [Processes forked from the server]),
    with the ``subprocess.Popen`` methods the tests use: ``pid``, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, fn: Callable[..., Any], args: tuple, environ: dict[str, str], log: str) -> None:
        module, name = fn.__module__, fn.__qualname__
        if module == "__main__" or "." in name:
            raise ValueError(f"{fn!r} must be a module-level function of an importable module")
        self.args = (f"{module}.{name}", *args)
        self._proc = _context().Process(target=_forked_main, args=(module, name, args, environ, log))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return None if self._proc.is_alive() else self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._proc.join(timeout)
        if self._proc.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL to its session (the process and whatever it started), if it still runs; then reap it."""
        import signal

        if self._proc.is_alive():
            os.killpg(self.pid, signal.SIGKILL)
            self._proc.join(30)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def tmpdir_shared() -> str:
    return tempfile.mkdtemp(prefix="seqpar-test-")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("import this module from tests")
