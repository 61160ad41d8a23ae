"""Faults of real multi-process runs: SIGTERM, SIGKILL of one rank, a stalled rank.

* SIGTERM: `seqpar fit` (2 processes, Lightning's launcher) is signalled mid-epoch; the
  ``PreemptionCheckpoint`` callback writes a checkpoint at the end of the step on both ranks and
  the run exits 0; `fit --ckpt_path last` continues with bit-identical losses.
* SIGKILL: rank 1 is killed during a training step (each rank a process of its own, as a cluster
  scheduler starts them, forked from the pools' server: Note [Processes forked from the server] in
  dist_utils); rank 0 fails by itself within the strategy's timeout naming the dead
  rank, nothing is saved after the failure, and resuming from the last periodic checkpoint gives
  bit-identical losses. A kill during a checkpoint save leaves the last complete checkpoint the latest.
* Stall: one rank sleeps in ``training_step``; the other fails with a clear error within the
  strategy's ``timeout``.

Every subprocess runs under a timeout and is killed (its process group) when the test ends.
The reference losses come from the same configuration run without interruption on pooled ranks;
the resumed runs run there too (processes that ran other tests before: only what the checkpoint
holds makes them exact).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dist_utils import run_distributed

TESTS = Path(__file__).parent
STEPS = 9  # 5 batches per epoch: the interruptions below fall in the middle of epoch 1
SAVE_EVERY = 3
PROCESS_TIMEOUT = 150


def _config(root: Path, name: str, *, ckpt_dir: Path, pause_at: int | None = None, timeout: float = 30,
            pause_hook: str = "on_train_batch_end", pause_ranks: list[int] | None = None,
            pause_in_save_at: int | None = None) -> Path:
    """A `seqpar fit` config: tiny GQA Llama, sp=2 ring, periodic + preemption checkpoints, CSV losses."""
    callbacks: list[dict[str, Any]] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(ckpt_dir), "filename": "{step}", "every_n_train_steps": SAVE_EVERY,
                       "save_top_k": -1, "save_last": True}},
        {"class_path": "lightning_seqpar.PreemptionCheckpoint", "init_args": {"dirpath": str(ckpt_dir)}},
    ]
    if pause_at is not None:
        callbacks.append({"class_path": "fault_injection.PauseAtStep",
                          "init_args": {"step": pause_at, "marker_dir": str(root / name / "markers"), "hook": pause_hook,
                                        "ranks": pause_ranks}})
    if pause_in_save_at is not None:
        callbacks.append({"class_path": "fault_injection.PauseInCheckpointSave",
                          "init_args": {"step": pause_in_save_at, "marker_dir": str(root / name / "markers")}})
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "precision": "32-true",
            "strategy": {"class_path": "lightning_seqpar.SequenceParallelStrategy",
                         "init_args": {"sequence_parallel_size": 2, "attention": "ring", "timeout": timeout}},
            "max_steps": STEPS, "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root / name)}},
            "callbacks": callbacks,
        },
        "model": {"model": "tiny", "lr": 1e-3, "warmup_steps": 2, "max_steps": 20},
        "data": {"class_path": "lightning_seqpar.data.LongRangeDataModule",
                 "init_args": {"vocab_size": 256, "seq_len": 32, "batch_size": 2, "num_samples": 10, "val_samples": 0,
                               "supervise": "all"}},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _losses(save_dir: Path) -> dict[int, float]:
    """{step: train/loss} from the CSV logs under ``save_dir``."""
    out: dict[int, float] = {}
    for path in sorted(save_dir.glob("lightning_logs/version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(key, None)
    return env


class _Run:
    """A launched command in its own process group, killed (the group) on exit."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(args, env=_env(), stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float = PROCESS_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.proc.args} did not finish within {timeout}s:\n{self.tail()}")

    def tail(self) -> str:
        self._out.flush()
        return self.log.read_text()[-4000:]

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._out.close()


