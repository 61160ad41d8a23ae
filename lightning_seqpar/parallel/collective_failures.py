"""What a failed collective means, said by the rank that sees it.

Note [Timeouts name themselves]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank that waits longer than the strategy's ``timeout`` in a collective gets the backend's error
("Timed out waiting 8000ms for recv operation", a NCCL watchdog abort), and a rank whose peer died
gets "Connection closed by peer" and the like. ``SequenceParallelStrategy``'s step, backward,
optimizer-step and checkpoint-saving hooks re-raise them (:func:`explain_collective_failure`) as a
``TimeoutError`` / ``ConnectionError`` that says what it means and what to do, and which ranks did
not answer (Note [Naming the rank that failed]).

Note [Naming the rank that failed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When a collective fails, the backend says how (gloo: "Connection closed by peer [addr]:port",
a timeout; NCCL: the watchdog), not which rank is gone. Each rank that sees the failure
writes ``seqpar/alive/<step>/<rank>`` into the default group's store (the rendezvous
TCPStore: hosted by rank 0, or by torchrun's agent) and waits up to ``SILENCE_WAIT``
seconds (at most a quarter of the timeout) for the others' keys: the ranks whose key does
not come are named as dead or stalled. A store that cannot be reached any more means its
host is gone: rank 0 under Lightning's launcher or a plain ``init_process_group``. The
store is torch's private ``_get_default_store``: torch has no public handle to it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

__all__ = ["SILENCE_WAIT", "explain_collective_failure", "explaining_collective_failures", "silent_ranks"]

_TIMEOUT_PATTERN = re.compile(r"timed? ?out|watchdog", re.IGNORECASE)
_PEER_LOST_PATTERN = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|connection closed|socket closed|remote process exited|"
    r"network error|ECONNRESET|EPIPE", re.IGNORECASE)
SILENCE_WAIT = 5.0
"""Seconds a rank waits for the others to answer after a failed collective (Note [Naming the rank that failed])."""


def explain_collective_failure(error: BaseException, *, owner: str, rank: int, where: str, timeout: timedelta | None,
                               step: int) -> Exception | None:
    """The error to raise instead of ``error`` (a backend's RuntimeError) when it is a collective's timeout or a lost
    peer, naming the ranks that did not answer; None when it is neither (Note [Timeouts name themselves])."""
    if not isinstance(error, RuntimeError):  # torch.distributed.DistBackendError is a RuntimeError
        return None
    timed_out, lost = _TIMEOUT_PATTERN.search(str(error)), _PEER_LOST_PATTERN.search(str(error))
    if not (timed_out or lost):
        return None
    silent = silent_ranks(timeout=timeout, step=step)
    if timed_out:
        return TimeoutError(
            f"{owner}: rank {rank} waited longer than timeout={timeout} in a "
            f"collective during {where}: another rank is stalled, has died, or runs a different sequence of "
            "collectives (e.g. a different number of batches). Raise the strategy's `timeout` if steps legitimately "
            f"take that long; otherwise see the other ranks' logs.{silent} ({error})"
        )
    return ConnectionError(
        f"{owner}: rank {rank} lost the connection to another rank in a collective during "
        f"{where}: a rank died (killed, out of memory, a crash) or its host went away.{silent} The run cannot "
        f"continue; resume from the last complete checkpoint (fit(ckpt_path='last')). ({error})"
    )


@contextmanager
def explaining_collective_failures(*, owner: str, rank: int, where: str, timeout: timedelta | None,
                                   step: Callable[[], int]) -> Iterator[None]:
    """Run the block; a collective's timeout or lost peer in it is re-raised as :func:`explain_collective_failure`'s
    error (``step()``: the training step, read when it fails), any other error as it is."""
    try:
        yield
    except RuntimeError as error:  # torch.distributed.DistBackendError is a RuntimeError
        explained = explain_collective_failure(error, owner=owner, rank=rank, where=where, timeout=timeout, step=step())
        if explained is None:
            raise
        raise explained from error


def silent_ranks(*, timeout: timedelta | None, step: int) -> str:
    """' Ranks [..] did not answer ...' for the message of a failed collective (Note [Naming the rank that failed]), or ''."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ""
    world, rank = dist.get_world_size(), dist.get_rank()
    wait = min(SILENCE_WAIT, timeout.total_seconds() / 4) if timeout is not None else SILENCE_WAIT
    keys = [f"seqpar/alive/{step}/{r}" for r in range(world)]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[rank], "1")
        deadline = time.monotonic() + wait
        silent = [r for r in range(world) if r != rank]
        while silent and time.monotonic() < deadline:
            time.sleep(0.05)
            silent = [r for r in silent if not store.check([keys[r]])]
    except Exception as error:  # noqa: BLE001 - the store's host is gone: that is the answer
        return (f" The rendezvous store (hosted by rank 0 unless torchrun's agent hosts it) cannot be reached "
                f"either ({type(error).__name__}): rank 0 has died.")
    if not silent:
        return " Every rank answered afterwards (none of them died)."
    return (f" Rank(s) {silent} did not answer within {wait:.0f}s of the failure: they died or are stalled; see "
            "their logs (or the launcher's exit codes).")