def _seqpar(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lightning_seqpar.cli", "fit", "--config", str(config), *extra]


def _wait_for_pause(run: Any, markers: Path, timeout: float = PROCESS_TIMEOUT, ranks: int = 2) -> dict[int, int]:
    """{rank: pid} once ``ranks`` ranks paused."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {int(p.name.split("-")[1]): int(p.read_text()) for p in markers.glob("paused-*")} if markers.is_dir() else {}
        if len(found) == ranks:
            return found
        if run.poll() is not None:
            pytest.fail(f"the run exited ({run.poll()}) before pausing:\n{run.tail()}")
        time.sleep(0.1)
    pytest.fail(f"the run did not pause within {timeout}s:\n{run.tail()}")


def _reference_run(rank: int, world_size: int, config: str, *extra: str) -> None:
    """The CLI's fit on a pooled gloo rank (``extra``: more CLI arguments, e.g. ``--ckpt_path last``)."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    saved = dict(os.environ)
    from lightning_seqpar.cli.seqpar import make_cli

    try:
        make_cli(["fit", "--config", config, *extra])
    finally:  # seed_everything sets PL_GLOBAL_SEED: keep the pooled worker as it was
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses (the same configuration on pooled gloo ranks)."""
    root = tmp_path_factory.mktemp("reference")
    config = _config(root, "ref", ckpt_dir=root / "ckpt")
    run_distributed(_reference_run, 2, str(config), timeout=PROCESS_TIMEOUT)
    losses = _losses(root / "ref")
    assert sorted(losses) == list(range(STEPS))
    return losses


def _meta_step(checkpoint: Path) -> int:
    return int(torch.load(checkpoint / "meta.pt", weights_only=True)["global_step"])


@pytest.mark.timeout(2 * PROCESS_TIMEOUT + 60)
def test_sigterm_writes_a_checkpoint_and_resume_is_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    config = _config(tmp_path, "a", ckpt_dir=ckpt, pause_at=7)
    with _Run(_seqpar(config), tmp_path / "a.log") as run:
        pids = _wait_for_pause(run, tmp_path / "a" / "markers")
        assert pids[0] == run.proc.pid  # rank 0 is the process we started; Lightning launched rank 1
        os.kill(pids[0], signal.SIGTERM)  # one rank is signalled, as a scheduler signals the main process
        (tmp_path / "a" / "markers" / "continue").touch()
        assert run.wait() == 0, run.tail()
    assert _meta_step(ckpt / "preempted.ckpt") == 7  # written at the end of the step that was running
    assert _meta_step(ckpt / "last.ckpt") == 6
    first = _losses(tmp_path / "a")
    assert first == {s: reference[s] for s in range(7)}  # stopped after step 7 (CSV steps 0..6)

    # `--ckpt_path last` takes the newest of the periodic "last" and the preemption checkpoint. Resumed on the
    # pooled ranks: processes that ran other tests before, so only what the checkpoint holds makes it exact
    resume = _config(tmp_path, "b", ckpt_dir=ckpt)
    run_distributed(_reference_run, 2, str(resume), "--ckpt_path", "last", timeout=PROCESS_TIMEOUT)
    assert _losses(tmp_path / "b") == {s: reference[s] for s in range(7, STEPS)}  # bit-identical


# ---------------------------------------------------------------------------------------------- kill -9, ranks on their own
# torchrun ends the other ranks as soon as one dies, so its runs never show what a survivor does. Here
# each rank is a process of its own (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* in its environment, as
# a cluster scheduler starts them; Lightning then launches nothing): after a kill -9 of one, the other
# must fail by itself, within the strategy's timeout, naming the dead rank.

KILL_TIMEOUT = 30.0  # the strategy's timeout in these runs (seconds)


def cli_rank(argv: list[str]) -> None:
    """One rank's ``seqpar`` run, in a process forked from the pools' server (dist_utils.ForkedProcess)."""
    from lightning_seqpar.cli.seqpar import main

    main(argv)


class _Ranks:
    """``world`` ranks started as separate processes (``seqpar <argv>`` each, forked from the pools' server:
    Note [Processes forked from the server] in dist_utils), each with its own log; all killed on exit."""

    def __init__(self, argv: list[str], logs: Path, world: int = 2) -> None:
        from dist_utils import ForkedProcess, _free_port

        port = str(_free_port())
        self.logs = [logs.with_name(f"{logs.name}.rank{r}.log") for r in range(world)]
        self._outs = [log.open("w") for log in self.logs]
        self.procs = []
        for rank in range(world):
            env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            self.procs.append(ForkedProcess(cli_rank, (argv,), env, str(self.logs[rank])))

    def poll(self) -> int | None:
        """None while every rank runs, else the exit code of one that ended."""
        codes = [p.poll() for p in self.procs]
        return next((c for c in codes if c is not None), None)

    def wait(self, rank: int, timeout: float = PROCESS_TIMEOUT) -> int:
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} did not exit within {timeout}s:\n{self.tail()}")

    def tail(self) -> str:
        for out in self._outs:
            out.flush()
        return "\n".join(f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(self.logs))

    def __enter__(self) -> _Ranks:
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.kill()
        for out in self._outs:
            out.close()


def _cli(config: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(config), *extra]


def _kill_and_time_the_survivor(ranks: _Ranks, victim: int, survivor: int) -> tuple[float, str]:
    """kill -9 ``victim``; (seconds until ``survivor`` exited, its log)."""
    os.kill(ranks.procs[victim].pid, signal.SIGKILL)
    killed = time.monotonic()
    code = ranks.wait(survivor, timeout=KILL_TIMEOUT + 60)
    after = time.monotonic() - killed
    assert code != 0, ranks.tail()
    assert ranks.wait(victim) == -signal.SIGKILL
    return after, ranks.logs[survivor].read_text()


@pytest.mark.timeout(2 * PROCESS_TIMEOUT + 60)
def test_kill_9_during_a_training_step_names_the_dead_rank_and_resume_is_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # rank 1 pauses inside the step after optimizer step 7 (forward done, backward's collectives ahead)
    config = _config(tmp_path, "a", ckpt_dir=ckpt, pause_at=7, pause_hook="on_before_backward", pause_ranks=[1],
                     timeout=KILL_TIMEOUT)
    with _Ranks(_cli(config), tmp_path / "a") as ranks:
        _wait_for_pause(ranks, tmp_path / "a" / "markers", ranks=1)
        after, log = _kill_and_time_the_survivor(ranks, victim=1, survivor=0)
    assert after < KILL_TIMEOUT, f"rank 0 took {after:.1f}s to fail:\n{log[-3000:]}"
    assert "ConnectionError: SequenceParallelStrategy: rank 0 lost the connection to another rank in a collective" in log, log[-3000:]
    assert "Rank(s) [1] did not answer" in log, log[-3000:]
    assert _meta_step(ckpt / "last.ckpt") == 6  # the last periodic checkpoint, complete
    assert not (ckpt / "preempted.ckpt").exists()  # nothing is saved after a failure
    assert not list(ckpt.glob("*.partial"))

    # resumed on the pooled ranks (as the other resumes here; torchrun's launch of a training is
    # tests/test_multinode.py's): bit-identical losses
    resume = _config(tmp_path, "b", ckpt_dir=ckpt, timeout=KILL_TIMEOUT)
    run_distributed(_reference_run, 2, str(resume), "--ckpt_path", "last", timeout=PROCESS_TIMEOUT)
    assert _losses(tmp_path / "b") == {s: reference[s] for s in range(6, STEPS)}  # bit-identical


@pytest.mark.timeout(2 * PROCESS_TIMEOUT + 60)
def test_kill_9_during_a_checkpoint_save_leaves_the_last_complete_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # rank 0 pauses while writing meta.pt of step=6.ckpt: every rank's shards are written, the checkpoint is not complete
    config = _config(tmp_path, "a", ckpt_dir=ckpt, pause_in_save_at=SAVE_EVERY * 2, timeout=KILL_TIMEOUT)
    with _Ranks(_cli(config), tmp_path / "a") as ranks:
        _wait_for_pause(ranks, tmp_path / "a" / "markers", ranks=1)
        half = ckpt / f"step={SAVE_EVERY * 2}.ckpt.partial"
        assert (half / ".metadata").is_file()  # every rank's shards are written; meta.pt is being written
        after, log = _kill_and_time_the_survivor(ranks, victim=0, survivor=1)
    assert after < KILL_TIMEOUT, f"rank 1 took {after:.1f}s to fail:\n{log[-3000:]}"
    assert "rank 1 lost the connection to another rank in a collective during saving the checkpoint" in log, log[-3000:]
    assert "rank 0 has died" in log, log[-3000:]
    # the half-written checkpoint is never the latest: last.ckpt is the complete one of step 3
    assert not (ckpt / f"step={SAVE_EVERY * 2}.ckpt").exists()
    assert _meta_step(ckpt / "last.ckpt") == SAVE_EVERY
    with pytest.raises(ValueError, match="is not a complete checkpoint"):
        _load_through_the_strategy(half)

    resume = _config(tmp_path, "b", ckpt_dir=ckpt, timeout=KILL_TIMEOUT)  # on the pooled ranks, as above
    run_distributed(_reference_run, 2, str(resume), "--ckpt_path", "last", timeout=PROCESS_TIMEOUT)
    assert _losses(tmp_path / "b") == {s: reference[s] for s in range(SAVE_EVERY, STEPS)}  # bit-identical
    assert not list(ckpt.glob("*.partial"))  # the save of step 6 in the resumed run replaced the half-written one
    assert _meta_step(ckpt / f"step={SAVE_EVERY * 2}.ckpt") == SAVE_EVERY * 2


def _load_through_the_strategy(path: Path) -> None:
    from lightning_seqpar import SequenceParallelStrategy

    strategy = SequenceParallelStrategy(sequence_parallel_size=1)
    strategy.load_checkpoint(path)


# ---------------------------------------------------------------------------------------------- stalled rank

STALL_TIMEOUT = 6.0  # the strategy's timeout in this test (seconds)


def _stalled(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 sleeps in training_step of step 1; every rank reports when and how its run failed."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    marks: dict[str, float] = {}

    class Stalling(CausalLMModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                marks["step_start"] = time.monotonic()
                if rank == 1:
                    time.sleep(1.5 * STALL_TIMEOUT)
            return super().training_step(batch, batch_idx)

    strategy = SequenceParallelStrategy(sequence_parallel_size=2, attention="ring", timeout=STALL_TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    data = CopyTaskDataset(vocab_size=256, seq_len=32, num_samples=8, supervise="all")
    try:
        trainer.fit(Stalling("tiny", warmup_steps=0, max_steps=3), train_dataloaders=DataLoader(data, batch_size=2))
    except Exception as error:  # noqa: BLE001 - the failure is what is measured
        return {"error": f"{type(error).__name__}: {error}", "after": time.monotonic() - marks.get("step_start", 0.0)}
    return {"error": None, "after": None}


@pytest.mark.timeout(240)
def test_stalled_rank_fails_within_the_timeout():
    from dist_utils import get_pool

    try:
        results = run_distributed(_stalled, 2, timeout=120)
    finally:
        get_pool(2).close(kill=True)  # the ranks' process groups saw timeouts: start the next test afresh
    waiting = results[0]
    assert waiting["error"] is not None, "the rank that waited for the stalled one did not fail"
    assert waiting["error"].startswith("TimeoutError: SequenceParallelStrategy: rank 0 waited longer than timeout=0:00:06"), waiting
    assert "another rank is stalled, has died" in waiting["error"]
    assert STALL_TIMEOUT * 0.9 <= waiting["after"] <= STALL_TIMEOUT + 10, waiting
